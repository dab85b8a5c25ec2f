"""``kvcore bench ops``: the timed replay counts every Manager call and page, and the
minimal baseline replays the very same calls."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvcore.bench import ops
from kvcore.bench.chat_trace import TraceConfig, make_trace
from kvcore.bench.minimal_cache import MinimalCache
from kvcore.bench.simulate import PagedPool, simulate
from kvcore.layout import KVLayout
from kvcore.manager import Manager

SMALL = [
    "--requests",
    "40",
    "--num-pages",
    "256",
    "--max-new-tokens",
    "256",
    "--arrival-rate",
    "4",
    "--repeat",
    "1",
]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ops.add_arguments(parser)
    return parser.parse_args(argv)


def test_report_counts_every_operation() -> None:
    report = ops.run(_args([*SMALL, "--fork-every", "4"]))
    per_op = report["ops"]
    assert set(per_op) == set(ops.OPS)
    assert all(per_op[op]["calls"] > 0 for op in ops.OPS)
    assert report["calls"] == sum(s["calls"] for s in per_op.values())
    assert report["page_ops"] == sum(s["pages"] for s in per_op.values())
    assert report["page_ops_per_s"] > 0 and report["calls_per_s"] > 0
    assert report["manager_over_minimal"] > 0 and len(report["manager_over_minimal_runs"]) == 1
    assert report["minimal"]["page_ops_per_s"] > 0
    assert report["replay"]["failed_allocations"] == 0  # admission is exact
    assert per_op["allocate"]["failed"] == 0
    assert report["manager_seconds"] <= report["replay_seconds"]
    forks = sum(1 for rid in range(40) if rid % 4 == 0)
    assert per_op["fork"]["calls"] == forks
    # every sequence is freed exactly once per admission: first ones, forks, readmissions
    allocated = per_op["allocate"]["calls"] - per_op["allocate"]["failed"]
    assert per_op["free"]["calls"] == allocated + forks
    assert per_op["extend"]["failed"] == report["replay"]["preemptions"]
    assert per_op["free"]["pages"] == per_op["allocate"]["pages"] + per_op["fork"]["pages"] + (
        per_op["extend"]["pages"] - _copies(report)
    )


def _copies(report: dict[str, Any]) -> int:
    """Pages extend counted that replaced a page (copy-on-write) rather than added one."""
    copies: int = report["replay"]["copies"]
    return copies


TRACE = TraceConfig(
    num_requests=30,
    seed=5,
    arrival_rate=4.0,
    output_median=30,
    max_new_tokens=128,
    prompt_max=300,
    shared_fraction=0.6,
    prefix_min=32,
    prefix_max=96,
)


def test_timed_manager_behaves_like_the_manager() -> None:
    trace = make_trace(TRACE)
    layout = KVLayout(2, 2, 64, 8, "float16", 120)
    plain, timed = Manager(layout, eviction="lru"), ops.Timed(Manager(layout, eviction="lru"))
    a = simulate(trace, PagedPool(plain, True, 1), fork_every=3)
    b = simulate(trace, PagedPool(timed, True, 1), fork_every=3)
    assert a == b and plain.stats() == timed.stats()
    assert isinstance(timed.target, Manager)
    timed.target.check_integrity()
    assert a.preemptions > 0 and a.failed_allocations == 0


def test_minimal_baseline_replays_like_the_manager() -> None:
    """Same admissions, hits, preemptions and page counts: the ratio compares equal work."""
    trace = make_trace(TRACE)
    layout = KVLayout(2, 2, 64, 8, "float16", 120)
    manager, minimal = Manager(layout, eviction="lru"), MinimalCache(layout)
    a = simulate(trace, PagedPool(manager, True, 1), fork_every=3)
    b = simulate(trace, PagedPool(minimal, True, 1), fork_every=3)
    assert a == b and a.preemptions > 0
    s, t = manager.stats(), minimal.stats()
    assert (s.free_pages, s.evictable_pages, s.cached_pages) == (
        t.free_pages,
        t.evictable_pages,
        t.cached_pages,
    )


def test_cli_prints_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.cli import main

    assert main(["bench", "ops", *SMALL]) == 0
    assert "manager_over_minimal" in capsys.readouterr().out


def test_lockstep_refuses_a_baseline_that_answers_otherwise() -> None:
    class Forgetful(MinimalCache):
        def commit(self, seq_id: int, tokens: Any, *, start: int = 0) -> int:
            return 0  # publishes nothing: its lookups would never hit

    layout = KVLayout(2, 2, 64, 8, "float16", 120)
    pair = ops.Lockstep(ops.Timed(Manager(layout, eviction="lru")), ops.Timed(Forgetful(layout)))
    with pytest.raises(AssertionError, match="minimal"):
        simulate(make_trace(TRACE), PagedPool(pair, True, 1))
