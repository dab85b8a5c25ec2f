"""The torch reference backend: the conformance suite on it, dense-attention sanity
checks that do not lean on the backend's own helpers, the registry, and the two
ways a third party runs the suite (``kvcore conformance`` and the pytest plugin)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from kvcore_torch import TorchBackend

from kvcore import backend as registry
from kvcore.backend import FEATURES, Attention
from kvcore.cli import main as kvcore_main
from kvcore.errors import Unsupported
from kvcore.testing import tolerance
from kvcore.testing.kernel_features import FEATURE_PROPERTIES
from kvcore.testing.kernels import PROPERTIES, Suite, dense_attention
from kvcore.testing.pytest_plugin import KernelConformance

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
I32, I64 = torch.int32, torch.int64


def assert_attention(
    got: torch.Tensor,
    want: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    keys: int,
) -> None:
    """``got`` (the backend) within tolerance.attention's bound of ``want`` (a formula
    written out in fp32): two fp32 computations of ``query`` over the same ``key`` /
    ``value``, ``keys`` per query, in other orders."""
    bound = tolerance.attention(query, key, value, scale, keys=keys)
    tolerance.assert_close(got, want, bound, "the torch backend vs its formula")


class TestTorchConformance(KernelConformance):
    backend = "torch"
    device = "cpu"


@pytest.mark.gpu
class TestTorchConformanceCuda(KernelConformance):
    backend = "torch"
    device = "cuda"  # the fixture skips without CUDA


def test_plugin_class_runs_every_property() -> None:
    tests = {n.removeprefix("test_") for n in dir(KernelConformance) if n.startswith("test_")}
    assert tests == set(PROPERTIES)


# -- sanity checks by hand ---------------------------------------------------------


def _decode(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    backend = TorchBackend()
    return backend.decode(backend.plan_decode(cache, table, lens), q, cache, scale)


def _one_page_cache(k: torch.Tensor, v: torch.Tensor, page_size: int) -> torch.Tensor:
    """Tokens [n, H, D] of K and V in page 1 of a 2-page NaN cache (page 0 is all NaN)."""
    n, h, d = k.shape
    cache = torch.full((2, 2, page_size, h, d), float("nan"))
    cache[1, 0, :n], cache[1, 1, :n] = k, v
    return cache


def test_single_token_returns_its_value() -> None:
    k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    cache = _one_page_cache(k, v, page_size=4)
    q = torch.randn(3, 4, 8)  # 3 sequences on the same page, Hq = 4, Hkv = 2
    table = torch.tensor([[1], [1], [1]], dtype=I32)
    out = _decode(q, cache, table, torch.ones(3, dtype=I32), 0.5)
    # query heads 0, 1 read kv head 0; heads 2, 3 read kv head 1
    expected = v[0].repeat_interleave(2, dim=0).expand(3, 4, 8)
    assert_attention(out, expected, q, k, v, 0.5, keys=1)


def test_zero_scale_averages_values() -> None:
    k, v = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    cache = _one_page_cache(k, v, page_size=8)
    q = torch.randn(1, 2, 4)
    out = _decode(q, cache, torch.tensor([[1]], dtype=I32), torch.tensor([5], dtype=I32), 0)
    assert_attention(out[0], v.mean(0).expand(2, 4), q, k, v, 0, keys=5)


def test_one_plan_serves_layers_in_turn_and_other_threads() -> None:
    """The plan's gather workspace is scratch: an earlier layer's output stays as it
    was, and a run from another thread (which gathers into its own tensor) agrees."""
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(6, 2, 4, 2, 8, generator=gen) for _ in range(3)]
    table = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=I32)
    lens = torch.tensor([10, 7], dtype=I32)
    q = torch.randn(2, 4, 8, generator=gen)
    backend = TorchBackend()
    plan = backend.plan_decode(layers[0], table, lens)
    outs = [backend.decode(plan, q, kv, 0.3) for kv in layers]
    # the same operations on the same inputs: equal bit for bit, no rounding to bound
    for kv, out in zip(layers, outs, strict=True):  # each equals a fresh plan's run
        torch.testing.assert_close(out, _decode(q, kv, table, lens, 0.3), rtol=0, atol=0)
        torch.testing.assert_close(out, backend.decode(plan, q, kv, 0.3), rtol=0, atol=0)
    elsewhere: list[torch.Tensor] = []
    thread = threading.Thread(
        target=lambda: elsewhere.append(backend.decode(plan, q, layers[1], 0.3))
    )
    thread.start()
    thread.join()
    torch.testing.assert_close(elsewhere[0], outs[1], rtol=0, atol=0)


def test_prefill_is_causal_bottom_right() -> None:
    n, q_len = 6, 3
    k, v = torch.randn(n, 1, 4), torch.randn(n, 1, 4)
    cache = _one_page_cache(k, v, page_size=8)
    q = torch.randn(q_len, 1, 4)
    backend = TorchBackend()
    plan = backend.plan_prefill(
        cache,
        torch.tensor([[1]], dtype=I32),
        torch.tensor([0, q_len], dtype=I32),
        torch.tensor([n], dtype=I32),
    )
    out = backend.prefill(plan, q, cache, 0.7)
    for i in range(q_len):  # query i sits at token n - q_len + i
        m = n - q_len + i + 1
        w = torch.softmax((k[:m, 0] @ q[i, 0]) * 0.7, dim=0)
        assert_attention(out[i, 0], w @ v[:m, 0], q[i : i + 1], k[:m], v[:m], 0.7, keys=m)


def test_dense_attention_reference_matches_sdpa_is_causal() -> None:
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert_attention(dense_attention(q, k, v, 8**-0.5), ref, q, k, v, 8**-0.5, keys=5)


def test_write_kv_skips_negative_slots_and_copy_pages_copies() -> None:
    cache = torch.zeros(3, 2, 2, 1, 2)
    key, value = torch.ones(3, 1, 2), 2 * torch.ones(3, 1, 2)
    backend = TorchBackend()
    backend.write_kv(
        backend.plan_write(cache, torch.tensor([1, -1, 4], dtype=I64)), cache, key, value
    )
    assert cache[0, :, 1].tolist() == [[[1.0, 1.0]], [[2.0, 2.0]]]
    assert cache[2, :, 0].tolist() == [[[1.0, 1.0]], [[2.0, 2.0]]]
    assert int((cache != 0).sum()) == 8  # two slots x (K + V) x 2 elements
    copy = backend.plan_copy(cache, torch.tensor([0], dtype=I64), torch.tensor([1], dtype=I64))
    backend.copy_pages(copy, cache)
    assert torch.equal(cache[1], cache[0])


# -- features by hand: each against its formula, written out here -----------------------


def _features_decode(
    cache: torch.Tensor,
    q: torch.Tensor,
    n: int,
    attention: Attention,
    **run: Any,
) -> torch.Tensor:
    """Decode one sequence of ``n`` tokens held in page 1 of ``cache`` (page 0 is NaN)."""
    backend = TorchBackend()
    table, lens = torch.tensor([[1]], dtype=I32), torch.tensor([n], dtype=I32)
    plan = backend.plan_decode(cache, table, lens, attention=attention)
    return backend.decode(plan, q, cache, 0.5, **run)


def test_window_soft_cap_and_sinks_follow_their_formulas() -> None:
    n, w, cap = 7, 2, 1.5
    k, v = torch.randn(n, 1, 4), torch.randn(n, 1, 4)
    q = torch.randn(1, 2, 4)
    sinks = torch.tensor([0.3, -1.0])
    out = _features_decode(
        _one_page_cache(k, v, page_size=8),
        q,
        n,
        Attention(window_left=w, logits_soft_cap=cap, sinks=True),
        sinks=sinks,
    )
    for h in range(2):  # the query at position n - 1 reads keys n - 1 - w .. n - 1
        logits = cap * torch.tanh((k[n - 1 - w :, 0] @ q[0, h]) * 0.5 / cap)
        weights = torch.exp(logits)
        expected = weights @ v[n - 1 - w :, 0] / (weights.sum() + torch.exp(sinks[h]))
        assert_attention(out[0, h], expected, q, k, v, 0.5, keys=w + 1)


def test_a_dominant_sink_silences_the_head_and_a_tiny_one_changes_nothing() -> None:
    k, v = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    cache, q = _one_page_cache(k, v, page_size=8), torch.randn(1, 2, 4)
    out = _features_decode(cache, q, 5, Attention(sinks=True), sinks=torch.tensor([80.0, -80.0]))
    plain = _decode(q, cache, torch.tensor([[1]], dtype=I32), torch.tensor([5], dtype=I32), 0.5)
    # exactly, head 0 returns sum_j e^(s_j - 80) v_j / (1 + sum_j e^(s_j - 80)), at most
    # 5 e^(S - 80) max|v| (|s_j| <= S); head 1's sink moves its denominator by a relative
    # e^-80 / sum_j e^(s_j) <= e^(S - 80), its output by at most that times 2 max|v|:
    # the derived bound plus these
    bound = tolerance.attention(q, k, v, 0.5, keys=5)
    s_max = 0.5 * float(q.norm(dim=-1).max() * k.norm(dim=-1).max())
    exact = 5 * math.exp(s_max - 80) * float(v.abs().max())
    why = f"{bound.why}; + 5 e^(S - 80) max|v|"
    near = tolerance.Tolerance(bound.atol + exact, bound.rtol, why)
    tolerance.assert_close(out[0, 0], torch.zeros(4), near, "a silenced head")
    tolerance.assert_close(out[0, 1], plain[0, 1], near, "a head with a tiny sink")


def test_window_pages_before_it_are_neither_read_nor_validated() -> None:
    """A hybrid engine released the first pages: their entries hold -1 and garbage."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(4, 2, 2, 1, 4, generator=gen)
    cache[0] = float("nan")  # what a released page may hold
    table = torch.tensor([[-1, 2**31 - 1, 1, 3]], dtype=I32)  # tokens 4..7 on pages 1, 3
    lens = torch.tensor([8], dtype=I32)
    q = torch.randn(1, 2, 4, generator=gen)
    backend = TorchBackend()
    plan = backend.plan_decode(cache, table, lens, attention=Attention(window_left=3))
    out = backend.decode(plan, q, cache, 0.5)
    k = torch.cat([cache[1, 0], cache[3, 0]])[:, 0]  # tokens 4..7
    v = torch.cat([cache[1, 1], cache[3, 1]])[:, 0]
    for h in range(2):
        want = torch.softmax(k @ q[0, h] * 0.5, 0) @ v
        assert_attention(out[0, h], want, q, k, v, 0.5, keys=4)


