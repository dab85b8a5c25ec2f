"""``kvcore bench capacity``: the simulation, its policies and its report."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.bench import capacity
from kvcore.bench.chat_trace import Trace, TraceConfig, make_trace, optimal_hit_tokens
from kvcore.bench.simulate import ContiguousPool, PagedPool, simulate
from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.manager import Manager

REQUIRED = (
    "concurrency_ratio",
    "utilization_paged",
    "pages_saved_fraction",
    "hit_rate",
    "hit_rate_optimal",
    "fp8_vs_bf16_pages_ratio",
)
SMALL = ["--requests", "60", "--num-pages", "256", "--max-new-tokens", "512", "--arrival-rate", "2"]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    return parser.parse_args(argv)


def _layout(num_pages: int, page_size: int = 16) -> KVLayout:
    return KVLayout(2, 2, 64, page_size, "float16", num_pages)


BASE = TraceConfig(
    num_requests=40,
    seed=3,
    arrival_rate=4.0,
    output_median=40,
    max_new_tokens=256,
    prompt_median=60,
    prompt_max=512,
    shared_fraction=0.6,
    prefix_min=64,
    prefix_max=200,
)


def _small_trace(**overrides: Any) -> Trace:
    return make_trace(replace(BASE, **overrides))


def test_report_has_the_keys_and_meets_the_targets() -> None:
    report = capacity.run(_args(SMALL))
    assert all(isinstance(report[key], float) for key in REQUIRED)
    assert report["hit_rate"] == report["hit_rate_optimal"] > 0
    assert report["hit_tokens"] == report["hit_tokens_optimal"] > 0
    assert report["hit_rate_fixed_budget"] <= report["hit_rate_optimal_fixed_schedule"]
    assert report["concurrency_ratio"] > 1.0
    assert 0.9 < report["utilization_paged"] <= 1.0
    assert 0.0 < report["pages_saved_fraction"] < 1.0
    for variant in ("plain", "shared_prefix"):
        for summary in report[variant].values():
            assert summary["finished"] == 60
            assert summary["failed_allocations"] == 0  # admission checks exactly
    json.dumps(report)  # plain JSON


def test_pages_per_gib_of_fp8_and_latent_layouts() -> None:
    """fp8 holds twice the pages of bfloat16 at one geometry (the default one: 32 layers,
    8 KV heads of 128, pages of 16 tokens); a latent page of 576 elements a token."""
    report = capacity.run(_args(SMALL))
    per_gib = report["pages_per_gib"]
    assert report["fp8_vs_bf16_pages_ratio"] == 2.0
    assert per_gib["kv"]["float8_e4m3fn"] == per_gib["kv"]["float8_e5m2"] == 1024
    assert per_gib["kv"]["bfloat16"] == (1 << 30) / (32 * 2 * 16 * 8 * 128 * 2) == 512
    assert per_gib["latent_dim"] == 576
    assert per_gib["latent"]["bfloat16"] == (1 << 30) / (32 * 16 * 576 * 2)
    assert per_gib["latent"]["float8_e4m3fn"] == 2 * per_gib["latent"]["bfloat16"]


def test_report_is_deterministic_for_a_seed() -> None:
    assert capacity.run(_args(SMALL)) == capacity.run(_args(SMALL))
    assert capacity.run(_args(SMALL)) != capacity.run(_args([*SMALL, "--seed", "1"]))


def test_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.cli import main

    assert main(["bench", "capacity", "--json", *SMALL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(REQUIRED) <= set(report)


def test_preemption_happens_and_every_request_finishes() -> None:
    trace = _small_trace(output_median=120)
    manager = Manager(_layout(60))
    steps: list[int] = []

    def check(step: int) -> None:
        manager.check_integrity()
        steps.append(step)

    stats = simulate(trace, PagedPool(manager, True, 0), on_step=check)
    assert stats.preemptions > 0 and stats.recompute_tokens > 0
    assert stats.failed_allocations == 0
    assert stats.finished == len(trace.requests)
    assert stats.generated_tokens >= trace.output_tokens
    assert manager.stats().num_sequences == 0 and manager.stats().held_pages == 0
    assert manager.stats().evictions > 0
    assert steps == list(range(stats.steps))


def test_paged_without_prefix_cache_never_caches() -> None:
    trace = _small_trace()
    manager = Manager(_layout(60))
    stats = simulate(
        trace, PagedPool(manager, False, 0), on_step=lambda _: manager.check_integrity()
    )
    assert stats.preemptions > 0 and stats.finished == len(trace.requests)
    assert manager.stats().cached_pages == 0 and manager.stats().hit_tokens == 0
    assert manager.stats().free_pages == 60


def test_contiguous_reserves_the_serving_limit() -> None:
    trace = _small_trace()
    pool = ContiguousPool(budget_tokens=2000, max_new_tokens=256, tokens_per_page=16)
    peak: list[int] = []
    stats = simulate(trace, pool, on_step=lambda _: peak.append(pool.reserved))
    assert stats.preemptions == 0 and stats.finished == len(trace.requests)
    assert max(peak) <= 2000 and pool.reserved == 0
    smallest = min(len(r.prompt) for r in trace.requests) + 256
    assert 1 <= stats.peak_running <= 2000 // smallest


def test_a_request_that_cannot_fit_is_a_typed_error() -> None:
    with pytest.raises(BadRequest):
        capacity.run(_args([*SMALL, "--num-pages", "64"]))


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    page_size=st.sampled_from([1, 4, 16]),
    fraction=st.sampled_from([0.3, 0.6, 1.0]),
    rate=st.sampled_from([0.5, 2.0, 8.0]),
)
def test_no_eviction_hits_equal_the_optimum_per_request(
    seed: int, page_size: int, fraction: float, rate: float
) -> None:
    trace = _small_trace(
        seed=seed, shared_fraction=fraction, arrival_rate=rate, output_median=12, num_requests=25
    )
    layout = capacity.no_eviction_layout(trace, _layout(1, page_size))
    pool = PagedPool(Manager(layout), True, 0)
    stats = simulate(trace, pool)
    pool.manager.check_integrity()
    assert stats.preemptions == 0 and pool.manager.stats().evictions == 0
    arrivals = {r.rid: r.arrival_step for r in trace.requests}
    assert stats.first_admitted == arrivals
    assert stats.first_hit_tokens == optimal_hit_tokens(trace.requests, arrivals, page_size)


def test_a_request_larger_than_the_pool_does_not_hang() -> None:
    trace = _small_trace(prompt_median=400, shared_fraction=0.0)
    with pytest.raises(BadRequest):
        simulate(trace, PagedPool(Manager(_layout(8)), False, 0))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16), num_pages=st.integers(40, 120), fork_every=st.sampled_from([0, 3])
)
def test_small_pools_keep_every_invariant(seed: int, num_pages: int, fork_every: int) -> None:
    # a sequence of up to 200 + 200 + 2 * 100 tokens always fits 40 pages of 16
    trace = _small_trace(
        seed=seed, num_requests=20, output_median=40, prompt_max=200, max_new_tokens=100
    )
    manager = Manager(_layout(num_pages))
    stats = simulate(
        trace,
        PagedPool(manager, True, 2),
        fork_every=fork_every,
        on_step=lambda _: manager.check_integrity(),
    )
    forks = sum(1 for r in trace.requests if fork_every and r.rid % fork_every == 0)
    assert stats.finished == len(trace.requests) + forks
    assert stats.failed_allocations == 0  # lookup's PrefixHit made every admission exact
    assert manager.stats().held_pages == 0
    # with evictions the first-admission hits can only fall short of the schedule's optimum
    optimum = optimal_hit_tokens(trace.requests, stats.first_admitted, 16)
    assert all(stats.first_hit_tokens[rid] <= optimum[rid] for rid in optimum)
