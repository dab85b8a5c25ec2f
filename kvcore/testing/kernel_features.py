"""The conformance family of the contract's features: fp8, window, soft_cap, sinks, mla.

One property per feature (:data:`FEATURE_PROPERTIES`, run by
:class:`kvcore.testing.kernels.Suite`). For a backend that declares the feature
(``Capabilities.features``) it draws cases that switch the feature on (and, at
random, the other declared attention options with it) and checks:

* decode and prefill of the backend equal the torch oracle's (tolerance:
  :func:`feature_tolerance`);
* the oracle equals attention computed densely in float64 over the dequantized
  cache, by the formulas of :class:`kvcore.backend.Attention` (the same bound, for
  one fp32 computation against an exact one: near-exact);
* for fp8 and mla, write_kv stores exactly what the contract says: ``x / scale``
  clamped to the format's largest finite value, rounded to nearest even
  (fp8); a latent row in part 0 (mla); skipped slots stay untouched.

For a backend that does not declare it, every plan that needs it raises
Unsupported naming it. What each family draws:

* fp8: e4m3fn or e5m2 caches, K/V N(0, 1) stored with hypothesis-drawn
  ``k_scale``/``v_scale`` in [2**-8, 4] plus edges down to 1e-5 (saturating
  both formats), queries in every declared float dtype; writes include rows
  at 6e4 (saturated unless e5m2 with a scale > 1);
* window: ``window_left`` in {0, 1, page_size - 1, page_size, page_size + 1} or
  any length up to the longest sequence (so windows start mid-page); the
  block-table entries of pages before every query's window hold -1, an index
  past the pool, 2**31 - 1 or a NaN page;
* soft_cap: caps 0.5, 2, 10, 50 (the scale factor makes logits up to ~10);
* sinks: per-head logits N(0, 1) times 0, 1, 5 or 20 (a sink that dominates);
* mla: latent caches [num_pages, 1, page_size, 1, D], D = v_head_dim + rope
  dims from the profile (non-powers of two), 1 to 16 query heads, float or
  (with "fp8" declared) fp8.

Every case keeps the base family's draws (:mod:`kvcore.testing.kernel_cases`):
GQA ratios, distinct/shared/repeated pages, strided layouts and layers of pools
in drawn orders (latent pools too: a latent page in a page-major pool is one run
of every layer's vectors), NaN in every slot no sequence reads.

The file runs past ~400 lines on purpose: it is one family, the features,
with its cases, its tensors, its dense float64 reference and its property
together, so the draws stated above sit next to the code that makes them; the
base family (cases) and its properties live in kernel_cases and kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from hypothesis import strategies as st

from kvcore.backend import FP8_MAX, Attention, Backend
from kvcore.errors import Unsupported
from kvcore.layout import KVLayout
from kvcore.testing import kernel_cases as kc
from kvcore.testing.kernel_cases import Case
from kvcore.testing.tolerance import Tolerance, assert_close, attention

if TYPE_CHECKING:
    from kvcore.testing.kernels import Suite

FEATURE_PROPERTIES: dict[str, str] = {
    "feature_fp8": "fp8",
    "feature_window": "window",
    "feature_soft_cap": "soft_cap",
    "feature_sinks": "sinks",
    "feature_mla": "mla",
}
FP8_DTYPES = tuple(FP8_MAX)
FP8_TORCH = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_NAN = kc.FP8_NAN  # a NaN byte in both float8 formats
SCALE_EDGES = (1.0, 2.0**-8, 1e-3, 1e-5)
POISONS = ("minus_one", "past_end", "int_max", "nan_page")


def feature_tolerance(
    backend: str, device: str, fc: FeatureCase, t: FeatureBuilt, query: torch.Tensor, *, exact: bool
) -> Tolerance:
    """:func:`kvcore.testing.tolerance.attention` for ``query`` over the case's
    dequantized K/V: the backend (its dot operands as kernel_cases.operands says) against
    the oracle, or (``exact``) the oracle against float64. A soft cap's tanh has slope
    <= 1 and sinks add one term to the softmax's sums: the bound covers both. fp8 values
    convert exactly to every float format and the contract's kernels apply ``k_scale``
    and ``v_scale`` in fp32 (folded into the score scale and the output's
    normalisation): two more fp32 roundings, within the bound's EXP_ULPS."""
    key, value = torch.cat(t.keys), torch.cat(t.values)
    keys = max(fc.base.seq_lens)
    if exact:
        return attention(query, key, value, fc.base.scale, keys=keys, implementations=1)
    ops = kc.operands(backend, device, fc.base.dtype)
    return attention(query, key, value, fc.base.scale, keys=keys, operands=ops)


