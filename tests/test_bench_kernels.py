"""bench/kernels.py's data and its one-layer decode figures (``kvcore bench e2e``'s
``layer``): the dense side is the paged side laid out contiguously, masked past a ragged
row's length, so the two calls timed against each other compute the same attention; the
step's plan is made once, outside the timed calls. No timing is asserted."""

from __future__ import annotations

from typing import Any

import torch
from kvcore_torch import TorchBackend

from kvcore.bench import kernels
from kvcore.testing import tolerance

SHAPE = kernels.Shape(3, 40, 4, 2, 16, 8, "float32", 1)  # B, context, Hq, Hkv, D, page
CPU = torch.device("cpu")


def test_ragged_rows_dense_side_computes_the_paged_decode() -> None:
    data = kernels._Data.make(SHAPE, CPU, [12, 40, 25])
    assert data.seq_lens.tolist() == [12, 40, 25]
    assert data.mask is not None and data.mask.shape == (3, 1, 1, 40)
    assert data.mask.sum(dim=-1).flatten().tolist() == [12, 40, 25]
    assert data.kv_bytes == 2 * (12 + 40 + 25) * 2 * 16 * 4  # K and V, Hkv, D, fp32
    backend = TorchBackend()
    plan = backend.plan_decode(data.kv_cache, data.block_table, data.seq_lens)
    paged = backend.decode(plan, data.q_decode, data.kv_cache, data.scale)
    key, value = tolerance.cache_parts(data.kv_cache)
    bound = tolerance.attention(data.q_decode, key, value, data.scale, keys=40)
    tolerance.assert_close(paged, data.dense_decode(), bound, "paged decode against dense")


def test_rows_of_one_length_are_not_masked() -> None:
    data = kernels._Data.make(SHAPE, CPU)
    assert data.mask is None and data.seq_lens.tolist() == [40, 40, 40]
    assert data.kv_bytes == 2 * 3 * 40 * 2 * 16 * 4


def test_layer_decode_times_plans_once_and_times_every_round() -> None:
    calls: dict[str, int] = {"plan": 0, "decode": 0}

    class Counting(TorchBackend):
        def plan_decode(self, *args: Any, **kwargs: Any) -> Any:
            calls["plan"] += 1
            return super().plan_decode(*args, **kwargs)

        def decode(self, *args: Any, **kwargs: Any) -> Any:
            calls["decode"] += 1
            return super().decode(*args, **kwargs)

    times = kernels.layer_decode_times(Counting(), SHAPE, [12, 40, 25], calls=3, rounds=2)
    assert calls == {"plan": 1, "decode": 1 + 3 * 2}  # one warm-up call, then the rounds
    assert times.decode_us > 0 and times.sdpa_us > 0 and times.decode_over_sdpa > 0


def test_every_feature_is_timed_against_the_reference_and_dense_tensors() -> None:
    """The per-feature figures (kvcore/bench/kernel_features.py) on a small shape: each
    feature's dense twin computes what the reference computes, and the torch backend
    gets every figure (over_reference is 1 for the reference itself)."""
    from kvcore.bench import kernel_features

    dims = {"batch": 2, "context": 40, "hq": 4, "hkv": 2, "dim": 16, "page": 8, "prefill_q": 5}
    record = kernel_features.measure(["torch", "triton"], dims, CPU, lambda fn: (fn(), 1e-3)[1])
    assert set(record) == set(kernel_features.FEATURES)
    for feature, case in kernel_features.cases(device=CPU, **dims).items():
        # the reference against the dense twin: both fp32 over the same dequantized K/V
        a, options = case.attention, case.run_options
        key, value = tolerance.cache_parts(
            case.kv_cache,
            k_scale=options.get("k_scale", 1.0),
            v_scale=options.get("v_scale", 1.0),
            v_head_dim=a.v_head_dim or None,
        )
        entry = record[feature]
        for op, query in (("decode", case.q_decode), ("prefill", case.q_prefill)):
            bound = tolerance.attention(query, key, value, case.scale, keys=dims["context"])
            figures = entry["torch"][op]
            assert figures["over_reference"] == 1.0, feature
            assert figures["max_abs_err"] <= bound.atol, (feature, op, figures, str(bound))
            assert entry["dense_ms"][op] > 0
        assert "triton" in entry  # figures, or why not
