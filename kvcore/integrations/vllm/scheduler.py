"""The connector's scheduler side: one daemon sequence per vLLM request.

Life of a request (pages of ``page_size`` tokens = vLLM blocks)::

    prompt    | hit pages (pinned)  | pages to save              | last page (partial) |
              0                   hit                          full                 n tokens
    lookup    allocate(seq, prompt): the hit is pinned and never covers the last token
    load      hit pages -> vLLM blocks, in the first step (StepPlan.load_*)
    save      pages [hit, full) -> kvcore pages, in the step that computes them
    commit    after the worker reports the copy done (StepReport), batched per step
    release   free(seq) once the request finished and no copy of it is in flight

Invariants: every page number in a StepPlan belongs to a sequence this session
holds (so nobody else writes or evicts it while the copy runs); a page is
committed only after the worker reported it saved; ``confirmed <= scheduled``
(pages), both counted from the first page.

Round trips: one ``allocate`` per request (when vLLM first asks), and one batch
per step for everything queued (commits and frees), sent after the step's output
is processed (``take_events``) or before the next step (``build_connector_meta``).
A failed call never fails vLLM: the request is a miss (nothing loaded, nothing
saved), and for ``retry_s`` seconds (doubled after each failure in a row, up to
a minute) the scheduler does not ask the daemon; then it attaches again.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcore.client import Batch
from kvcore.errors import KVCoreError, OutOfPages
from kvcore.integrations.vllm.metadata import ConnectorConfig, KvcoreStats, StepPlan, StepReport

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvcore.vllm")
MAX_RETRY_S = 60.0  # the longest quiet period after failures in a row


@dataclass(frozen=True, slots=True)
class _Commit:
    """Publish ``tokens`` (from token ``start``, a page boundary) of sequence ``seq``."""

    seq: int
    tokens: list[int]
    start: int


@dataclass(frozen=True, slots=True)
class _Free:
    seq: int


def _queue(ops: Batch, queued: list[_Commit | _Free]) -> None:
    """Queue the pending commits and frees on a batch, in order."""
    for op in queued:
        if isinstance(op, _Commit):
            ops.commit(op.seq, op.tokens, start=op.start)
        else:
            ops.free(op.seq)


@dataclass(slots=True)
class _Tracked:
    """One request with a daemon sequence. Changed only by the scheduler side."""

    seq: int
    request: Request  # vLLM's live object (num_computed_tokens, status)
    pages: list[int]  # the sequence's block table in the pool
    full: int  # full prompt pages: the most this request saves
    hit: int  # pages kvcore held at allocate (pinned by the sequence)
    confirmed: int  # leading pages kvcore holds now: hit, then reported saves
    scheduled: int  # leading pages that are held or have a save in a sent plan
    in_flight: int = 0  # sent plans with a copy of this request, not yet reported
    finished: bool = False


class SchedulerSide:
    """Scheduler half of :class:`~kvcore.integrations.vllm.KvcoreConnector`."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        from kvcore.integrations.vllm.worker import attach

        self.config = config
        self.client = attach(config, map_memory=False)
        self.page_size = self.client.layout.page_size
        if block_size != self.page_size:
            from kvcore.errors import LayoutMismatch

            raise LayoutMismatch(
                f"vLLM's block_size is {block_size}, pool {config.pool!r} has page_size "
                f"{self.page_size}: run vLLM with --block-size {self.page_size} or the daemon "
                f"with a pool of page_size={block_size}"
            )
        self.stats = KvcoreStats()
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[tuple[int, int]] = []  # (pool page, vLLM block) for the next plan
        self._load_requests: set[str] = set()
        self._queued: list[_Commit | _Free] = []  # sent with the next round trip
        self._step = 0
        self.preemptions = 0  # requests vLLM preempted (for tests and logs)
        self._quiet_until = 0.0  # monotonic time before which the daemon is not asked
        self._stale = False  # a call failed: attach again before the next one
        self._retry_s = config.retry_s  # the next quiet period, seconds
        self.kv_cache_manager: KVCacheManager | None = None

    # -- vLLM's scheduler hooks ---------------------------------------------------------

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own hit, block aligned) that
        kvcore holds and pins for this request; the first call allocates."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._allocate(request)
            if tracked is None:
                return 0
        prompt = len(request.prompt_token_ids or ())
        held = min(tracked.confirmed, (prompt - 1) // self.page_size) * self.page_size
        return max(0, held - num_computed_tokens)

    def after_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
        num_computed_tokens: int,
    ) -> None:
        """Plan the load of the ``num_external_tokens`` after vLLM's own hit."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        first = num_computed_tokens // self.page_size
        last = first + num_external_tokens // self.page_size
        assert last <= tracked.confirmed, (first, last, tracked.confirmed)
        (block_ids,) = blocks.get_block_ids()[:1]
        self._loads += [(tracked.pages[i], block_ids[i]) for i in range(first, last)]
        self._load_requests.add(request.request_id)
        self.stats.add("external_hit_tokens", num_external_tokens)

    def build_plan(self, output: SchedulerOutput) -> StepPlan:
        """This step's loads and saves; sends what is queued first."""
        self.flush()
        self._step += 1
        plan = StepPlan(step=self._step, epoch=self.client.epoch)
        plan.load_pages = [p for p, _ in self._loads]
        plan.load_blocks = [b for _, b in self._loads]
        touched = set(self._load_requests)
        self._loads, self._load_requests = [], set()
        for req_id, n in output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.finished:
                continue
            computed = tracked.request.num_computed_tokens + n
            upto = min(tracked.full, computed // self.page_size)
            if upto <= tracked.scheduled:
                continue
            assert self.kv_cache_manager is not None, "bind_kv_cache_manager was not called"
            (block_ids,) = self.kv_cache_manager.get_block_ids(req_id)[:1]
            for i in range(tracked.scheduled, upto):
                plan.save_blocks.append(block_ids[i])
                plan.save_pages.append(tracked.pages[i])
            tracked.scheduled = plan.saved[req_id] = upto
            touched.add(req_id)
        for req_id in touched:
            self._tracked[req_id].in_flight += 1
        plan.requests = sorted(touched)
        return plan

    def on_report(self, report: StepReport) -> None:
        """The worker finished steps: commit what it saved, release finished requests."""
        for req_id, upto in report.saved.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or upto <= tracked.confirmed:
                continue
            start = tracked.confirmed * self.page_size
            tokens = list(tracked.request.prompt_token_ids or ())[start : upto * self.page_size]
            self._queued.append(_Commit(tracked.seq, tokens, start))
            tracked.confirmed = upto
        for req_id in report.requests:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            tracked.in_flight -= 1
            if tracked.in_flight < 0:  # a report of a plan sent before a reconnect
                tracked.in_flight = 0
            if tracked.finished and tracked.in_flight == 0:
                self._release(req_id)

    def on_preempted(self, req_id: str) -> None:
        """vLLM dropped the request's blocks: saves planned but not reported restart
        from what kvcore holds (the next plan saves again from the new blocks)."""
        self.preemptions += 1
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            tracked.scheduled = tracked.confirmed

    def finished(self, request: Request) -> None:
        """The request finished or was aborted: release it once no copy is in flight."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.finished = True
        if tracked.in_flight == 0:
            self._release(request.request_id)
            if request.is_finished() and str(request.status).endswith("ABORTED"):
                self.flush()  # an abort comes between steps: no later step may flush it

    def flush(self) -> None:
        """Send the queued commits and frees in one round trip (nothing if none)."""
        queued, self._queued = self._queued, []
        if not queued or not self._ask():
            return
        try:
            with self.client.batch() as ops:
                _queue(ops, queued)
        except KVCoreError as exc:
            self._failed("commit/free", exc)

    def close(self) -> None:
        for req_id in list(self._tracked):
            self._release(req_id)
        self.flush()
        self.client.close()

    # -- internals -----------------------------------------------------------------------

    def _allocate(self, request: Request) -> _Tracked | None:
        prompt = list(request.prompt_token_ids or ())
        if len(prompt) < 2 or not self._ask():
            return None
        seq = random.getrandbits(63) or 1
        queued, self._queued = self._queued, []
        try:
            with self.client.batch() as ops:  # what is queued rides along: one round trip
                _queue(ops, queued)
                ops.allocate(seq, prompt)
            alloc = ops.results[-1]
        except KVCoreError as exc:
            self._failed(f"allocate of {request.request_id}", exc)
            return None
        hit = alloc.num_cached_tokens // self.page_size
        full = len(prompt) // self.page_size
        tracked = _Tracked(seq, request, list(alloc.pages), full, hit, confirmed=hit, scheduled=hit)
        self._tracked[request.request_id] = tracked
        return tracked

    def _release(self, req_id: str) -> None:
        tracked = self._tracked.pop(req_id)
        self._queued.append(_Free(tracked.seq))

    def _ask(self) -> bool:
        """Whether to call the daemon now; after a failure, first attach again."""
        if time.monotonic() < self._quiet_until:
            return False
        if self._stale:
            try:
                self.client.reconnect()
            except KVCoreError as exc:
                self._failed("attach", exc)
                return False
            self._stale = False
            self._retry_s = self.config.retry_s
            self._tracked.clear()  # the old sequences died with the old session
            self._queued.clear()
        return True

    def _failed(self, what: str, exc: KVCoreError) -> None:
        """A failed call. Out of pages: this request is a miss. The daemon silent, gone
        or restarted: vLLM goes on without kvcore for ``retry_s`` seconds, then attaches
        again (a restarted daemon has a new epoch and an empty pool)."""
        if isinstance(exc, OutOfPages):
            log.info("kvcore: %s: %s", what, exc)
            return
        self._quiet_until = time.monotonic() + self._retry_s
        self._stale = True
        log.warning(
            "kvcore: %s failed (%s: %s); treating requests as misses for %.0f s",
            what,
            type(exc).__name__,
            exc,
            self._retry_s,
        )
        self._retry_s = min(2 * self._retry_s, MAX_RETRY_S)  # each failure in a row doubles it
