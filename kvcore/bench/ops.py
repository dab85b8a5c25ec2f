"""``kvcore bench ops``: in-process Manager throughput on the capacity trace.

The shared-prefix trace is replayed exactly as ``kvcore bench capacity`` replays
it under the paged + prefix-cache policy (same pool, same scheduler: lookups at
admission, one extend per token, commits as pages fill, preemptions, LRU
evictions), through a Manager whose every public call is timed with
``perf_counter_ns``. Every ``--fork-every``-th request also forks a second
sample after its prefill (parallel sampling, n=2), so fork and copy-on-write are
in the mix. Only time inside Manager calls counts, not the simulator's.

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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.bench import capacity
from kvcore.bench.simulate import PagedPool, simulate
from kvcore.errors import KVCoreError
from kvcore.manager import DEFAULT_NAMESPACE, Allocation, Extension, Manager, PrefixHit

OPS = ("allocate", "extend", "commit", "free", "fork", "lookup")


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


class TimedManager(Manager):
    """A Manager that times each mutating operation and lookup, and counts its page
    operations. allocate and extend also count the calls that fail with a
    KVCoreError (out of pages: part of a scheduler's work); the others never fail
    in this replay. Behaviour is the Manager's, unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.times: dict[str, OpTimes] = {op: OpTimes() for op in OPS}
        self._published: dict[int, int] = {}  # seq -> pages published (commit's return)
        self.copies = 0  # copy-on-write page copies extend returned

    def allocate(
        self, seq_id: int, tokens: Sequence[int], *, namespace: str = DEFAULT_NAMESPACE
    ) -> Allocation:
        t = time.perf_counter_ns()
        try:
            result = super().allocate(seq_id, tokens, namespace=namespace)
        except KVCoreError:
            self.times["allocate"].fail(time.perf_counter_ns() - t)
            raise
        self.times["allocate"].add(time.perf_counter_ns() - t, len(result.pages))
        self._published[seq_id] = result.num_cached_tokens // self.layout.page_size
        return result

    def extend(self, seq_id: int, num_tokens: int) -> Extension:
        t = time.perf_counter_ns()
        try:
            result = super().extend(seq_id, num_tokens)
        except KVCoreError:  # out of pages: the scheduler preempts and retries
            self.times["extend"].fail(time.perf_counter_ns() - t)
            raise
        self.times["extend"].add(time.perf_counter_ns() - t, len(result.new_pages) + len(result.copies))
        self.copies += len(result.copies)
        return result

    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int:
        t = time.perf_counter_ns()
        published = super().commit(seq_id, tokens, start=start)
        elapsed = time.perf_counter_ns() - t
        self.times["commit"].add(elapsed, published - self._published.get(seq_id, 0))
        self._published[seq_id] = published
        return published

    def free(self, seq_id: int) -> None:
        pages = self.layout.pages_for(self.num_tokens(seq_id))
        t = time.perf_counter_ns()
        super().free(seq_id)
        self.times["free"].add(time.perf_counter_ns() - t, pages)
        self._published.pop(seq_id, None)

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        t = time.perf_counter_ns()
        table = super().fork(parent_id, child_id)
        self.times["fork"].add(time.perf_counter_ns() - t, len(table))
        self._published[child_id] = self._published.get(parent_id, 0)
        return table

    def lookup(self, tokens: Sequence[int], *, namespace: str = DEFAULT_NAMESPACE) -> PrefixHit:
        t = time.perf_counter_ns()
        hit = super().lookup(tokens, namespace=namespace)
        elapsed = time.perf_counter_ns() - t
        self.times["lookup"].add(elapsed, hit.num_cached_tokens // self.layout.page_size)
        return hit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    capacity.add_arguments(parser)
    parser.add_argument("--fork-every", type=int, default=8,
                        help="fork every N-th request into a second sample (0: never)")
    parser.add_argument("--variant", choices=("shared_prefix", "plain"), default="shared_prefix")


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = capacity.layout_from_args(args)
    plain, shared = capacity.traces_from_args(args)
    trace = shared if args.variant == "shared_prefix" else plain
    capacity.check_fits(trace, layout, args.max_new_tokens)
    manager = TimedManager(layout)
    pool = PagedPool(manager, True, int(args.watermark * layout.num_pages))
    wall = time.perf_counter()
    stats = simulate(trace, pool, fork_every=args.fork_every)
    wall = time.perf_counter() - wall
    manager.check_integrity()
    per_op = {op: manager.times[op].summary() for op in OPS}
    calls = sum(s["calls"] for s in per_op.values())
    pages = sum(s["pages"] for s in per_op.values())
    seconds = sum(sum(manager.times[op].ns) for op in OPS) * 1e-9
    mstats = manager.stats()
    return {
        "page_ops_per_s": pages / seconds,
        "calls_per_s": calls / seconds,
        "calls": calls,
        "page_ops": pages,
        "manager_seconds": seconds,
        "replay_seconds": wall,
        "ops": per_op,
        "replay": {
            "variant": args.variant,
            "requests": len(trace.requests),
            "steps": stats.steps,
            "preemptions": stats.preemptions,
            "copies": manager.copies,
            "evictions": mstats.evictions,
            "hit_rate": mstats.hit_rate,
            "num_pages": layout.num_pages,
            "page_size": layout.page_size,
            "fork_every": args.fork_every,
        },
    }
