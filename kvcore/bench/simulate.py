"""The step simulator behind ``kvcore bench capacity`` and ``kvcore bench ops``.

A trace (kvcore.bench.chat_trace) is replayed, step by step, against one fixed pool,
as a vLLM-style scheduler runs it (docs/benchmarks.md states it too). The pool
is a policy's memory side (:class:`Pool`): :class:`ContiguousPool` reserves
prompt + max_new_tokens token slots per sequence on admission; :class:`PagedPool`
drives a Manager, with the shared prefix cache when ``prefix`` is set. One step::

    1 arrivals join the back of the waiting queue
    2 decode: every running sequence (oldest first) grows by one token; when the
      pool has no page, the newest running sequence is preempted (freed, put back
      at the front of the queue, recomputed on readmission) until it fits
    3 admission, FCFS, only in a step without preemption: the queue head is
      prefilled (prompt + tokens generated before a preemption) while it fits
      and (PagedPool) ``watermark_pages`` stay free; the first that does not
      fit blocks the queue. PagedPool decides from ``lookup``'s PrefixHit,
      which counts the hit pages allocate would pin out of the LRU, so its
      decision is exact: an allocate it makes never fails (``failed_allocations``)
    4 the batch runs: each scheduled sequence produces one token; commits
      (PagedPool with ``prefix``); finished sequences are freed

Units: tokens and pages as named; a "step" is one engine iteration; ``rid`` is
a request (sequence) id. ``simulate`` reads no clock and draws no random
numbers: the same trace on the same pool replays the same way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcore.bench.chat_trace import Request, Trace
from kvcore.errors import BadRequest, OutOfPages
from kvcore.layout import KVLayout, cdiv
from kvcore.manager import Allocation, PrefixHit, Stats


class Pool(Protocol):
    """The memory side of one policy. ``rid`` names a live sequence."""

    def admit(self, rid: int, tokens: Sequence[int], num_running: int) -> int | None:
        """Start ``rid`` holding ``tokens``; tokens served from cache, or None if it does not fit."""

    def grow(self, rid: int) -> bool:
        """One more token; False (and no change) if the pool has no room."""

    def release(self, rid: int) -> None: ...

    def publish(self, rid: int, tokens: Sequence[int]) -> None:
        """Commit the full pages of ``tokens`` (the sequence's tokens so far)."""

    def fork(self, parent: int, child: int) -> None: ...

    def failed_allocations(self) -> int:
        """Admissions that the pool accepted but whose allocation then failed."""

    def held(self) -> tuple[int, int]:
        """(token slots reserved, pages held) by live sequences."""

    @property
    def page_size(self) -> int:
        """Tokens per page (the unit of publishing)."""


@dataclass(slots=True)
class ContiguousPool:
    """Token-slot reservation of prompt + max_new_tokens per sequence, no fragmentation
    counted (which favours this policy)."""

    budget_tokens: int
    max_new_tokens: int
    tokens_per_page: int  # only to express reservations in pages
    reserved: int = 0
    _of: dict[int, int] = field(default_factory=dict)

    def admit(self, rid: int, tokens: Sequence[int], num_running: int) -> int | None:
        need = len(tokens) + self.max_new_tokens
        if self.reserved + need > self.budget_tokens:
            return None
        self._of[rid] = need
        self.reserved += need
        return 0

    def grow(self, rid: int) -> bool:
        return True  # the reservation covers the whole output

    def release(self, rid: int) -> None:
        self.reserved -= self._of.pop(rid)

    def publish(self, rid: int, tokens: Sequence[int]) -> None:
        pass  # no prefix cache

    def fork(self, parent: int, child: int) -> None:
        raise BadRequest("the contiguous policy cannot fork")

    def failed_allocations(self) -> int:
        return 0  # a reservation is checked and made in one step

    def held(self) -> tuple[int, int]:
        return self.reserved, cdiv(self.reserved, self.tokens_per_page)

    @property
    def page_size(self) -> int:
        return self.tokens_per_page


class PageCache(Protocol):
    """The calls PagedPool makes: the Manager's (kvcore.bench.ops also drives its
    minimal baseline through them). Results that PagedPool ignores are ``object``."""

    @property
    def layout(self) -> KVLayout: ...

    def lookup(self, tokens: Sequence[int]) -> PrefixHit: ...

    def allocate(self, seq_id: int, tokens: Sequence[int]) -> Allocation: ...

    def extend(self, seq_id: int, num_tokens: int) -> object: ...

    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int: ...

    def free(self, seq_id: int) -> None: ...

    def fork(self, parent_id: int, child_id: int) -> object: ...

    def stats(self) -> Stats: ...


@dataclass(slots=True)
class PagedPool:
    """A Manager (or any :class:`PageCache`); with ``prefix`` the admission looks up
    and publishing commits, sending only the tokens from the first page not yet
    committed (``commit(..., start=)``)."""

    manager: PageCache
    prefix: bool
    watermark_pages: int
    failed: int = 0  # allocate calls that failed after the admission check said they fit
    _committed: dict[int, int] = field(default_factory=dict)  # rid -> committed pages

    def admit(self, rid: int, tokens: Sequence[int], num_running: int) -> int | None:
        mgr = self.manager
        hit = mgr.lookup(tokens) if self.prefix else PrefixHit(0, 0)
        need = mgr.layout.pages_for(len(tokens)) - hit.num_cached_tokens // mgr.layout.page_size
        stats = mgr.stats()
        # Pinning the hit's evictable pages takes them out of what allocate may evict.
        spare = stats.free_pages + stats.evictable_pages - hit.num_evictable_pages - need
        if spare < 0 or (num_running > 0 and spare < self.watermark_pages):
            return None
        try:
            cached = mgr.allocate(rid, tokens).num_cached_tokens
        except OutOfPages:  # the check above was wrong: counted, never expected
            self.failed += 1
            return None
        self._committed[rid] = cached // mgr.layout.page_size
        return cached

    def grow(self, rid: int) -> bool:
        try:
            self.manager.extend(rid, 1)
        except OutOfPages:
            return False
        return True

    def release(self, rid: int) -> None:
        self.manager.free(rid)
        self._committed.pop(rid, None)

    def publish(self, rid: int, tokens: Sequence[int]) -> None:
        if self.prefix:
            start = self._committed[rid] * self.manager.layout.page_size
            self._committed[rid] = self.manager.commit(rid, tokens[start:], start=start)

    def fork(self, parent: int, child: int) -> None:
        self.manager.fork(parent, child)
        self._committed[child] = self._committed[parent]

    def failed_allocations(self) -> int:
        return self.failed

    def held(self) -> tuple[int, int]:
        pages = self.manager.stats().held_pages
        return pages * self.manager.layout.page_size, pages

    @property
    def page_size(self) -> int:
        return self.manager.layout.page_size


@dataclass(slots=True)
class _Live:
    req: Request
    generated: int = 0  # output tokens produced so far; the pool holds prompt + generated - 1


@dataclass(slots=True)
class RunStats:
    """Figures of one replay. Sums over steps; ``sat`` = steps with a request waiting
    after admission (memory, not demand, bounded the batch)."""

    steps: int = 0
    sat_steps: int = 0
    sum_running: int = 0
    sum_running_sat: int = 0
    peak_running: int = 0
    sum_stored: int = 0  # tokens the live sequences hold (logical, per sequence)
    sum_reserved: int = 0  # token slots reserved (contiguous) or in held pages
    sum_pages: int = 0
    sum_pages_sat: int = 0
    preemptions: int = 0
    recompute_tokens: int = 0  # prefill tokens computed again after a preemption
    generated_tokens: int = 0
    finished: int = 0
    failed_allocations: int = 0  # admissions accepted whose allocate then failed
    first_admitted: dict[int, int] = field(default_factory=dict)  # rid -> step
    first_hit_tokens: dict[int, int] = field(default_factory=dict)  # rid -> cached tokens

    def summary(self) -> dict[str, Any]:
        """Means over saturated steps (None if there were none) and over all steps."""
        sat = self.sat_steps or None
        return {
            "mean_concurrency": self.sum_running_sat / sat if sat else None,
            "mean_concurrency_all_steps": self.sum_running / max(self.steps, 1),
            "peak_concurrency": self.peak_running,
            "utilization": self.sum_stored / self.sum_reserved if self.sum_reserved else 0.0,
            "mean_pages_held": self.sum_pages_sat / sat if sat else None,
            "mean_pages_held_all_steps": self.sum_pages / max(self.steps, 1),
            "pages_per_sequence": self.sum_pages_sat / self.sum_running_sat if sat else None,
            "steps": self.steps,
            "saturated_steps": self.sat_steps,
            "tokens_per_step": self.generated_tokens / max(self.steps, 1),
            "preemptions": self.preemptions,
            "recompute_tokens": self.recompute_tokens,
            "finished": self.finished,
            "failed_allocations": self.failed_allocations,
        }


def simulate(
    trace: Trace,
    pool: Pool,
    *,
    fork_every: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> RunStats:
    """Replay ``trace`` on ``pool`` until every request has finished (module docstring).

    ``fork_every`` > 0 forks every such-numbered request right after its first
    prefill into a second sample (ops benchmark only; child id = rid + number of
    requests, output tokens shifted by one). ``on_step(step)`` runs after each step.
    BadRequest if a request does not fit even the empty pool (see
    :func:`kvcore.bench.capacity.check_fits`).
    """
    pending = deque(trace.requests)
    replay = _Replay(pool, len(trace.requests), trace.config.vocab_size, fork_every)
    step = 0
    while pending or replay.waiting or replay.running:
        while pending and pending[0].arrival_step <= step:
            replay.waiting.append(_Live(pending.popleft()))
        preempted = replay.decode()
        fresh = set() if preempted else replay.admit(step)
        if not replay.running and replay.waiting and not preempted:
            raise BadRequest(
                f"request {replay.waiting[0].req.rid} does not fit the empty pool; "
                "it would wait forever"
            )
        _record(replay.stats, pool, replay.running, replay.waiting)
        replay.run_batch(fresh)
        if on_step is not None:
            on_step(step)
        step += 1
    replay.stats.failed_allocations = pool.failed_allocations()
    return replay.stats


@dataclass(slots=True)
class _Replay:
    """The state of one :func:`simulate` run between steps: the queues, in order
    (``running`` oldest first, ``waiting`` from its head), and the figures so far.
    Request ids below ``num_requests`` are the trace's; forked samples are above."""

    pool: Pool
    num_requests: int
    vocab: int
    fork_every: int
    stats: RunStats = field(default_factory=RunStats)
    waiting: deque[_Live] = field(default_factory=deque)
    running: list[_Live] = field(default_factory=list)

    def decode(self) -> bool:
        """Step 2: grow every running sequence by one token, oldest first, preempting
        the newest while the pool has no room. True iff any was preempted."""
        running, pool = self.running, self.pool
        preempted = False
        i = 0
        while i < len(running):
            if pool.grow(running[i].req.rid):
                i += 1
                continue
            victim = running.pop()
            pool.release(victim.req.rid)
            self.waiting.appendleft(victim)
            self.stats.preemptions += 1
            preempted = True
        return preempted

    def admit(self, step: int) -> set[int]:
        """Step 3: admit from the queue head while it fits (forking the first prefill
        of every ``fork_every``-th request); the ids admitted, forks included."""
        stats, n = self.stats, self.num_requests
        fresh: set[int] = set()
        while self.waiting:
            live = self.waiting[0]
            tokens = live.req.prompt + live.req.output[: live.generated]
            cached = self.pool.admit(live.req.rid, tokens, len(self.running))
            if cached is None:
                break
            self.waiting.popleft()
            self.running.append(live)
            fresh.add(live.req.rid)
            if live.generated:
                stats.recompute_tokens += len(tokens) - cached
            elif live.req.rid < n:
                stats.first_admitted[live.req.rid] = step
                stats.first_hit_tokens[live.req.rid] = cached
                if self.fork_every and live.req.rid % self.fork_every == 0:
                    child = _fork_request(live.req, n, self.vocab)
                    self.pool.fork(live.req.rid, child.rid)
                    self.running.append(_Live(child))
                    fresh.add(child.rid)
        return fresh

    def run_batch(self, fresh: set[int]) -> None:
        """Step 4: each running sequence produces a token; the ones admitted this step
        (``fresh``) and the ones whose last page just filled are published; finished
        ones are released."""
        pool, stats = self.pool, self.stats
        page_size = pool.page_size
        still: list[_Live] = []
        for live in self.running:
            live.generated += 1
            stats.generated_tokens += 1
            held = len(live.req.prompt) + live.generated - 1
            if live.req.rid in fresh or held % page_size == 0:
                pool.publish(live.req.rid, live.req.prompt + live.req.output[: live.generated - 1])
            if live.generated == len(live.req.output):
                pool.release(live.req.rid)
                stats.finished += 1
            else:
                still.append(live)
        self.running = still


def _fork_request(req: Request, offset: int, vocab: int) -> Request:
    output = tuple((t + 1) % vocab for t in req.output)
    return Request(req.rid + offset, req.arrival_step, req.prompt, output, req.prefix_id)


def _record(stats: RunStats, pool: Pool, running: list[_Live], waiting: deque[_Live]) -> None:
    count = len(running)
    reserved, pages = pool.held()
    stats.steps += 1
    stats.sum_running += count
    stats.peak_running = max(stats.peak_running, count)
    stats.sum_stored += sum(len(live.req.prompt) + live.generated for live in running)
    stats.sum_reserved += reserved
    stats.sum_pages += pages
    if waiting:
        stats.sat_steps += 1
        stats.sum_running_sat += count
        stats.sum_pages_sat += pages
