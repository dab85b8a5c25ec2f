"""``kvcore bench ops``: in-process Manager throughput on the capacity trace.

The shared-prefix trace is replayed exactly as ``kvcore bench capacity`` replays
it under the paged + prefix-cache policy (same pool, same scheduler: lookups at
admission, one extend per token, commits as pages fill, preemptions, LRU
evictions), through a Manager whose every public call is timed with
``perf_counter_ns``. Every ``--fork-every``-th request also forks a second
sample after its prefill (parallel sampling, n=2), so fork and copy-on-write are
in the mix. Only time inside Manager calls counts, not the simulator's.

The baseline, measured in the same run: :class:`MinimalCache`
(kvcore/bench/minimal_cache.py), the least a paged allocator with a chained-hash
LRU prefix cache does for the same calls (no namespaces, no validation, no
integrity checks, no events). One simulation
drives both in lockstep (:class:`Lockstep`): every call goes to the Manager and
to the baseline, in alternating order, each timed by the same wrapper, and
their answers must agree (same pages, hits, failures), so both did the same
work under the same machine load. ``manager_over_minimal`` = Manager page
ops/s over baseline page ops/s, the median over ``--repeat`` replays; the
Manager's own figures are those of its fastest replay. The Manager's events
are taken after every step, as the daemon takes them after every request.

Page operations per call (the unit of ``page_ops_per_s``)::

    allocate  pages of the new block table (hits pinned + fresh)
    extend    pages appended + pages copied on write
    commit    pages newly published (hashed and indexed)
    free      pages released
    fork      pages shared with the child
    lookup    pages matched
"""

from __future__ import annotations

import argparse
import operator
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvcore.bench import capacity
from kvcore.bench.chat_trace import Trace
from kvcore.bench.minimal_cache import MinimalCache
from kvcore.bench.report import Figure
from kvcore.bench.simulate import PageCache, PagedPool, RunStats, simulate
from kvcore.errors import BadRequest, KVCoreError
from kvcore.layout import KVLayout
from kvcore.manager import Allocation, Extension, Manager, PrefixHit, Stats

OPS = ("allocate", "extend", "commit", "free", "fork", "lookup")
HEADLINE = (  # what `kvcore bench ops` prints without --json (docs/benchmarks.md)
    Figure("page_ops_per_s", "page operations / s (time inside Manager calls)"),
    Figure("calls_per_s", "Manager calls / s"),
    Figure("manager_over_minimal", "Manager time / a minimal page cache's (median)"),
    *(Figure(f"ops.{op}.mean_us", f"{op}: mean µs per call") for op in OPS),
    Figure("replay.hit_rate", "prefix-cache hit rate of the replay"),
)
_R = TypeVar("_R")