@dataclass(frozen=True, slots=True)
class FeatureCase:
    """A base case (``base.dtype`` is the query dtype) with the feature's settings."""

    feature: str
    base: Case
    cache_dtype: str
    attention: Attention
    k_scale: float = 1.0
    v_scale: float = 1.0
    sink_amp: float | None = None  # sinks N(0, 1) * amp per query head; None: no sinks
    poison: str = "minus_one"  # what table entries before every window hold

    @property
    def fp8(self) -> bool:
        return self.cache_dtype in FP8_MAX

    @property
    def latent(self) -> bool:
        return self.attention.v_head_dim is not None


@st.composite
def scale_st(draw: st.DrawFn) -> float:
    return draw(st.one_of(st.sampled_from(SCALE_EDGES), st.floats(2.0**-8, 4.0)))


@st.composite
def feature_case_st(draw: st.DrawFn, suite: Suite, feature: str) -> FeatureCase:
    """A case with ``feature`` on and each other declared attention option on at random."""
    caps, prof = suite.backend.capabilities, suite.profile
    declared = caps.features

    def on(name: str) -> bool:
        return name == feature or (name in declared and draw(st.booleans()))

    base = draw(kc.case_st(prof, caps))
    cache_dtype, v_head_dim = base.dtype, None
    if feature == "mla":
        dims = [(v, r) for v, r in prof.mla_dims if caps.supports_head_dim(v + r, latent=True)]
        if not dims:
            raise Unsupported(f"{suite.backend.name!r} declares mla but no latent dim of {prof}")
        v_head_dim, rope = draw(st.sampled_from(dims))
        heads = draw(st.sampled_from((1, 2, 3, 4, 8, 16)))
        base = Case(**{**_fields(base), "head_dim": v_head_dim + rope, "num_kv_heads": 1})
        base = Case(**{**_fields(base), "group": heads, "layout": _latent_layout(base.layout)})
    fp8 = [d for d in FP8_DTYPES if d in caps.dtypes]
    if feature == "fp8" or (feature == "mla" and "fp8" in declared and fp8 and draw(st.booleans())):
        if not fp8:
            raise Unsupported(f"{suite.backend.name!r} declares fp8 but no float8 dtype")
        cache_dtype = draw(st.sampled_from(fp8))
    longest = max(base.seq_lens)
    ps = base.page_size
    window = -1
    if on("window"):
        edges = st.sampled_from(sorted({0, 1, max(0, ps - 1), ps, ps + 1}))
        window = draw(st.one_of(edges, st.integers(0, longest)))
    cap = draw(st.sampled_from((0.5, 2.0, 10.0, 50.0))) if on("soft_cap") else 0.0
    sinks = on("sinks")
    return FeatureCase(
        feature=feature,
        base=base,
        cache_dtype=cache_dtype,
        attention=Attention(window, cap, sinks, v_head_dim),
        k_scale=draw(scale_st()) if cache_dtype in FP8_MAX else 1.0,
        v_scale=draw(scale_st()) if cache_dtype in FP8_MAX else 1.0,
        sink_amp=draw(st.sampled_from((0.0, 1.0, 5.0, 20.0))) if sinks else None,
        poison=draw(st.sampled_from(POISONS)),
    )


def _latent_layout(layout: str) -> str:
    return layout if layout in ("padded", "pool") else "contiguous"  # kv_split: no meaning


# -- tensors ----------------------------------------------------------------------


