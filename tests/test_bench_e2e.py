"""``kvcore bench e2e`` on a tiny configuration: every key of the record, and the ragged
batch's tokens through KVCoreCache equal DynamicCache's. No timing is asserted: the
figures live in the bench (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvcore.bench import e2e, report

TINY = shlex.split(
    "--layers 2 --hidden-size 128 --batch 2 --prompt-tokens 20 --ragged-batch 3"
    " --ragged-min 9 --ragged-max 40 --new-tokens 6 --ttft-tokens 40 --repeats 1"
    " --layer-calls 3 --layer-rounds 1"
)

RATIOS = [
    "decode_tps_ratio",
    "hf_paged_decode_tps_ratio",
    "ragged_decode_tps_ratio",
    "ragged_hf_paged_decode_tps_ratio",
    "kvcore_over_hf_paged",
    "ragged_kvcore_over_hf_paged",
    "ttft_cached_ratio",
    "decode_layer_over_sdpa",
]
PER_WORKLOAD = [
    "kvcore_tokens_per_s",
    "dynamic_cache_tokens_per_s",
    "hf_paged_tokens_per_s",
    "kvcore_over_hf_paged",
    "kvcore_tokens_match",
    "hf_paged_tokens_match",
    "kvcore_rows_equal",
    "hf_paged_rows_equal",
    "kvcore_rows_equal_hf_paged",
    "rows_compared",
    "batch",
    "prompt_tokens",
    "new_tokens",
]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def record() -> Iterator[dict[str, Any]]:
    threads = torch.get_num_threads()  # the bench sets torch's threads for the process
    try:
        yield e2e.measure(_args(TINY))
    finally:
        torch.set_num_threads(threads)


def test_record_has_every_ratio_and_they_are_positive(record: dict[str, Any]) -> None:
    for key in RATIOS:
        assert record[key] > 0, key
    assert record["decode_layer_us"] > 0 and record["sdpa_layer_us"] > 0
    for workload in ("decode", "ragged"):
        assert set(PER_WORKLOAD) <= set(record[workload]), workload
        assert record[workload]["new_tokens"] == 6
    assert record["decode"]["prompt_tokens"] == 20 and record["decode"]["batch"] == 2
    assert record["ragged"]["prompt_tokens"] == [9, 24, 40]


def test_ragged_tokens_through_kvcore_equal_dynamic_cache(record: dict[str, Any]) -> None:
    ragged = record["ragged"]
    assert ragged["rows_compared"] == 3  # one repeat of three rows
    assert ragged["kvcore_tokens_match"] is True and ragged["kvcore_rows_equal"] == 3
    assert record["decode"]["kvcore_tokens_match"] is True
    assert 0 <= ragged["hf_paged_rows_equal"] <= 3
    assert ragged["hf_paged_tokens_match"] == (ragged["hf_paged_rows_equal"] == 3)


def test_layer_figures_cover_both_workloads(record: dict[str, Any]) -> None:
    layer = record["layer"]
    assert layer["batch"] == 2 and layer["context"] == 20 + 3
    assert layer["ragged_context"] == [9 + 3, 24 + 3, 40 + 3]
    for prefix in ("", "ragged_"):
        assert layer[f"{prefix}decode_us"] > 0 and layer[f"{prefix}sdpa_us"] > 0
        assert layer[f"{prefix}decode_over_sdpa"] > 0


def test_every_target_is_reported(record: dict[str, Any]) -> None:
    assert list(record["targets"]) == [t.name for t in e2e.TARGETS]
    for target in e2e.TARGETS:
        met = target.met(record[target.key])
        assert record["targets"][target.name] == ("met" if met else "not met")
    assert record["targets_met"] == all(v == "met" for v in record["targets"].values())


def test_headline_keeps_the_ratios_and_targets(record: dict[str, Any]) -> None:
    """What `kvcore bench e2e` prints without --json: the ratios, each target with the
    record's verdict, neither the layer record nor the setup."""
    rows = report.rows(record, e2e.HEADLINE)
    keys = {row[0] for row in rows}
    assert {"decode_tps_ratio", "ragged_decode_tps_ratio", "decode_layer_over_sdpa"} <= keys
    verdicts = {row[0]: row[4] for row in rows if row[3]}
    assert verdicts == {
        t.key: "met" if record["targets"][t.name] == "met" else "NOT MET" for t in e2e.TARGETS
    }
    assert not [key for key in keys if key.startswith(("layer", "setup"))]


def test_target_names_and_bounds() -> None:
    at_least, at_most = e2e.Target("x", True, 0.85), e2e.Target("y", False, 2.0)
    assert (at_least.name, at_most.name) == ("x >= 0.85", "y <= 2")
    assert at_least.met(0.85) and not at_least.met(0.84)
    assert at_most.met(2.0) and not at_most.met(2.01)


def test_spread_covers_both_ends() -> None:
    assert e2e.spread(128, 384, 8) == [128, 164, 201, 237, 274, 310, 347, 384]
    assert e2e.spread(5, 9, 1) == [5]