def test_mla_attends_the_latent_and_reads_its_first_v_head_dim_elements() -> None:
    n, d, dv = 5, 20, 12  # D = kv_lora_rank + rope dims, not powers of two
    latent = torch.randn(n, 1, d)
    cache = torch.full((2, 1, 8, 1, d), float("nan"))
    backend = TorchBackend()
    attention = Attention(v_head_dim=dv)
    slots = torch.arange(8, 8 + n, dtype=I64)  # page 1
    backend.write_kv(backend.plan_write(cache, slots), cache, latent, None)
    q = torch.randn(1, 3, d)  # three query heads over the one latent head
    out = _features_decode(cache, q, n, attention)
    assert out.shape == (1, 3, dv)
    for h in range(3):
        weights = torch.softmax(latent[:, 0] @ q[0, h] * 0.5, dim=0)
        want = weights @ latent[:, 0, :dv]
        assert_attention(out[0, h], want, q, latent, latent[..., :dv], 0.5, keys=n)


@pytest.mark.parametrize(("dtype", "limit"), [("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)])
def test_fp8_writes_saturate_and_attention_dequantizes(dtype: str, limit: float) -> None:
    fp8 = getattr(torch, dtype)
    cache = torch.zeros(2, 2, 4, 1, 2, dtype=fp8)
    key = torch.tensor([[[1e9, -1e9]], [[0.5, 3.0]]])
    value = torch.tensor([[[2.0, -2.0]], [[1.0, 0.25]]])
    backend = TorchBackend()
    plan = backend.plan_write(cache, torch.tensor([4, 5], dtype=I64))
    backend.write_kv(plan, cache, key, value, k_scale=0.5, v_scale=2.0)
    stored_k = cache[1, 0, :2, 0].float()
    assert stored_k[0].tolist() == [limit, -limit]  # saturated, not inf
    assert stored_k[1].tolist() == [1.0, 6.0]  # x / k_scale
    assert cache[1, 1, :2, 0].float().tolist() == [[1.0, -1.0], [0.5, 0.125]]  # x / v_scale
    q = torch.tensor([[[0.0, 0.0]]], dtype=torch.bfloat16)  # equal weights: the mean of V
    out = _features_decode(cache, q, 2, Attention(), k_scale=0.5, v_scale=2.0)
    assert out.dtype == torch.bfloat16
    k, v = tolerance.cache_parts(cache, k_scale=0.5, v_scale=2.0)  # as dequantized
    assert_attention(out[0, 0], value.mean(0)[0], q, k, v, 0.5, keys=2)


class Ignores(TorchBackend):
    """The reference with one attention option dropped from its plans: a backend
    that declares a feature it does not compute."""

    name = "ignores"

    def __init__(self, option: str, off: object) -> None:
        self.option, self.off = option, off

    def _without(self, plan: Any) -> Any:
        return dataclasses.replace(
            plan, attention=dataclasses.replace(plan.attention, **{self.option: self.off})
        )

    def _decode(self, plan: Any, query: Any, kv_cache: Any, scale: float, **kw: Any) -> Any:
        return super()._decode(self._without(plan), query, kv_cache, scale, **kw)

    def _prefill(self, plan: Any, query: Any, kv_cache: Any, scale: float, **kw: Any) -> Any:
        return super()._prefill(self._without(plan), query, kv_cache, scale, **kw)


@pytest.mark.parametrize(
    ("option", "off", "prop"),
    [("window_left", -1, "feature_window"), ("logits_soft_cap", 0.0, "feature_soft_cap")],
)
def test_the_suite_catches_a_feature_declared_but_ignored(
    monkeypatch: pytest.MonkeyPatch, option: str, off: object, prop: str
) -> None:
    """Ignoring the window reads the released pages (an error or NaN); ignoring the cap
    changes the numbers: either way the feature's property fails."""
    monkeypatch.setenv("KVCORE_CONFORMANCE_EXAMPLES", "10")
    with pytest.raises(Exception):  # noqa: B017 - an AssertionError or an IndexError
        Suite(Ignores(option, off), "cpu", "quick").run(prop)


class ReadsAWrongPage(TorchBackend):
    """The reference with one wrong block-table entry: a sequence of two pages or more
    reads its page 1 where its page 0 should be (a page of the pool holding other
    tokens' K/V, as a stale or misrouted table entry would)."""

    name = "wrong-page"

    def _decode(self, plan: Any, query: Any, kv_cache: Any, scale: float, **kw: Any) -> Any:
        table = plan.block_table.clone()
        ps = plan.cache.page_size
        rows = (plan.seq_lens.long() + ps - 1) // ps >= 2  # then the table has 2 columns
        if bool(rows.any()):
            table[rows, 0] = table[rows, 1]
        wrong = super().plan_decode(kv_cache, table, plan.seq_lens)
        return super()._decode(wrong, query, kv_cache, scale, **kw)


def test_the_suite_catches_a_wrong_page_within_its_derived_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control of the derived tolerances (kvcore.testing.tolerance): they are
    wide enough for any order of summation, and a page of other tokens still fails
    them. (Swapping two pages of one sequence would not: attention over a prefix is a
    sum over its tokens, whose order does not matter.)"""
    monkeypatch.setenv("KVCORE_CONFORMANCE_EXAMPLES", "20")
    with pytest.raises(AssertionError, match="differs beyond"):
        Suite(ReadsAWrongPage(), "cpu", "quick").run("decode_matches_oracle")


def test_torch_backend_declares_every_feature_and_fp8() -> None:
    caps = TorchBackend.capabilities
    assert caps.features == FEATURES
    assert {"float8_e4m3fn", "float8_e5m2"} <= caps.dtypes


def test_torch_backend_declares_no_float64() -> None:
    cache = torch.zeros(1, 2, 1, 1, 4, dtype=torch.float64)
    with pytest.raises(Unsupported, match="dtype=float64"):
        TorchBackend().plan_copy(cache, torch.zeros(0, dtype=I64), torch.zeros(0, dtype=I64))


# -- registry ----------------------------------------------------------------------


def test_registry_lists_the_three_backends() -> None:
    assert {"torch", "triton", "cupy"} <= set(registry.available())


def test_registry_gets_torch_and_rejects_unknown() -> None:
    assert isinstance(registry.get("torch"), TorchBackend)
    with pytest.raises(Unsupported, match="no backend 'nope'"):
        registry.get("nope")


# -- the two ways to run the suite ---------------------------------------------------


def test_cli_conformance_passes_on_torch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCORE_CONFORMANCE_EXAMPLES", "2")
    argv = ["conformance", "--backend", "torch", "--examples", "2"]
    argv += ["--property", "decode_matches_oracle", "--property", "copy_pages_is_exact"]
    assert kvcore_main(argv) == 0
    assert "2 passed, 0 failed" in capsys.readouterr().out


def test_cli_conformance_reports_each_feature(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCORE_CONFORMANCE_EXAMPLES", "2")  # the CLI sets it; restored after
    argv = ["conformance", "--backend", "torch", "--examples", "2"]
    for name in FEATURE_PROPERTIES:
        argv += ["--property", name]
    assert kvcore_main(argv) == 0
    out = capsys.readouterr().out
    assert "features=fp8,mla,sinks,soft_cap,window" in out
    for name in FEATURE_PROPERTIES:
        assert f"pass  {name}  [declared: " in out


def test_cli_conformance_unknown_backend_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvcore_main(["conformance", "--backend", "nope"]) == 2
    assert "nope" in capsys.readouterr().out


def test_pytest_plugin_runs_suite_for_a_third_party(tmp_path: Path) -> None:
    test_file = tmp_path / "test_third_party.py"
    test_file.write_text(
        textwrap.dedent(
            """
            from kvcore.testing.pytest_plugin import KernelConformance

            class TestMine(KernelConformance):
                pass  # backend from --kvcore-backend
            """
        )
    )
    env = {**os.environ, "KVCORE_CONFORMANCE_EXAMPLES": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(test_file),
            "--kvcore-backend",
            "torch",
            "--kvcore-profile",
            "quick",
            "-W",
            "error::pytest.PytestDeprecationWarning",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(PROPERTIES)} passed" in run.stdout


def test_bench_kernels_times_the_run_alone() -> None:
    """`kvcore bench kernels` plans (validation, the device sync) once, outside the timed
    calls: no plan is made while a decode or prefill is being timed."""
    from kvcore.bench import kernels as bench

    timing = [False]
    planned_while_timing: list[str] = []

    class Spy(TorchBackend):
        def plan_decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if timing[0]:
                planned_while_timing.append("decode")
            return super().plan_decode(*args, **kwargs)

        def plan_prefill(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if timing[0]:
                planned_while_timing.append("prefill")
            return super().plan_prefill(*args, **kwargs)

    timed: list[bool] = []

    def timer(fn):  # type: ignore[no-untyped-def]
        timing[0] = True
        before = len(planned_while_timing)
        fn()
        timing[0] = False
        timed.append(len(planned_while_timing) > before)  # True: fn was a plan
        return 1e-3

    shape = bench.Shape(2, 64, 4, 2, 16, 16, "float32", 8)
    data = bench._Data.make(shape, torch.device("cpu"))
    bench._time_backend(Spy(), data, timer)  # type: ignore[arg-type]
    # per op: the run is timed first (no plan inside), then the plan on its own
    assert timed == [False, True, False, True], timed


def test_bench_kernels_holds_only_dense_class_kernels_to_paged_over_dense() -> None:
    """docs/benchmarks.md: the paged/dense target covers Triton decode and prefill and
    CuPy decode; CuPy's CUDA-core prefill and the torch oracle are reported only."""
    from kvcore.bench import kernels as bench

    ops: dict[str, dict[str, float]] = {"decode": {}, "prefill": {}}
    record = {"device": "cuda:0", "backends": {n: ops for n in ("torch", "triton", "cupy")}}
    held = {
        tuple(f.key.split(".")[1:3])
        for f in bench.headline(record)
        if f.key.endswith("paged_over_dense") and f.target is not None
    }
    assert held == {("triton", "decode"), ("triton", "prefill"), ("cupy", "decode")}
    record["device"] = "cpu"
    assert not [f for f in bench.headline(record) if f.target is not None]