@dataclass(slots=True)
class OpTimes:
    """Samples of one operation: durations in nanoseconds, page operations in pages."""

    ns: list[int] = field(default_factory=list)  # one per call, failed ones included
    pages: int = 0
    failed: int = 0  # calls that raised a KVCoreError (out of pages)

    def add(self, ns: int, pages: int) -> None:
        self.ns.append(ns)
        self.pages += pages

    def fail(self, ns: int) -> None:
        self.ns.append(ns)
        self.failed += 1

    def summary(self) -> dict[str, Any]:
        calls, total = len(self.ns), sum(self.ns)
        ordered = sorted(self.ns)
        return {
            "calls": calls,
            "failed": self.failed,
            "pages": self.pages,
            "calls_per_s": calls / (total * 1e-9) if total else 0.0,
            "mean_us": total / calls / 1e3 if calls else 0.0,
            "p50_us": ordered[calls // 2] / 1e3 if calls else 0.0,
            "p99_us": ordered[min(calls - 1, calls * 99 // 100)] / 1e3 if calls else 0.0,
            "pages_per_call": self.pages / calls if calls else 0.0,
        }


class Timed:
    """Wraps a :class:`~kvcore.bench.simulate.PageCache` (the Manager or the minimal
    baseline): times each call with ``perf_counter_ns`` and counts its page
    operations. allocate and extend also count the calls that fail with a
    KVCoreError (out of pages: part of a scheduler's work); the others never fail
    in this replay. Behaviour is the target's, unchanged; both targets pay the
    same wrapper, so the ratio of their times compares only their own work."""

    def __init__(self, target: PageCache) -> None:
        self.target = target
        self.layout: KVLayout = target.layout
        self.times: dict[str, OpTimes] = {op: OpTimes() for op in OPS}
        self.copies = 0  # copy-on-write page copies extend returned
        self._held: dict[int, int] = {}  # seq -> pages in its block table
        self._published: dict[int, int] = {}  # seq -> pages committed (commit's return)

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        target, clock = self.target, time.perf_counter_ns
        t = clock()
        hit = target.lookup(tokens)
        elapsed = clock() - t
        self.times["lookup"].add(elapsed, hit.num_cached_tokens // self.layout.page_size)
        return hit

    def allocate(self, seq_id: int, tokens: Sequence[int]) -> Allocation:
        target, clock = self.target, time.perf_counter_ns
        t = clock()
        try:
            result = target.allocate(seq_id, tokens)
        except KVCoreError:
            self.times["allocate"].fail(clock() - t)
            raise
        self.times["allocate"].add(clock() - t, len(result.pages))
        self._held[seq_id] = len(result.pages)
        self._published[seq_id] = result.num_cached_tokens // self.layout.page_size
        return result

    def extend(self, seq_id: int, num_tokens: int) -> object:
        target, clock = self.target, time.perf_counter_ns
        t = clock()
        try:
            result = target.extend(seq_id, num_tokens)
        except KVCoreError:  # out of pages: the scheduler preempts and retries
            self.times["extend"].fail(clock() - t)
            raise
        elapsed = clock() - t
        new, copies = _extension_pages(result)
        self.times["extend"].add(elapsed, new + copies)
        self._held[seq_id] += new
        self.copies += copies
        return result

    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int:
        target, clock = self.target, time.perf_counter_ns
        t = clock()
        published = target.commit(seq_id, tokens, start=start)
        elapsed = clock() - t
        self.times["commit"].add(elapsed, published - self._published[seq_id])
        self._published[seq_id] = published
        return published

    def free(self, seq_id: int) -> None:
        target, clock = self.target, time.perf_counter_ns
        t = clock()
        target.free(seq_id)
        self.times["free"].add(clock() - t, self._held.pop(seq_id))
        del self._published[seq_id]

    def fork(self, parent_id: int, child_id: int) -> object:
        target, clock = self.target, time.perf_counter_ns
        t = clock()
        table = target.fork(parent_id, child_id)
        elapsed = clock() - t
        self.times["fork"].add(elapsed, self._held[parent_id])
        self._held[child_id] = self._held[parent_id]
        self._published[child_id] = self._published[parent_id]
        return table

    def stats(self) -> Stats:
        return self.target.stats()

    def seconds(self) -> float:
        """Time inside the target's calls, all operations."""
        return sum(sum(self.times[op].ns) for op in OPS) * 1e-9

    def page_ops(self) -> int:
        return sum(self.times[op].pages for op in OPS)


def _same_extension(mine: object, theirs: object) -> bool:
    """The Manager's Extension names the pages the baseline's tuple does."""
    assert isinstance(mine, Extension), f"not an Extension: {mine!r}"
    return (mine.new_pages, mine.copies) == theirs


def _extension_pages(result: object) -> tuple[int, int]:
    """(pages appended, pages copied) of an extend result: the Manager's Extension
    or the minimal baseline's ``(new_pages, copies)`` tuple."""
    if isinstance(result, Extension):
        return len(result.new_pages), len(result.copies)
    assert isinstance(result, tuple), f"unknown extend result {result!r}"
    return len(result[0]), len(result[1])


class Lockstep:
    """Makes each call on both timed caches, the Manager's and the baseline's, in
    alternating order (neither always runs on the other's warm CPU caches), and
    checks that they answer alike; the simulator gets the Manager's answers. Both
    see the same calls at nearly the same moment, so a busy machine slows both
    alike and their ratio stays steady where their absolute speeds do not."""

    def __init__(self, manager: Timed, minimal: Timed) -> None:
        self.manager, self.minimal = manager, minimal
        self.layout = manager.layout
        self._minimal_first = False

    def _both(self, call: Callable[[Timed], _R], agree: Callable[[_R, _R], bool]) -> _R:
        minimal_first = self._minimal_first
        self._minimal_first = not minimal_first
        outcomes: list[_R | KVCoreError] = []
        for cache in (
            (self.minimal, self.manager) if minimal_first else (self.manager, self.minimal)
        ):
            try:
                outcomes.append(call(cache))
            except KVCoreError as exc:  # out of pages: both must say so
                outcomes.append(exc)
        mine, theirs = outcomes[::-1] if minimal_first else outcomes
        if isinstance(mine, KVCoreError) or isinstance(theirs, KVCoreError):
            assert type(mine) is type(theirs), f"Manager: {mine!r}; minimal: {theirs!r}"
            assert isinstance(mine, KVCoreError)
            raise mine
        assert agree(mine, theirs), f"Manager: {mine!r}; minimal: {theirs!r}"
        return mine

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        return self._both(lambda c: c.lookup(tokens), operator.eq)

    def allocate(self, seq_id: int, tokens: Sequence[int]) -> Allocation:
        return self._both(lambda c: c.allocate(seq_id, tokens), operator.eq)

    def extend(self, seq_id: int, num_tokens: int) -> object:
        return self._both(lambda c: c.extend(seq_id, num_tokens), _same_extension)

    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int:
        return self._both(lambda c: c.commit(seq_id, tokens, start=start), operator.eq)

    def free(self, seq_id: int) -> None:
        self._both(lambda c: c.free(seq_id), operator.eq)

    def fork(self, parent_id: int, child_id: int) -> object:
        return self._both(lambda c: c.fork(parent_id, child_id), operator.eq)

    def stats(self) -> Stats:
        mine, theirs = self.manager.stats(), self.minimal.stats()
        same = ("free_pages", "evictable_pages", "held_pages", "cached_pages", "num_sequences")
        assert all(getattr(mine, f) == getattr(theirs, f) for f in same), f"{mine} vs {theirs}"
        return mine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    capacity.add_arguments(parser)
    parser.add_argument(
        "--fork-every",
        type=int,
        default=8,
        help="fork every N-th request into a second sample (0: never)",
    )
    parser.add_argument(
        "--variant",
        choices=("shared_prefix", "plain"),
        default="shared_prefix",
        help="the trace replayed",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="replays; the ratio is their median, the Manager's figures its best",
    )


def replay(
    trace: Trace, layout: KVLayout, args: argparse.Namespace
) -> tuple[Timed, Timed, RunStats, float]:
    """One replay of ``trace`` driving a Manager and the baseline in lockstep:
    (Manager timings, baseline timings, run stats, wall seconds)."""
    # LRU: the minimal baseline evicts least recently used first, and both must agree
    manager, minimal = Timed(Manager(layout, eviction="lru")), Timed(MinimalCache(layout))
    pool = PagedPool(Lockstep(manager, minimal), True, int(args.watermark * layout.num_pages))
    target = manager.target
    assert isinstance(target, Manager)

    def take_events(_step: int) -> None:
        # As the daemon publishes after each request, the Manager's events are
        # taken after each step (untimed: a list swap); the baseline queues none.
        target.take_events()

    wall = time.perf_counter()
    stats = simulate(trace, pool, fork_every=args.fork_every, on_step=take_events)
    wall = time.perf_counter() - wall
    target.check_integrity()
    return manager, minimal, stats, wall


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = capacity.layout_from_args(args)
    plain, shared = capacity.traces_from_args(args)
    trace = shared if args.variant == "shared_prefix" else plain
    capacity.check_fits(trace, layout, args.max_new_tokens)
    if args.repeat < 1:
        raise BadRequest(f"--repeat must be >= 1, got {args.repeat}")
    runs = [replay(trace, layout, args) for _ in range(args.repeat)]
    ratios = sorted(r[1].seconds() / r[0].seconds() for r in runs)  # same page ops on both sides
    manager, _, stats, wall = min(runs, key=lambda r: r[0].seconds())
    minimal = min((r[1] for r in runs), key=Timed.seconds)
    per_op = {op: manager.times[op].summary() for op in OPS}
    calls = sum(s["calls"] for s in per_op.values())
    pages, seconds = manager.page_ops(), manager.seconds()
    mstats = manager.target.stats()
    return {
        "page_ops_per_s": pages / seconds,
        "calls_per_s": calls / seconds,
        "manager_over_minimal": statistics.median(ratios),
        "manager_over_minimal_runs": [round(ratio, 3) for ratio in ratios],
        "calls": calls,
        "page_ops": pages,
        "manager_seconds": seconds,
        "replay_seconds": wall,
        "ops": per_op,
        "minimal": {
            "page_ops_per_s": pages / minimal.seconds(),
            "seconds": minimal.seconds(),
            "mean_us": {op: minimal.times[op].summary()["mean_us"] for op in OPS},
        },
        "replay": {
            "variant": args.variant,
            "requests": len(trace.requests),
            "steps": stats.steps,
            "preemptions": stats.preemptions,
            "failed_allocations": stats.failed_allocations,
            "copies": manager.copies,
            "evictions": mstats.evictions,
            "hit_rate": mstats.hit_rate,
            "num_pages": layout.num_pages,
            "page_size": layout.page_size,
            "fork_every": args.fork_every,
            "repeat": args.repeat,
        },
    }
