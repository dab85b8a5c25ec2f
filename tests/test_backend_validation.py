"""Boundary validation of kvcore.backend: every check raises its typed error with a
clear message, from the plan (values) or the run (shapes, dtypes, devices), and
whatever the input, a kernel (the protected hooks) only ever sees inputs that
satisfy the contract."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_torch import TorchBackend

from kvcore import backend_checks
from kvcore.backend import Attention, AttentionPlan, Backend, available, get
from kvcore.backend_checks import ValueChecks, check_cu_seqlens, check_slots, check_table
from kvcore.errors import BadRequest, KVCoreError, Unsupported
from kvcore.layout import KVLayout, cdiv

I32, I64 = torch.int32, torch.int64
NUM_PAGES, PAGE, HKV, D = 4, 4, 2, 8


def cache(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(NUM_PAGES, 2, PAGE, HKV, D, dtype=dtype)


def t32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def t64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=I64)


def call(backend: Backend, op: str, a: dict[str, Any]) -> Any:
    """Plan then run ``op`` as an engine does, from one dict of named arguments."""
    kv = a["kv_cache"]
    if op == "decode":
        plan = backend.plan_decode(kv, a["block_table"], a["seq_lens"])
        return backend.decode(plan, a["query"], kv, a["scale"])
    if op == "prefill":
        plan = backend.plan_prefill(kv, a["block_table"], a["cu_seqlens_q"], a["seq_lens"])
        return backend.prefill(plan, a["query"], kv, a["scale"])
    if op == "write_kv":
        return backend.write_kv(backend.plan_write(kv, a["slots"]), kv, a["key"], a["value"])
    assert op == "copy_pages", op
    return backend.copy_pages(backend.plan_copy(kv, a["src"], a["dst"]), kv)


def decode(**override: Any) -> torch.Tensor:
    args: dict[str, Any] = {
        "query": torch.zeros(2, 4, D),
        "kv_cache": cache(),
        "block_table": t32(0, 1, 2, 3).reshape(2, 2),
        "seq_lens": t32(5, 8),
        "scale": 0.5,
    }
    out: torch.Tensor = call(TorchBackend(), "decode", {**args, **override})
    return out


def prefill(**override: Any) -> torch.Tensor:
    args: dict[str, Any] = {
        "query": torch.zeros(5, 4, D),
        "kv_cache": cache(),
        "block_table": t32(0, 1, 2, 3).reshape(2, 2),
        "cu_seqlens_q": t32(0, 2, 5),
        "seq_lens": t32(5, 8),
        "scale": 0.5,
    }
    out: torch.Tensor = call(TorchBackend(), "prefill", {**args, **override})
    return out


def write_kv(**override: Any) -> None:
    args: dict[str, Any] = {
        "kv_cache": cache(),
        "key": torch.zeros(3, HKV, D),
        "value": torch.zeros(3, HKV, D),
        "slots": t64(0, -1, 15),
    }
    call(TorchBackend(), "write_kv", {**args, **override})


def copy_pages(**override: Any) -> None:
    args: dict[str, Any] = {"kv_cache": cache(), "src": t64(0, 0), "dst": t64(1, 2)}
    call(TorchBackend(), "copy_pages", {**args, **override})


def test_valid_calls_pass() -> None:
    assert decode().shape == (2, 4, D)
    assert prefill().shape == (5, 4, D)
    write_kv()
    copy_pages()


def test_padding_past_the_used_pages_may_hold_anything() -> None:
    table = torch.tensor([[0, -7], [2, 3]], dtype=I32)  # sequence 0 uses only page 0
    decode(block_table=table, seq_lens=t32(4, 8))
    prefill(block_table=table, seq_lens=t32(4, 8), cu_seqlens_q=t32(0, 2, 5))


def test_empty_batches_return_empty() -> None:
    empty_table = torch.zeros(0, 2, dtype=I32)
    out = decode(query=torch.zeros(0, 4, D), block_table=empty_table, seq_lens=t32())
    assert out.shape == (0, 4, D)
    out = prefill(query=torch.zeros(0, 4, D), cu_seqlens_q=t32(0, 0, 0))
    assert out.shape == (0, 4, D)
    write_kv(key=torch.zeros(0, HKV, D), value=torch.zeros(0, HKV, D), slots=t64())
    copy_pages(src=t64(), dst=t64())


BAD_CACHES = [
    ("not a tensor", [[0.0]], "kv_cache must be a torch.Tensor"),
    ("rank 4", torch.zeros(4, 2, 4, 8), "kv_cache must have shape"),
    ("no K/V pair", torch.zeros(4, 3, 4, 2, 8), "kv_cache must have shape"),
    ("no pages", torch.zeros(0, 2, 4, 2, 8), "kv_cache must have shape"),
    ("strided last dim", torch.zeros(4, 2, 4, 2, 16)[..., ::2], "contiguous last dim"),
]


@pytest.mark.parametrize(("what", "bad", "message"), BAD_CACHES, ids=[c[0] for c in BAD_CACHES])
def test_bad_cache_rejected_by_every_operation(what: str, bad: Any, message: str) -> None:
    for op in (decode, prefill, write_kv, copy_pages):
        with pytest.raises(BadRequest, match=message):
            op(kv_cache=bad)


DECODE_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("query rank", {"query": torch.zeros(2, 4)}, r"query must have shape \[2, \*, 8\]"),
    ("query batch", {"query": torch.zeros(3, 4, D)}, r"query must have shape \[2, \*, 8\]"),
    ("query head dim", {"query": torch.zeros(2, 4, 4)}, r"query must have shape"),
    ("query dtype", {"query": torch.zeros(2, 4, D, dtype=torch.float16)}, "query has dtype"),
    ("query device", {"query": torch.zeros(2, 4, D, device="meta")}, "query is on meta"),
    ("query strided", {"query": torch.zeros(2, 4, 2 * D)[..., ::2]}, "query must have a contig"),
    ("gqa", {"query": torch.zeros(2, 3, D)}, r"query heads \(3\) must be a positive multiple"),
    ("no heads", {"query": torch.zeros(2, 0, D)}, "positive multiple"),
    (
        "table dtype",
        {"block_table": torch.zeros(2, 2, dtype=I64)},
        "block_table must be torch.int32",
    ),
    ("table rank", {"block_table": t32(0, 1)}, r"block_table must have shape \[\*, \*\]"),
    (
        "table rows",
        {"block_table": torch.zeros(3, 2, dtype=I32)},
        r"seq_lens must have shape \[3\]",
    ),
    ("lens dtype", {"seq_lens": t64(5, 8)}, "seq_lens must be torch.int32"),
    ("lens rows", {"seq_lens": t32(5)}, r"seq_lens must have shape \[2\]"),
    ("lens zero", {"seq_lens": t32(0, 8)}, "seq_lens must be >= 1"),
    ("lens too long", {"seq_lens": t32(5, 9)}, "seq_lens must be <= max_pages"),
    ("page -1", {"block_table": t32(0, -1, 2, 3).reshape(2, 2)}, r"block_table\[0, 1\] = -1"),
    ("page past", {"block_table": t32(0, 1, 4, 3).reshape(2, 2)}, r"block_table\[1, 0\] = 4"),
    ("page huge", {"block_table": t32(0, 1, 2, 2**31 - 1).reshape(2, 2)}, "is not a page"),
    ("scale nan", {"scale": float("nan")}, "scale must be a finite float"),
    ("scale inf", {"scale": float("inf")}, "scale must be a finite float"),
    ("scale str", {"scale": "0.5"}, "scale must be a finite float"),
    ("scale bool", {"scale": True}, "scale must be a finite float"),
]


@pytest.mark.parametrize(
    ("what", "bad", "message"), DECODE_ERRORS, ids=[c[0] for c in DECODE_ERRORS]
)
def test_decode_errors(what: str, bad: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode(**bad)


def test_prefill_shares_the_decode_checks() -> None:
    with pytest.raises(BadRequest, match=r"block_table\[0, 1\] = -1"):
        prefill(block_table=t32(0, -1, 2, 3).reshape(2, 2))
    with pytest.raises(BadRequest, match="query heads"):
        prefill(query=torch.zeros(5, 3, D))


PREFILL_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("cu dtype", {"cu_seqlens_q": t64(0, 2, 5)}, "cu_seqlens_q must be torch.int32"),
    ("cu rank", {"cu_seqlens_q": t32(0, 2, 5).reshape(1, 3)}, r"cu_seqlens_q must have shape"),
    ("cu empty", {"cu_seqlens_q": t32()}, "B \\+ 1 >= 1"),
    ("cu start", {"cu_seqlens_q": t32(1, 2, 5)}, r"cu_seqlens_q\[0\] must be 0"),
    (
        "cu end",
        {"cu_seqlens_q": t32(0, 2, 4)},
        r"^query has 5 rows; it must have the plan's total_q = cu_seqlens_q\[-1\] = 4$",
    ),
    (
        "cu decreasing",
        {"cu_seqlens_q": t32(0, 6, 5), "query": torch.zeros(5, 4, D)},
        "must not decrease",
    ),
    (
        "q_len > seq_len",
        {"cu_seqlens_q": t32(0, 5, 5), "seq_lens": t32(4, 8)},
        r"q_len .* must be <= seq_lens\[b\]; first bad b = 0",
    ),
    ("batch mismatch", {"cu_seqlens_q": t32(0, 5)}, r"block_table must have shape \[1, \*\]"),
]


@pytest.mark.parametrize(
    ("what", "bad", "message"), PREFILL_ERRORS, ids=[c[0] for c in PREFILL_ERRORS]
)
def test_prefill_errors(what: str, bad: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        prefill(**bad)


WRITE_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("key heads", {"key": torch.zeros(3, 1, D)}, r"key must have shape \[3, 2, 8\]"),
    ("key dtype", {"key": torch.zeros(3, HKV, D, dtype=torch.bfloat16)}, "key has dtype"),
    ("value shape", {"value": torch.zeros(2, HKV, D)}, r"value must have shape \[3, 2, 8\]"),
    ("value strided", {"value": torch.zeros(3, HKV, 2 * D)[..., ::2]}, "value must have a contig"),
    ("slots dtype", {"slots": t32(0, 1, 2)}, "slots must be torch.int64"),
    ("slots length", {"slots": t64(0, 1)}, r"key must have shape \[2, 2, 8\]"),
    ("slots rank", {"slots": t64(0, 1, 2).reshape(1, 3)}, r"slots must have shape \[\*\]"),
    ("slot past", {"slots": t64(0, 16, 1)}, "slots must be < num_pages \\* page_size = 16; got 16"),
    ("slot repeated", {"slots": t64(3, -1, 3)}, "must not repeat"),
    ("slots device", {"slots": torch.zeros(3, dtype=I64, device="meta")}, "slots is on meta"),
]


@pytest.mark.parametrize(("what", "bad", "message"), WRITE_ERRORS, ids=[c[0] for c in WRITE_ERRORS])
def test_write_kv_errors(what: str, bad: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        write_kv(**bad)


def test_write_kv_allows_repeated_negative_slots() -> None:
    write_kv(slots=t64(-1, -1, -5))


COPY_ERRORS: list[tuple[str, dict[str, Any], str]] = [
    ("src dtype", {"src": t32(0, 0)}, "src must be torch.int64"),
    ("length", {"dst": t64(1)}, r"dst must have shape \[2\]"),
    ("src past", {"src": t64(0, 4)}, r"src pages must lie in \[0, 4\): entry 1 is 4"),
    ("src negative", {"src": t64(-1, 0)}, "entry 0 is -1"),
    ("dst past", {"dst": t64(1, 9)}, r"dst pages must lie in \[0, 4\)"),
    ("dst repeated", {"dst": t64(2, 2)}, "dst must not repeat"),
    ("dst is a src", {"src": t64(0, 1), "dst": t64(1, 2)}, "dst must not name a page that src"),
]


@pytest.mark.parametrize(("what", "bad", "message"), COPY_ERRORS, ids=[c[0] for c in COPY_ERRORS])
def test_copy_pages_errors(what: str, bad: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        copy_pages(**bad)


def test_undeclared_configurations_are_unsupported() -> None:
    with pytest.raises(Unsupported, match="dtype=float64"):
        decode(query=torch.zeros(2, 4, D, dtype=torch.float64), kv_cache=cache(torch.float64))
    big = torch.zeros(1, 2, 1, 1, 264)
    with pytest.raises(Unsupported, match="head_dim=264"):
        TorchBackend().plan_copy(big, t64(), t64())
    with pytest.raises(Unsupported, match="page_size=129"):
        TorchBackend().plan_copy(torch.zeros(1, 2, 129, 1, 4), t64(), t64())


# -- fuzz: bad input never crashes and never reaches a kernel ---------------------------


class Guarded(TorchBackend):
    """Asserts, inside each kernel hook, the contract validation promises."""

    name = "guarded"

    def _decode(self, plan: Any, query: Any, kv_cache: Any, scale: float) -> Any:
        _assert_table(kv_cache, plan.block_table, plan.seq_lens)
        assert query.shape[0] == plan.batch and kv_cache.shape == plan.cache.shape
        return super()._decode(plan, query, kv_cache, scale)

    def _prefill(self, plan: Any, query: Any, kv_cache: Any, scale: float) -> Any:
        _assert_table(kv_cache, plan.block_table, plan.seq_lens)
        cu = plan.cu_seqlens_q
        q_lens = cu[1:] - cu[:-1]
        assert int(cu[0]) == 0 and int(cu[-1]) == query.shape[0]
        assert bool(((q_lens >= 0) & (q_lens <= plan.seq_lens)).all())
        return super()._prefill(plan, query, kv_cache, scale)

    def _write_kv(self, plan: Any, kv_cache: Any, key: Any, value: Any) -> None:
        slots = plan.slots
        assert slots.dtype == I64 and bool((slots < kv_cache.shape[0] * kv_cache.shape[2]).all())
        assert key.shape[0] == value.shape[0] == slots.shape[0]
        super()._write_kv(plan, kv_cache, key, value)

    def _copy_pages(self, plan: Any, kv_cache: Any) -> None:
        n, src, dst = kv_cache.shape[0], plan.src, plan.dst
        assert bool(((src >= 0) & (src < n) & (dst >= 0) & (dst < n)).all())
        super()._copy_pages(plan, kv_cache)


def _assert_table(kv_cache: Any, table: Any, seq_lens: Any) -> None:
    n, ps = kv_cache.shape[0], kv_cache.shape[2]
    assert table.dtype == I32 and seq_lens.dtype == I32
    for b, length in enumerate(seq_lens.tolist()):
        assert 1 <= length <= table.shape[1] * ps
        used = table[b, : cdiv(length, ps)]
        assert bool(((used >= 0) & (used < n)).all()), "an out-of-range page reached a kernel"


# -- plans: made once, checked cheaply at every run ----------------------------------


def test_a_plan_runs_only_on_its_backend_and_geometry() -> None:
    backend = TorchBackend()
    kv = cache()
    plan = backend.plan_decode(kv, t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8))
    query = torch.zeros(2, 4, D)
    with pytest.raises(BadRequest, match="a plan of backend 'torch' given to 'guarded'"):
        Guarded().decode(plan, query, kv, 0.5)
    with pytest.raises(BadRequest, match="expected a PrefillPlan, got DecodePlan"):
        backend.prefill(plan, query, kv, 0.5)  # type: ignore[arg-type]
    other = torch.zeros(NUM_PAGES + 1, 2, PAGE, HKV, D)
    with pytest.raises(BadRequest, match="is not the cache the plan was made for"):
        backend.decode(plan, query, other, 0.5)
    with pytest.raises(BadRequest, match="is not the cache the plan was made for"):
        backend.decode(plan, query.double(), kv.double(), 0.5)


def test_one_step_plan_validates_writes_and_copies_too() -> None:
    backend = TorchBackend()
    kv, table, lens = cache(), t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8)
    with pytest.raises(BadRequest, match="must not repeat"):
        backend.plan_decode(kv, table, lens, slots=t64(3, 3))
    with pytest.raises(BadRequest, match="dst must not name a page that src"):
        backend.plan_decode(kv, table, lens, copies=(t64(0, 1), t64(1, 2)))
    plan = backend.plan_prefill(
        kv, table, t32(0, 2, 5), lens, slots=t64(4, -1, 5, 6, 7), copies=(t64(0), t64(3))
    )
    assert plan.write is not None and plan.write.skips and plan.copy is not None
    assert plan.host_seq_lens == (5, 8) and plan.total_q == 5
    k = torch.ones(5, HKV, D)
    backend.copy_pages(plan.copy, kv)
    backend.write_kv(plan.write, kv, k, 2 * k)
    assert kv[1, 0, 0].eq(1).all() and kv[1, 1, 1].eq(2).all() and kv[1, 0, 3].eq(1).all()
    assert backend.prefill(plan, torch.zeros(5, 4, D), kv, 0.5).shape == (5, 4, D)
    assert plan.write.prepared is not None  # the scatter index, computed once


def test_step_plans_are_frozen_and_share_their_tables() -> None:
    """A decode and a prefill plan are frozen AttentionPlans: every layer and thread
    reads the one plan of a step, and nothing can change it under them."""
    backend = TorchBackend()
    kv, table, lens = cache(), t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8)
    plans = (
        backend.plan_decode(kv, table, lens),
        backend.plan_prefill(kv, table, t32(0, 2, 5), lens),
    )
    for plan in plans:
        assert isinstance(plan, AttentionPlan) and plan.batch == 2
        assert plan.host_seq_lens == (5, 8) and plan.block_table.equal(table)
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.seq_lens = lens  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plans[1].host_cu_seqlens_q = (0, 5, 5)  # type: ignore[misc]


@st.composite
def valid_call(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid call of one operation on a small random configuration."""
    ps, hkv, d = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([2, 4]))
    num_pages, batch, max_pages = (draw(st.integers(1, 5)) for _ in range(3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kv = torch.zeros(num_pages, 2, ps, hkv, d)
    lens = torch.randint(1, max_pages * ps + 1, (batch,), generator=g)
    table = torch.randint(-3, num_pages + 4, (batch, max_pages), generator=g)  # padding: anything
    for b in range(batch):
        used = cdiv(int(lens[b]), ps)
        table[b, :used] = torch.randint(0, num_pages, (used,), generator=g)
    q_lens = [int(torch.randint(0, int(n) + 1, (), generator=g)) for n in lens]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=I32)
    hq = hkv * draw(st.integers(1, 2))
    op = draw(st.sampled_from(["decode", "prefill", "write_kv", "copy_pages"]))
    if op == "decode":
        q = torch.zeros(batch, hq, d)
        return op, {
            "query": q,
            "kv_cache": kv,
            "block_table": table.to(I32),
            "seq_lens": lens.to(I32),
            "scale": 0.5,
        }
    if op == "prefill":
        q = torch.zeros(int(cu[-1]), hq, d)
        return op, {
            "query": q,
            "kv_cache": kv,
            "block_table": table.to(I32),
            "cu_seqlens_q": cu,
            "seq_lens": lens.to(I32),
            "scale": 0.5,
        }
    if op == "write_kv":
        n = int(torch.randint(0, num_pages * ps + 1, (), generator=g))
        slots = torch.randperm(num_pages * ps, generator=g)[:n]
        slots[torch.rand(n, generator=g) < 0.3] = -1
        k = torch.zeros(n, hkv, d)
        return op, {"kv_cache": kv, "key": k, "value": k, "slots": slots}
    perm = torch.randperm(num_pages, generator=g)
    n = int(torch.randint(0, num_pages // 2 + 1, (), generator=g))
    src = perm[n:][torch.randint(0, num_pages - n, (n,), generator=g)]
    return op, {"kv_cache": kv, "src": src, "dst": perm[:n]}


@st.composite
def fuzz_call(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid call with up to three of its arguments damaged: an entry set to an
    arbitrary value, a dtype changed, a dim grown or cut, a device or stride changed."""
    op, kwargs = draw(valid_call())
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(sorted(kwargs)))
        arg = kwargs[name]
        if not isinstance(arg, torch.Tensor):
            kwargs[name] = draw(st.sampled_from([float("nan"), -1.0, "x", None]))
            continue
        how = draw(st.sampled_from(["entry", "entry", "dtype", "shape", "device", "stride"]))
        if how == "entry" and arg.numel() > 0:
            flat = arg.clone().reshape(-1)
            value = torch.tensor(draw(st.integers(-(2**31), 2**31 - 1))).to(arg.dtype)  # may wrap
            flat[draw(st.integers(0, flat.numel() - 1))] = value
            kwargs[name] = flat.reshape(arg.shape)
        elif how == "dtype":
            dtype = draw(st.sampled_from([I32, I64, torch.float16, torch.float64, torch.uint8]))
            kwargs[name] = arg.to(dtype)
        elif how == "shape" and arg.dim() > 0:
            dim = draw(st.integers(0, arg.dim() - 1))
            size = draw(st.integers(0, arg.shape[dim] + 2))
            new_shape = list(arg.shape)
            new_shape[dim] = size
            kwargs[name] = torch.zeros(new_shape, dtype=arg.dtype)
        elif how == "device":
            kwargs[name] = arg.to("meta")
        elif how == "stride" and arg.dim() > 0:
            kwargs[name] = torch.cat([arg, arg], dim=-1)[..., ::2]
    return op, kwargs


@settings(max_examples=400, deadline=None)
@given(fuzz_call())
def test_bad_input_raises_typed_errors_and_never_reaches_a_kernel(
    case: tuple[str, dict[str, Any]],
) -> None:
    op, kwargs = case
    with contextlib.suppress(KVCoreError):  # BadRequest or Unsupported, never a crash
        call(Guarded(), op, kwargs)


def test_meta_tensors_raise_typed_errors() -> None:
    """A meta tensor holds no values: the capabilities (no meta device) or the device
    check refuse it before any value check reads one (seeds 5 and 10 of the fuzz test
    found this)."""
    meta = cache().to("meta")
    with pytest.raises(Unsupported, match="device=meta"):
        decode(
            kv_cache=meta,
            query=torch.zeros(2, 4, D, device="meta"),
            block_table=t32(0, 1, 2, 3).reshape(2, 2).to("meta"),
            seq_lens=t32(5, 8).to("meta"),
        )
    with pytest.raises(Unsupported, match="device=meta"):
        write_kv(kv_cache=meta, slots=t64(0, -1, 15).to("meta"))
    with pytest.raises(BadRequest, match="seq_lens is on meta"):
        decode(seq_lens=t32(5, 8).to("meta"))


@settings(max_examples=50, deadline=None)
@given(valid_call())
def test_valid_random_calls_pass(case: tuple[str, dict[str, Any]]) -> None:
    op, kwargs = case
    call(Guarded(), op, kwargs)


def _step(device: str) -> tuple[Any, ...]:
    kv = torch.randn(NUM_PAGES, 2, PAGE, HKV, D, device=device)
    table = t32(0, 1, 2, 3).reshape(2, 2).to(device)
    copies = (t64(3).to(device), t64(2).to(device))
    return kv, table, t32(5, 8).to(device), t64(5, 8).to(device), copies


def test_runs_read_no_tensor_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the plan, copy/write/decode/prefill never bring a value to the host: any
    Python-side read of a tensor (``item``, ``tolist``, ``bool``, ``int``) fails."""
    backend = TorchBackend()
    kv, table, lens, slots, copies = _step("cpu")
    plan = backend.plan_decode(kv, table, lens, slots=slots, copies=copies)
    prefill = backend.plan_prefill(kv, table, t32(0, 2, 5), lens)
    assert plan.write is not None and plan.copy is not None

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a run read a tensor value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for layer in (kv, kv.clone()):
        backend.copy_pages(plan.copy, layer)
        backend.write_kv(plan.write, layer, torch.ones(2, HKV, D), torch.ones(2, HKV, D))
        backend.decode(plan, torch.zeros(2, 4, D), layer, 0.5)
        backend.prefill(prefill, torch.zeros(5, 4, D), layer, 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "triton", "cupy"])
def test_runs_never_synchronise_on_cuda(name: str) -> None:
    """torch's sync debug mode turns any device synchronisation of a run into an error."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvcore import backend as registry

    try:
        backend = registry.get(name)
    except Unsupported as exc:
        pytest.skip(str(exc))
    kv, table, lens, slots, copies = _step("cuda")
    kv = torch.randn(NUM_PAGES, 2, PAGE, HKV, 64, device="cuda", dtype=torch.float16)
    plan = backend.plan_decode(kv, table, lens, slots=slots, copies=copies)
    prefill = backend.plan_prefill(kv, table, t32(0, 2, 5).cuda(), lens)
    assert plan.write is not None and plan.copy is not None
    k = torch.ones(2, HKV, 64, device="cuda", dtype=torch.float16)
    query = torch.zeros(5, 4, 64, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.copy_pages(plan.copy, kv)
        backend.write_kv(plan.write, kv, k, k)
        backend.decode(plan, query[:2], kv, 0.125)
        backend.prefill(prefill, query, kv, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode(0)


POOLS = [
    (KVLayout(1, HKV, D, PAGE, "float8_e4m3fn", NUM_PAGES), "fp8"),
    (KVLayout(1, HKV, D, PAGE, "float8_e5m2", NUM_PAGES), "fp8"),
    (KVLayout(1, 1, 24, PAGE, "bfloat16", NUM_PAGES, kind="latent"), "mla"),
]


@pytest.mark.parametrize(("layout", "feature"), POOLS, ids=["e4m3fn", "e5m2", "latent"])
def test_fp8_and_latent_pools_need_their_feature(layout: KVLayout, feature: str) -> None:
    """Each installed backend plans a pool's layer view of an fp8 or latent pool when it
    declares the feature, and otherwise refuses it in every plan, naming the feature,
    before any value is read."""
    (view,) = layout.layer_views(torch.zeros(layout.total_bytes, dtype=torch.uint8))
    attention = Attention(v_head_dim=16) if layout.kind == "latent" else None
    plans: list[Callable[[Backend], object]] = [
        lambda b: b.plan_decode(view, t32(0, 1).reshape(1, 2), t32(5), attention=attention),
        lambda b: b.plan_prefill(
            view, t32(0, 1).reshape(1, 2), t32(0, 5), t32(5), attention=attention
        ),
        lambda b: b.plan_write(view, t64(0)),
        lambda b: b.plan_copy(view, t64(0), t64(1)),
    ]
    for name in available():
        try:
            backend = get(name)
        except Unsupported:  # cannot load here (cupy without a GPU)
            continue
        if "cpu" not in backend.capabilities.devices:
            continue
        for plan in plans:
            if feature in backend.capabilities.features:
                plan(backend)
                continue
            with pytest.raises(Unsupported, match=f"does not declare feature {feature}"):
                plan(backend)


class Plain(TorchBackend):
    """The reference's kernels, declaring no feature: what today's other backends are."""

    name = "plain"
    capabilities = dataclasses.replace(
        TorchBackend.capabilities,
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
        features=frozenset(),
    )


@pytest.mark.parametrize(
    ("attention", "feature"),
    [
        (Attention(window_left=0), "window"),
        (Attention(logits_soft_cap=30.0), "soft_cap"),
        (Attention(sinks=True), "sinks"),
    ],
    ids=["window", "soft_cap", "sinks"],
)
def test_undeclared_features_are_unsupported_in_the_plan(
    attention: Attention, feature: str
) -> None:
    backend, kv, table, lens = Plain(), cache(), t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8)
    with pytest.raises(Unsupported, match=f"'plain' does not declare feature {feature}"):
        backend.plan_decode(kv, table, lens, attention=attention)
    with pytest.raises(Unsupported, match=f"does not declare feature {feature}"):
        backend.plan_prefill(kv, table, t32(0, 2, 5), lens, attention=attention)
    with pytest.raises(Unsupported, match=f"does not declare feature {feature}"):
        backend.check_supported(kv, attention)
    fp8 = cache().to(torch.float8_e4m3fn)
    with pytest.raises(Unsupported, match="does not declare feature fp8"):
        backend.plan_write(fp8, t64(0))
    backend.plan_decode(kv, table, lens, attention=Attention())  # the default needs none


LATENT = torch.zeros(NUM_PAGES, 1, PAGE, 1, 20)
BAD_OPTIONS: list[tuple[str, Any, torch.Tensor, str]] = [
    ("window -2", Attention(window_left=-2), cache(), "window_left must be an int >= -1"),
    ("window float", Attention(window_left=1.5), cache(), "window_left must be an int"),  # type: ignore[arg-type]
    ("window bool", Attention(window_left=True), cache(), "window_left must be an int"),
    ("cap negative", Attention(logits_soft_cap=-1.0), cache(), "logits_soft_cap must be"),
    ("cap nan", Attention(logits_soft_cap=float("nan")), cache(), "logits_soft_cap must be"),
    ("cap inf", Attention(logits_soft_cap=float("inf")), cache(), "logits_soft_cap must be"),
    ("sinks str", Attention(sinks="yes"), cache(), "sinks must be a bool"),  # type: ignore[arg-type]
    ("v_head_dim on kv", Attention(v_head_dim=4), cache(), "for latent .MLA. caches only"),
    ("latent without", Attention(), LATENT, "a latent cache needs v_head_dim"),
    ("v_head_dim 0", Attention(v_head_dim=0), LATENT, r"in \(0, head_dim = 20\]"),
    ("v_head_dim > D", Attention(v_head_dim=21), LATENT, "a latent cache needs v_head_dim"),
    ("not an Attention", {"window_left": 3}, cache(), "attention must be an Attention"),
]


@pytest.mark.parametrize(
    ("what", "attention", "kv", "message"), BAD_OPTIONS, ids=[c[0] for c in BAD_OPTIONS]
)
def test_bad_attention_options_are_bad_requests_in_the_plan(
    what: str, attention: Any, kv: torch.Tensor, message: str
) -> None:
    backend, table, lens = TorchBackend(), t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8)
    with pytest.raises(BadRequest, match=message):
        backend.plan_decode(kv, table, lens, attention=attention)
    with pytest.raises(BadRequest, match=message):
        backend.plan_prefill(kv, table, t32(0, 2, 5), lens, attention=attention)


def test_bad_run_arguments_of_features_are_bad_requests() -> None:
    backend, table, lens = TorchBackend(), t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8)
    fp8 = cache().to(torch.float8_e5m2)
    plan = backend.plan_decode(fp8, table, lens, attention=Attention(sinks=True))
    q, sinks = torch.zeros(2, 4, D, dtype=torch.bfloat16), torch.zeros(4)
    assert backend.decode(plan, q, fp8, 0.5, sinks=sinks).dtype == torch.bfloat16
    for kwargs, message in [
        ({"k_scale": 0.0}, "k_scale must be a finite float > 0"),
        ({"v_scale": float("nan")}, "v_scale must be a finite float > 0"),
        ({"sinks": None}, r"needs sinks \[Hq\] float32"),
        ({"sinks": torch.zeros(3)}, r"sinks must have shape \[4\]"),
        ({"sinks": torch.zeros(4, dtype=torch.float16)}, "sinks must be torch.float32"),
    ]:
        with pytest.raises(BadRequest, match=message):
            backend.decode(plan, q, fp8, 0.5, **{"sinks": sinks, **kwargs})
    with pytest.raises(BadRequest, match="on an fp8 cache it must be float16, bfloat16"):
        backend.decode(plan, q.double(), fp8, 0.5, sinks=sinks)
    plain = backend.plan_decode(cache(), table, lens)
    with pytest.raises(BadRequest, match="sinks given to a plan made without"):
        backend.decode(plain, torch.zeros(2, 4, D), cache(), 0.5, sinks=sinks)
    latent = LATENT.clone()
    write = backend.plan_write(latent, t64(0, 1))
    with pytest.raises(BadRequest, match="pass value=None"):
        backend.write_kv(write, latent, torch.zeros(2, 1, 20), torch.zeros(2, 1, 20))
    with pytest.raises(BadRequest, match=r"key must have shape \[2, 1, 20\]"):
        backend.write_kv(write, latent, torch.zeros(2, 2, 20), None)


def test_a_window_validates_only_the_pages_it_reads() -> None:
    """Pages before every query's window may hold anything; the pages read are checked."""
    backend, kv = TorchBackend(), cache()
    lens = t32(8, 8)  # 2 pages each; the windows of 3 tokens start at token 4: page 1
    released = t32(-1, 1, 2**31 - 1, 3).reshape(2, 2)
    window = Attention(window_left=3)
    backend.plan_decode(kv, released, lens, attention=window)
    with pytest.raises(BadRequest, match=r"block_table\[0, 0\] = -1"):
        backend.plan_decode(kv, released, lens)  # without a window every page is read
    # prefill: the first query of each sequence (q_len 2: position 6) starts its window
    # at token 3, on page 0, which must then be valid
    with pytest.raises(BadRequest, match=r"block_table\[0, 0\] = -1"):
        backend.plan_prefill(kv, released, t32(0, 2, 4), lens, attention=window)
    backend.plan_prefill(kv, released, t32(0, 1, 2), lens, attention=window)
    with pytest.raises(BadRequest, match=r"block_table\[1, 1\] = 9"):
        backend.plan_decode(kv, t32(-1, 1, -1, 9).reshape(2, 2), lens, attention=window)


def test_feature_runs_read_no_tensor_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain check below, on an fp8 cache with a window, soft cap and sinks, and on a
    latent one: a run still brings no value to the host."""
    backend = TorchBackend()
    fp8 = torch.randn(NUM_PAGES, 2, PAGE, HKV, D).to(torch.float8_e4m3fn)
    latent = torch.randn(NUM_PAGES, 1, PAGE, 1, 20)
    table, lens, slots = t32(-1, 1, 2, 3).reshape(2, 2), t32(8, 8), t64(5, 8)
    options = Attention(window_left=2, logits_soft_cap=5.0, sinks=True)
    plan = backend.plan_decode(fp8, table, lens, slots=slots, attention=options)
    prefill = backend.plan_prefill(fp8, table, t32(0, 2, 4), lens, attention=options)
    mla = backend.plan_decode(
        latent, table, lens, slots=slots, attention=Attention(window_left=2, v_head_dim=16)
    )
    assert plan.write is not None and mla.write is not None
    sinks, q = torch.zeros(4), torch.zeros(4, 4, D, dtype=torch.float16)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a run read a tensor value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    k = torch.ones(2, HKV, D)
    backend.write_kv(plan.write, fp8, k, k, k_scale=0.5, v_scale=2.0)
    backend.decode(plan, q[:2], fp8, 0.5, k_scale=0.5, v_scale=2.0, sinks=sinks)
    backend.prefill(prefill, q, fp8, 0.5, k_scale=0.5, v_scale=2.0, sinks=sinks)
    backend.write_kv(mla.write, latent, torch.ones(2, 1, 20), None)
    assert backend.decode(mla, torch.zeros(2, 3, 20), latent, 0.5).shape == (2, 3, 16)


# -- the host path: CPU tensors checked on their own memory, same errors ------------------


def _value_checks(host: bool, case: dict[str, Any]) -> object:
    """check_table (+ check_cu_seqlens) and check_slots of one step on ``host`` or the
    tensor path: the error message, or the host values the plan would keep."""
    checks, kv, cu = ValueChecks(host=host), cache(), case.get("cu")
    try:
        batch = None if cu is None else cu.shape[0] - 1
        _, lens = check_table(
            checks, case["table"], case["lens"], kv, batch, case.get("window", -1), cu
        )
        if cu is not None:
            check_cu_seqlens(checks, cu, lens)
        at_lens = checks.fetch(lens)
        _, at_skips = check_slots(checks, case["slots"], kv)
        values = checks.run()
    except BadRequest as exc:
        return str(exc)
    return values[at_lens], values[at_skips]


HOST_CASES: list[tuple[str, dict[str, Any]]] = [
    ("valid", {"table": t32(0, 1, 2, 3).reshape(2, 2), "lens": t32(5, 8), "slots": t64(4, 7)}),
    ("padding", {"table": t32(0, -7, 2, 3).reshape(2, 2), "lens": t32(4, 8), "slots": t64(3)}),
    ("lens zero", {"table": t32(0, 1, 2, 3).reshape(2, 2), "lens": t32(0, 8), "slots": t64()}),
    ("lens long", {"table": t32(0, 1, 2, 3).reshape(2, 2), "lens": t32(5, 9), "slots": t64()}),
    ("page -1", {"table": t32(0, -1, 2, 3).reshape(2, 2), "lens": t32(5, 8), "slots": t64()}),
    ("page past", {"table": t32(0, 1, 4, 3).reshape(2, 2), "lens": t32(5, 8), "slots": t64()}),
    ("no columns", {"table": torch.zeros(1, 0, dtype=I32), "lens": t32(1), "slots": t64()}),
    ("empty", {"table": torch.zeros(0, 2, dtype=I32), "lens": t32(), "slots": t64()}),
    ("slot past", {"table": t32(0, 1).reshape(1, 2), "lens": t32(5), "slots": t64(0, 16)}),
    ("slot repeat", {"table": t32(0, 1).reshape(1, 2), "lens": t32(5), "slots": t64(3, -1, 3)}),
    ("skips", {"table": t32(0, 1).reshape(1, 2), "lens": t32(5), "slots": t64(-1, -1, 3)}),
    (
        "window",
        {"table": t32(-1, 1, -1, 9).reshape(2, 2), "lens": t32(8, 8), "slots": t64(), "window": 3},
    ),
    (
        "prefill window",
        {
            "table": t32(-1, 1, 2, 3).reshape(2, 2),
            "lens": t32(8, 8),
            "cu": t32(0, 2, 4),
            "slots": t64(),
            "window": 3,
        },
    ),
    (
        "cu decreasing",
        {"table": t32(0, 1, 2, 3).reshape(2, 2), "lens": t32(5, 8), "cu": t32(0, 6, 5)},
    ),
    ("shape first", {"table": t32(0, -1, 2, 3).reshape(2, 2), "lens": t32(5, 8), "slots": t32(1)}),
]


@pytest.mark.parametrize("list_max", [backend_checks.HOST_LIST_MAX, 0], ids=["lists", "numpy"])
@pytest.mark.parametrize("case", [c[1] for c in HOST_CASES], ids=[c[0] for c in HOST_CASES])
def test_host_path_raises_what_the_tensor_path_raises(
    case: dict[str, Any], list_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU tensors are checked on their own memory (lists, or numpy for large tensors;
    Python bools): every check gives the tensor path's result, the first violation in
    the same order, and a shape error of a later argument still comes before any value
    error."""
    monkeypatch.setattr(backend_checks, "HOST_LIST_MAX", list_max)
    case = {"slots": t64(), **case}
    assert _value_checks(True, case) == _value_checks(False, case)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_host_and_tensor_paths_agree_on_random_steps(data: st.DataObject) -> None:
    batch, columns = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    entry = st.one_of(st.integers(-2, NUM_PAGES + 1), st.sampled_from([-(2**31), 2**31 - 1]))
    table = torch.tensor(
        data.draw(st.lists(entry, min_size=batch * columns, max_size=batch * columns)), dtype=I32
    )
    lens = data.draw(st.lists(st.integers(-1, columns * PAGE + 1), min_size=batch, max_size=batch))
    slots = data.draw(st.lists(st.integers(-2, NUM_PAGES * PAGE), max_size=5))
    case: dict[str, Any] = {
        "table": table.reshape(batch, columns),
        "lens": torch.tensor(lens, dtype=I32),
        "slots": torch.tensor(slots, dtype=I64),
        "window": data.draw(st.integers(-1, 6)),
    }
    if data.draw(st.booleans()):
        q_lens = data.draw(st.lists(st.integers(-1, 3), min_size=batch, max_size=batch))
        case["cu"] = torch.tensor(
            [0, *torch.tensor(q_lens, dtype=I64).cumsum(0).tolist()], dtype=I32
        )
    expected = _value_checks(False, case)
    assert _value_checks(True, case) == expected
    with mock.patch.object(backend_checks, "HOST_LIST_MAX", 0):  # large tensors: numpy
        assert _value_checks(True, case) == expected


def test_host_path_queues_no_tensor() -> None:
    """On CPU tensors the table and slot checks queue Python bools and lists: planning a
    valid step runs a few numpy reductions, no torch reduction per check."""
    checks = ValueChecks(host=True)
    _, lens = check_table(checks, t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8), cache(), None)
    checks.fetch(lens)
    check_slots(checks, t64(4, -1, 7), cache())
    assert all(isinstance(flag, bool) for flag in checks.flags)
    assert checks.fetches == [[5, 8], [1]]
    assert checks.run() == [[5, 8], [1]]


def test_large_steps_take_numpy_and_write_where_small_ones_do() -> None:
    """A step past HOST_LIST_MAX slots (numpy checks, the torch write index) writes the
    same K/V as the same slots planned a thousand at a time (the host write index)."""
    num_pages, page = 1200, 4
    tokens = backend_checks.HOST_LIST_MAX + 8
    slots = torch.randperm(num_pages * page, generator=torch.Generator().manual_seed(3))[:tokens]
    key = torch.randn(tokens, HKV, D)
    backend, one = TorchBackend(), torch.zeros(num_pages, 2, page, HKV, D)
    backend.write_kv(backend.plan_write(one, slots), one, key, -key)
    many = torch.zeros_like(one)
    for part in range(0, tokens, 1000):
        window = slice(part, part + 1000)
        backend.write_kv(backend.plan_write(many, slots[window]), many, key[window], -key[window])
    assert one.equal(many) and one.abs().sum() > 0
    with pytest.raises(BadRequest, match="must not repeat"):
        backend.plan_write(one, torch.cat([slots, slots[:1]]))


def test_a_backend_remembers_only_valid_geometries() -> None:
    """The planning cache's checks are remembered per accepted geometry; a cache of the
    same shape, dtype and device with a strided last dim is still refused."""
    backend, table, lens = TorchBackend(), t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8)
    plan = backend.plan_decode(cache(), table, lens)
    assert backend.plan_decode(cache(), table, lens).cache is plan.cache
    strided = torch.zeros(NUM_PAGES, 2, PAGE, HKV, 2 * D)[..., ::2]
    with pytest.raises(BadRequest, match="contiguous last dim"):
        backend.plan_decode(strided, table, lens)
    with pytest.raises(Unsupported, match="device=meta"):
        backend.plan_decode(cache().to("meta"), table.to("meta"), lens.to("meta"))


class LayerMajorOnly(TorchBackend):
    """The reference's kernels, declaring one pool order: a backend that reads
    kvcore's default order only."""

    name = "layer-major-only"
    capabilities = dataclasses.replace(TorchBackend.capabilities, orders=frozenset({"LPKTH"}))


def _layer(order: str) -> torch.Tensor:
    layout = KVLayout(3, HKV, D, PAGE, "float32", NUM_PAGES, "kv", order)
    return layout.layer_views(torch.zeros(layout.total_bytes // 4))[1]


@pytest.mark.parametrize("order", ["PLKTH", "LPHKT", "PLHKT"])
def test_an_undeclared_order_is_unsupported_in_plan_and_run(order: str) -> None:
    backend, table, lens = LayerMajorOnly(), t32(0, 1, 2, 3).reshape(2, 2), t32(5, 8)
    good, bad = _layer("LPKTH"), _layer(order)
    plan = backend.plan_decode(good, table, lens)  # the declared order plans and runs
    backend.decode(plan, torch.zeros(2, HKV, D), good, 1.0)
    with pytest.raises(Unsupported, match=f"pool order '{order}'"):
        backend.plan_decode(bad, table, lens)
    with pytest.raises(Unsupported, match=f"pool order '{order}'"):
        backend.decode(plan, torch.zeros(2, HKV, D), bad, 1.0)
    padded = torch.zeros(NUM_PAGES, 2, PAGE, HKV + 1, D + 3)[:, :, :, 1:, :D]
    with pytest.raises(Unsupported, match="no pool order"):
        backend.plan_write(padded, t64(0))


def test_conformance_of_a_backend_declaring_one_order() -> None:
    from kvcore.testing.kernels import Suite

    suite = Suite(LayerMajorOnly(), "cpu")
    suite.profile = dataclasses.replace(suite.profile, examples=3)
    for name in ("decode_matches_oracle", "unsupported_raises"):
        suite.run(name)