def empty_cache(fc: FeatureCase, num_pages: int, device: torch.device) -> torch.Tensor:
    """A NaN cache of the case's dtype, kind and layout (fp8 NaN: the byte 0x7F)."""
    case = fc.base
    parts, ps, h, d = (1 if fc.latent else 2), case.page_size, case.num_kv_heads, case.head_dim
    dtype = getattr(torch, fc.cache_dtype)

    def nan(*shape: int) -> torch.Tensor:
        if fc.fp8:
            return torch.full(shape, FP8_NAN, dtype=torch.uint8, device=device).view(dtype)
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    if case.layout == "pool":
        kind = "latent" if fc.latent else "kv"
        layout = KVLayout(kc.POOL_LAYERS, h, d, ps, fc.cache_dtype, num_pages, kind, case.order)
        return kc.pool_layer(layout, device)
    if case.layout == "kv_split":
        return nan(parts, num_pages, ps, h, d).transpose(0, 1)
    if case.layout == "padded":
        return nan(num_pages, parts, ps, h + 1, d + 3)[:, :, :, 1:, :d]
    return nan(num_pages, parts, ps, h, d)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The contract's fp8 store: ``x / scale`` in fp32, clamped to +-max finite, rounded
    to nearest even by ``.to(dtype)``; a backend must store exactly these bytes."""
    limit = FP8_MAX[str(dtype).removeprefix("torch.")]
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes (indexing float8 is not implemented everywhere)."""
    return t.view(torch.uint8) if t.dtype in FP8_TORCH else t


def stored(fc: FeatureCase, x: torch.Tensor, part: int) -> torch.Tensor:
    """Float rows as the cache holds them (quantized with the part's scale on fp8)."""
    dtype = getattr(torch, fc.cache_dtype)
    if fc.fp8:
        return quantize(x, dtype, fc.k_scale if part == 0 else fc.v_scale)
    return x.to(dtype)


@dataclass(slots=True)
class FeatureBuilt:
    """The tensors of one feature case on the device, and the dequantized K/V of each
    sequence (float64, CPU) for the dense reference."""

    kv_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32, entries before windows poisoned
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    decode_query: torch.Tensor
    prefill_query: torch.Tensor
    sinks: torch.Tensor | None  # [Hq] float32
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D] float64
    values: list[torch.Tensor]  # per sequence [seq_len, Hkv, Dv] float64


