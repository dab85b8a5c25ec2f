"""The torch reference backend: the conformance suite on it, dense-attention sanity
checks that do not lean on the backend's own helpers, the registry, and the two
ways a third party runs the suite (``kvcore conformance`` and the pytest plugin)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from kvcore_torch import TorchBackend

from kvcore import backend as registry
from kvcore.cli import main as kvcore_main
from kvcore.errors import Unsupported
from kvcore.testing.kernels import PROPERTIES, dense_attention
from kvcore.testing.pytest_plugin import KernelConformance

I32, I64 = torch.int32, torch.int64


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
    torch.testing.assert_close(out, expected)


def test_zero_scale_averages_values() -> None:
    k, v = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    cache = _one_page_cache(k, v, page_size=8)
    out = _decode(
        torch.randn(1, 2, 4), cache, torch.tensor([[1]], dtype=I32), torch.tensor([5], dtype=I32), 0
    )
    torch.testing.assert_close(out[0], v.mean(0).expand(2, 4))


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
        torch.testing.assert_close(out[i, 0], w @ v[:m, 0])


def test_dense_attention_reference_matches_sdpa_is_causal() -> None:
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(dense_attention(q, k, v, 8**-0.5), ref)


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
