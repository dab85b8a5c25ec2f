"""The connector's scheduler side: one daemon sequence per vLLM request.

Life of a request (pages of ``page_size`` tokens = vLLM blocks)::

    prompt    | hit pages (pinned)  | pages to save              | last page (partial) |
              0                   hit                          full                 n tokens
    lookup    allocate(seq, prompt): the hit is pinned and never covers the last token;
              released again when vLLM does not schedule the request in that step
    load      hit pages -> vLLM blocks, in the first step (StepPlan.load_*)
    save      pages [hit, full) -> kvcore pages, in the step that computes them
    commit    after the worker reports the copy done (StepReport), batched per step
    release   free(seq) once the request finished and no copy of it is in flight

Invariants: every page number in a StepPlan belongs to a sequence this session
holds (so nobody else writes or evicts it while the copy runs); a page is
committed only after the worker reported it saved; ``confirmed <= scheduled``
(pages), both counted from the first page.

vLLM's contract: ``get_num_new_matched_tokens`` may be asked many times and
is to leave nothing behind. The allocate it makes (one round trip: the answer and
the pin together, so a hit cannot be evicted between the two) belongs to that
scheduling pass only: a request vLLM asked about and did not schedule
(``update_state_after_alloc`` not called for it) is freed in the same step's
``build_connector_meta``, and asked afresh next step.

Round trips: one ``allocate`` per request per scheduling pass that asks about it,
and one batch for everything queued (commits and frees) at each point where vLLM
hands a step or a request over: ``build_connector_meta`` (once per step, before
the step runs), ``update_connector_output`` (the worker's report of finished
copies) and ``request_finished`` (its free; an engine may go idle after it).

Failures never fail vLLM. Out of pages: the request is a miss this pass (asked
again, it allocates again). A refusal that is the request's own (any other error
not in :data:`DAEMON_GONE`: a quota, a forbidden namespace, a prompt over
``max_request_tokens``): that request runs without kvcore (asked again, it is not
sent again), logged once per error code at WARNING. The daemon gone
(:data:`DAEMON_GONE`: no answer, a restart, a lost lease): every request is a miss
and for ``retry_s`` seconds (doubled after each failure in a row, up to a minute)
the scheduler does not ask the daemon; then it attaches again.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcore.client import Batch
from kvcore.errors import (
    BatchFailed,
    KVCoreError,
    LeaseLost,
    NotAttached,
    OutOfPages,
    StaleEpoch,
    Timeout,
)
from kvcore.integrations.vllm.metadata import ConnectorConfig, KvcoreStats, StepPlan, StepReport

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvcore.vllm")
MAX_RETRY_S = 60.0  # the longest quiet period after failures in a row
DAEMON_GONE: tuple[type[KVCoreError], ...] = (Timeout, StaleEpoch, LeaseLost, NotAttached)
"""Failures that mean the daemon (or this session on it) is gone; any other
KVCoreError (OutOfPages, QuotaExceeded, Forbidden, BadRequest, ...) is one request's."""


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
        self._unscheduled: set[str] = set()  # allocated while asked, not (yet) scheduled
        self._without: set[str] = set()  # requests the daemon refused: run without kvcore
        self._warned: set[str] = set()  # error codes logged at WARNING once already
        self._step = 0
        self.preemptions = 0  # requests vLLM preempted (for tests and logs)
        self._quiet_until = 0.0  # monotonic time before which the daemon is not asked
        self._stale = False  # a call failed: attach again before the next one
        self._retry_s = config.retry_s  # the next quiet period, seconds
        self.kv_cache_manager: KVCacheManager | None = None

    # -- vLLM's scheduler hooks ---------------------------------------------------------

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own hit, block aligned) that
        kvcore holds and pins for this request. A request not tracked is allocated, for
        this scheduling pass only (``build_plan`` frees it unless vLLM scheduled it)."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            if request.request_id in self._without:
                return 0
            tracked = self._allocate(request)
            if tracked is None:
                return 0
            self._unscheduled.add(request.request_id)
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
        """vLLM scheduled the request: keep its sequence, and plan the load of the
        ``num_external_tokens`` after vLLM's own hit."""
        self._unscheduled.discard(request.request_id)
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
        """This step's loads and saves; frees what vLLM asked about and did not
        schedule, and sends what is queued first."""
        for req_id in self._unscheduled:
            self._release(req_id)
        self._unscheduled.clear()
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
        self.flush()  # the step's commits and frees, one round trip

    def on_preempted(self, req_id: str) -> None:
        """vLLM dropped the request's blocks: saves planned but not reported restart
        from what kvcore holds (the next plan saves again from the new blocks)."""
        self.preemptions += 1
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            tracked.scheduled = tracked.confirmed

    def finished(self, request: Request) -> None:
        """The request finished or was aborted: release it once no copy is in flight.
        The free goes out now: vLLM may run no further step (an abort comes between
        steps; the last request's finish may end the engine's loop)."""
        self._without.discard(request.request_id)
        self._unscheduled.discard(request.request_id)
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.finished = True
        if tracked.in_flight == 0:
            self._release(request.request_id)
            self.flush()

    def flush(self) -> None:
        """Send the queued commits and frees in one round trip (nothing if none). An op
        the daemon refuses is dropped (logged) and the ops after it are sent again; a
        whole batch refused (too many tokens for one request) goes op by op."""
        queued, self._queued = self._queued, []
        if not queued or not self._ask():
            return
        one_by_one = False
        while queued:
            sent = queued[:1] if one_by_one else queued
            try:
                with self.client.batch() as ops:
                    _queue(ops, sent)
                queued = queued[len(sent) :]
            except BatchFailed as exc:
                if not self._failed(type(sent[exc.batch_index]).__name__[1:].lower(), exc):
                    return
                queued = queued[exc.batch_index + 1 :]
            except KVCoreError as exc:
                if not self._failed("commit/free", exc):
                    return
                if one_by_one:
                    queued = queued[1:]
                one_by_one = True

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
        try:
            alloc = self.client.allocate(seq, prompt)
        except KVCoreError as exc:
            if self._failed(f"allocate of {request.request_id}", exc) and not isinstance(
                exc, OutOfPages
            ):
                self._without.add(request.request_id)  # it runs without kvcore
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
            self._unscheduled.clear()
        return True

    def _failed(self, what: str, exc: KVCoreError) -> bool:
        """A failed call; True if it was one request's (the daemon is fine). Out of
        pages: a miss, logged at INFO; any other refusal (quota, forbidden, too many
        tokens, ...): logged at WARNING once per error code. The daemon silent, gone
        or restarted (:data:`DAEMON_GONE`): vLLM goes on without kvcore for
        ``retry_s`` seconds, then attaches again (a restarted daemon has a new epoch
        and an empty pool)."""
        if not isinstance(exc, DAEMON_GONE):
            if isinstance(exc, OutOfPages):
                log.info("kvcore: %s: %s", what, exc)
            elif exc.code not in self._warned:
                self._warned.add(exc.code)
                log.warning(
                    "kvcore: %s refused (%s: %s); it runs without kvcore (logged "
                    "once per error code)",
                    what,
                    exc.code,
                    exc,
                )
            return True
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
        return False