def build(fc: FeatureCase, device: torch.device) -> FeatureBuilt:
    """Fill exactly the slots the sequences hold (NaN elsewhere), read each sequence's
    K/V back through the table and dequantize it, then poison the table entries of
    pages before every query's window (the prefill's first query: decode's is later)."""
    case, gen = fc.base, torch.Generator().manual_seed(fc.base.seed)
    table, num_pages = kc.block_table(case, gen)
    cache = empty_cache(fc, num_pages + 1, device)  # page num_pages stays NaN
    slots = kc.used_slots(case, table)
    parts, ps = cache.shape[1], case.page_size
    rows = torch.randn(slots.numel(), parts, case.num_kv_heads, case.head_dim, generator=gen)
    page, off = (slots // ps).to(device), (slots % ps).to(device)
    for part in range(parts):
        _raw(cache)[page, part, off] = _raw(stored(fc, rows[:, part], part).to(device))
    host = cache.cpu()
    scales = (fc.k_scale, fc.v_scale)
    keys, values = [], []
    for b, n in enumerate(case.seq_lens):
        t = torch.arange(n)
        kv = _raw(host)[table[b, t // ps].long(), :, t % ps].view(host.dtype).double()
        kv = kv * torch.tensor(scales[:parts], dtype=torch.float64).view(1, parts, 1, 1)
        keys.append(kv[:, 0])
        dv = fc.attention.v_head_dim
        values.append(kv[:, 0, :, :dv] if dv is not None else kv[:, 1])
    window = fc.attention.window_left
    if window >= 0:
        poison = {"minus_one": -1, "past_end": num_pages + 7, "int_max": 2**31 - 1}
        value = poison.get(fc.poison, num_pages)
        for b, (n, q) in enumerate(zip(case.seq_lens, case.q_lens, strict=True)):
            table[b, : max(0, n - q - window) // ps] = value
    dtype = getattr(torch, case.dtype)
    hq, d = case.num_q_heads, case.head_dim
    cu = [0]
    for q in case.q_lens:
        cu.append(cu[-1] + q)
    sinks = None
    if fc.sink_amp is not None:
        sinks = (torch.randn(hq, generator=gen) * fc.sink_amp).to(device)
    return FeatureBuilt(
        kv_cache=cache,
        block_table=table.to(device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        decode_query=torch.randn(len(case.seq_lens), hq, d, generator=gen).to(device, dtype),
        prefill_query=torch.randn(cu[-1], hq, d, generator=gen).to(device, dtype),
        sinks=sinks,
        keys=keys,
        values=values,
    )


def dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    attention: Attention,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The contract's attention of one sequence, densely in float64, written from its
    formulas: query [Lq, Hq, D] at positions Lk - Lq .. Lk - 1 over key [Lk, Hkv, D],
    value [Lk, Hkv, Dv]; returns [Lq, Hq, Dv] float64 (CPU)."""
    lq, hq, _ = query.shape
    lk, hkv, _ = key.shape
    k = key.double().repeat_interleave(hq // hkv, dim=1)
    v = value.double().repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query.double().cpu(), k) * scale
    cap = attention.logits_soft_cap
    if cap > 0:
        logits = cap * torch.tanh(logits / cap)
    p = torch.arange(lk - lq, lk)[:, None]
    j = torch.arange(lk)[None, :]
    keep = j <= p
    if attention.window_left >= 0:
        keep &= j >= p - attention.window_left
    logits = logits.masked_fill(~keep[None], -math.inf)
    m = logits.amax(dim=-1, keepdim=True)  # [Hq, Lq, 1]
    sink = None if sinks is None else sinks.double().cpu().view(hq, 1, 1)
    if sink is not None:
        m = torch.maximum(m, sink)
    weights = torch.exp(logits - m)
    denominator = weights.sum(dim=-1, keepdim=True)
    if sink is not None:
        denominator = denominator + torch.exp(sink - m)
    return torch.einsum("hqk,khd->qhd", weights / denominator, v)


# -- the property -------------------------------------------------------------------


def run_feature(suite: Suite, feature: str) -> str:
    """The property of ``feature`` on the suite's backend: "declared" (checked against
    the oracle and the dense reference) or "not declared" (refused in every plan)."""
    if feature not in suite.backend.capabilities.features:
        check_refused(suite, feature)
        return "not declared: Unsupported in the plan"

    def check(fc: FeatureCase) -> None:
        t = build(fc, suite.device)
        query_dtype = getattr(torch, fc.base.dtype)
        expected = _dense_outputs(fc, t, query_dtype)
        name_, dev = suite.backend.name, suite.device.type
        for name, run, query in (
            ("decode", _decode, t.decode_query),
            ("prefill", _prefill, t.prefill_query),
        ):
            oracle = run(suite.oracle, fc, t)
            exact = feature_tolerance(name_, dev, fc, t, query, exact=True)
            assert_close(oracle, expected[name], exact, f"the oracle's {name} vs dense for {fc}")
            if type(suite.backend) is not type(suite.oracle):
                got = run(suite.backend, fc, t)
                bound = feature_tolerance(name_, dev, fc, t, query, exact=False)
                assert_close(got, oracle, bound, f"{name_}: {name} vs the oracle for {fc}")
        if fc.fp8 or fc.latent:
            _check_write(suite.backend, fc, suite.device)

    suite.given(feature_case_st(suite, feature), check)
    return "declared: vs the oracle and dense attention"


def _decode(backend: Backend, fc: FeatureCase, t: FeatureBuilt) -> torch.Tensor:
    plan = backend.plan_decode(t.kv_cache, t.block_table, t.seq_lens, attention=fc.attention)
    return backend.decode(
        plan,
        t.decode_query,
        t.kv_cache,
        fc.base.scale,
        k_scale=fc.k_scale,
        v_scale=fc.v_scale,
        sinks=t.sinks,
    )


def _prefill(backend: Backend, fc: FeatureCase, t: FeatureBuilt) -> torch.Tensor:
    plan = backend.plan_prefill(
        t.kv_cache, t.block_table, t.cu_seqlens_q, t.seq_lens, attention=fc.attention
    )
    return backend.prefill(
        plan,
        t.prefill_query,
        t.kv_cache,
        fc.base.scale,
        k_scale=fc.k_scale,
        v_scale=fc.v_scale,
        sinks=t.sinks,
    )


def _dense_outputs(fc: FeatureCase, t: FeatureBuilt, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense decode and prefill outputs, rounded once to the query dtype (CPU)."""
    scale, opts, sinks = fc.base.scale, fc.attention, t.sinks
    decode, prefill = [], []
    starts = t.cu_seqlens_q.tolist()
    for b, (k, v) in enumerate(zip(t.keys, t.values, strict=True)):
        decode.append(dense(t.decode_query[b : b + 1], k, v, scale, opts, sinks))
        prefill.append(dense(t.prefill_query[starts[b] : starts[b + 1]], k, v, scale, opts, sinks))
    return {"decode": torch.cat(decode).to(dtype), "prefill": torch.cat(prefill).to(dtype)}


def _check_write(backend: Backend, fc: FeatureCase, device: torch.device) -> None:
    """write_kv rows (some at 1e6: saturated on fp8) into a NaN cache at shuffled slots
    with skipped (-1) rows between them: the stored bytes are the contract's, and
    nothing else is written."""
    case, gen = fc.base, torch.Generator().manual_seed(fc.base.seed + 1)
    num_pages = 2 + sum(case.pages_of(n) for n in case.seq_lens) // 2
    cache = empty_cache(fc, num_pages, device)
    parts, h, d = cache.shape[1], case.num_kv_heads, case.head_dim
    total = num_pages * case.page_size
    n = max(1, total // 2)
    slots = torch.randperm(total, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.25] = -1
    rows = torch.randn(n, parts, h, d, generator=gen)
    if fc.fp8:  # saturated unless e5m2 with a scale > 1 (6e4 is finite in fp16)
        rows[torch.rand(n, generator=gen) < 0.2] *= 6e4
    rows = rows.to(getattr(torch, case.dtype))
    plan = backend.plan_write(cache, slots.to(device))
    key, value = rows[:, 0].to(device), None if fc.latent else rows[:, 1].to(device)
    backend.write_kv(plan, cache, key, value, k_scale=fc.k_scale, v_scale=fc.v_scale)
    kept = slots >= 0
    page, off = slots[kept] // case.page_size, slots[kept] % case.page_size
    expected = torch.stack([stored(fc, rows[kept, p], p) for p in range(parts)], dim=1)
    got = _raw(cache.cpu())[page, :, off]
    assert torch.equal(got, _raw(expected)), (
        f"{backend.name}: write_kv stored other values than the contract's for {fc}"
    )
    written = int(kept.sum()) * parts * h * d
    storage = kc.whole_storage(cache)  # padding and a pool's other layers included
    assert _nan_count(storage) == storage.numel() - written, (
        f"{backend.name}: write_kv wrote outside its slots (or stored NaN): {fc}"
    )


def _nan_count(cache: torch.Tensor) -> int:
    if cache.dtype in FP8_TORCH:
        return int((cache.view(torch.uint8) == FP8_NAN).sum())
    return int(cache.isnan().sum())


def check_refused(suite: Suite, feature: str) -> None:
    """Every plan needing ``feature`` raises Unsupported naming it, before any value is
    read (the cache's dtype, head dim and page size are otherwise declared)."""
    caps, dev = suite.backend.capabilities, suite.device
    dtype = getattr(torch, kc.dtypes(caps)[0])
    d, ps = kc.head_dims(suite.profile, caps)[0], kc.page_sizes(suite.profile, caps)[0]
    cache = torch.zeros(2, 2, ps, 1, d, dtype=dtype, device=dev)
    options = {
        "window": Attention(window_left=2),
        "soft_cap": Attention(logits_soft_cap=30.0),
        "sinks": Attention(sinks=True),
    }
    attention = options.get(feature, Attention())
    if feature == "fp8":
        cache = cache.to(torch.float8_e4m3fn)
    elif feature == "mla":
        cache = torch.zeros(2, 1, ps, 1, d, dtype=dtype, device=dev)
        attention = Attention(v_head_dim=max(1, d // 2))
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    slot = torch.zeros(1, dtype=torch.int64, device=dev)
    backend = suite.backend
    calls: list[tuple[str, Callable[[], object]]] = [
        ("plan_decode", lambda: backend.plan_decode(cache, table, lens, attention=attention)),
        ("plan_prefill", lambda: backend.plan_prefill(cache, table, cu, lens, attention=attention)),
    ]
    if feature in ("fp8", "mla"):  # the cache itself needs the feature
        calls.append(("plan_write", lambda: backend.plan_write(cache, slot)))
        calls.append(("plan_copy", lambda: backend.plan_copy(cache, slot, slot + 1)))
    for name, call in calls:
        try:
            call()
        except Unsupported as exc:
            assert feature in str(exc), f"{backend.name}.{name}: {exc} does not name {feature!r}"
            continue
        raise AssertionError(
            f"{backend.name}.{name} accepted {feature!r}, which it does not declare"
        )


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in type(obj).__dataclass_fields__}
