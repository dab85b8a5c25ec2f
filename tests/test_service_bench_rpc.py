"""`kvcore bench rpc` runs end to end and reports its figures (no timing is asserted here:
performance figures live in docs/benchmarks.md, not in tests)."""

from __future__ import annotations

import argparse

from kvcore.bench import rpc


def test_bench_rpc_reports_its_figures() -> None:
    parser = argparse.ArgumentParser()
    rpc.add_arguments(parser)
    result = rpc.run(
        parser.parse_args(
            ["--iterations", "300", "--batches", "5", "--batch", "32", "--block", "100"]
        )
    )
    for key in (
        "echo_p50_us",
        "echo_p99_us",
        "single_p50_us",
        "single_p99_us",
        "single_p50_ratio",
        "batch_p50_us",
        "batched_per_op_us",
        "batched_per_op_ratio",
    ):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["batch_size"] == 32 and result["message_bytes"] > 20
    assert result["single_p50_ratio"] == result["single_p50_us"] / result["echo_p50_us"]
    assert isinstance(result["meets_targets"], bool)
