"""The connector's scheduler side: one daemon sequence per vLLM request.

Life of a request (pages of ``page_size`` tokens = vLLM blocks)::

    tokens    | hit pages (pinned)  | pages to save (prompt, then generated) | partial |
              0                   hit                                     full       n
    ask       allocate(seq, tokens) is sent; the answer (hit pages, pinned) is
              waited for at most ask_wait_ms, else vLLM is told "not yet" (None)
              and asks again next pass
    load      hit pages -> vLLM blocks, in the step vLLM schedules it (StepPlan.load_*)
    save      full pages [hit, ...) -> kvcore pages, in the step that computes them;
              generated pages too (``save_generated``), the sequence extended ahead
    commit    after the worker reports the copy done (StepReport)
    release   free(seq) once the request finished and no copy of it is in flight

The scheduler does not wait for the daemon: every call goes through a
:class:`~.link.DaemonLink` (one I/O thread, one batch per round trip) and its
answers are taken at the next hook. The one bounded exception: the answer about
a new request is waited for at most ``ask_wait_ms`` (default 2 ms; 0: never),
which an idle daemon gives in under a millisecond; once one is late, the rest of
that pass waits for none. A request whose answer is late waits for the next pass
(vLLM skips it meanwhile), never anyone else's.

Invariants: every page number in a StepPlan belongs to a sequence this session
holds (so nobody else writes or evicts it while the copy runs); a page is
committed only after the worker reported it saved; ``confirmed <= scheduled``
(pages), both counted from the first page; a page is saved only once the
sequence holds its tokens (``capacity``).

vLLM's contract: ``get_num_new_matched_tokens`` may be asked many times. A
request answered and then not scheduled keeps its pin for at most
:data:`HOLD_PASSES` scheduling passes (vLLM usually schedules it in the next one:
it waited for memory or a batch slot), then it is freed and asked afresh; a
request aborted while waiting is freed at ``request_finished``.

Identity: a request's ``cache_salt`` and LoRA adapter select its key space on the
daemon (spec/hashing.md), so different salts or adapters never share a page.
Requests kvcore cannot key (multimodal inputs, prompt embeddings: their tokens do
not say what the K/V holds) get 0 matched tokens and save nothing.

Roles: ``kv_producer`` saves and never loads, ``kv_consumer`` loads and never
saves, ``kv_both`` (the default) does both. A producer's finished request is
returned only once its commits are on the daemon (the link waited for them, at
most ``timeout_s``): the consumer asked next finds them. That is the one wait.

Failures never fail vLLM: a refused allocation (a quota, a forbidden namespace,
a prompt over ``max_request_tokens``) makes its request run without kvcore; out
of pages is a miss; the daemon gone makes every request a miss for ``retry_s``
(:mod:`.link`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcore.errors import LayoutMismatch
from kvcore.integrations.vllm.link import (
    Allocate,
    Commit,
    DaemonLink,
    Done,
    Extend,
    Free,
)
from kvcore.integrations.vllm.metadata import ConnectorConfig, KvcoreStats, StepPlan, StepReport
from kvcore.results import Allocation, Extension

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

HOLD_PASSES = 8  # scheduling passes an answered, unscheduled request keeps its pin
EXTEND_PAGES = 4  # pages a sequence grows by at a time for generated tokens


@dataclass(slots=True)
class _Tracked:
    """One request with a daemon sequence. Changed only by the scheduler side."""

    seq: int
    request: Request  # vLLM's live object (num_computed_tokens, all_token_ids)
    pages: list[int]  # the sequence's block table in the pool
    capacity: int  # tokens the sequence holds on the daemon: pages below it may be saved
    limit: int  # tokens: pages below it may be saved (prompt pages, or all)
    hit: int  # pages kvcore held at allocate (pinned by the sequence)
    confirmed: int  # leading pages kvcore holds now: hit, then reported saves
    scheduled: int  # leading pages that are held or have a save in a sent plan
    in_flight: int = 0  # sent plans with a copy of this request, not yet reported
    extending: int = 0  # tokens of the extend on its way (0: none)
    finished: bool = False


@dataclass(frozen=True, slots=True)
class _Asked:
    """A request whose allocation of its first ``num_tokens`` tokens is on the way."""

    seq: int
    request: Request
    num_tokens: int


def identity(request: Request) -> tuple[str, str] | None:
    """The request's key space on the daemon, ``(salt, lora)``; None if its tokens do
    not determine its K/V (multimodal inputs, prompt embeddings)."""
    if getattr(request, "prompt_embeds", None) is not None or getattr(request, "mm_features", None):
        return None
    lora = getattr(request, "lora_request", None)
    return getattr(request, "cache_salt", None) or "", lora.lora_name if lora is not None else ""


def _tokens(request: Request) -> list[int]:
    """Every token of the request so far (prompt, then generated)."""
    tokens: Any = getattr(request, "all_token_ids", None)
    return list(tokens if tokens is not None else request.prompt_token_ids or ())


class SchedulerSide:
    """Scheduler half of :class:`~kvcore.integrations.vllm.KvcoreConnector`."""

    def __init__(self, config: ConnectorConfig, block_size: int, role: str = "kv_both") -> None:
        from kvcore.integrations.vllm.worker import attach

        self.config = config
        client = attach(config, map_memory=False)
        self.page_size = client.layout.page_size
        if block_size != self.page_size:
            client.close()
            raise LayoutMismatch(
                f"vLLM's block_size is {block_size}, pool {config.pool!r} has page_size "
                f"{self.page_size}: run vLLM with --block-size {self.page_size} or the daemon "
                f"with a pool of page_size={block_size}"
            )
        self.link = DaemonLink(client, retry_s=config.retry_s, timeout_s=config.timeout_s)
        self.loads = role != "kv_producer"
        self.saves = role != "kv_consumer"
        self.stats = KvcoreStats()
        self._tracked: dict[str, _Tracked] = {}
        self._asked: dict[str, _Asked] = {}  # requests whose allocation is on the way
        self._misses: set[str] = set()  # allocation failed: answer 0 once
        self._loads: list[tuple[int, int]] = []  # (pool page, vLLM block) for the next plan
        self._load_requests: set[str] = set()
        self._unscheduled: dict[str, int] = {}  # answered, not scheduled: passes since
        self._without: set[str] = set()  # requests the daemon refused: run without kvcore
        self._pass_late = False  # an answer came late in this pass: wait for no more
        self._step = 0
        self.preemptions = 0  # requests vLLM preempted (for tests and logs)
        self.kv_cache_manager: KVCacheManager | None = None

    @property
    def epoch(self) -> int:
        return self.link.client.epoch

    # -- vLLM's scheduler hooks ---------------------------------------------------------

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own hit, block aligned) that
        kvcore holds and pins for this request; None while its allocation is on the
        way past ``ask_wait_ms`` (vLLM asks again next pass)."""
        self._absorb()
        req_id = request.request_id
        tracked = self._tracked.get(req_id)
        if tracked is None:
            if req_id not in self._asked:
                if req_id in self._misses:
                    self._misses.discard(req_id)
                    return 0
                if self._covered(request, num_computed_tokens) or not self._allocate(request):
                    return 0
            tracked = self._wait_for(req_id)
            if tracked is None:
                if req_id in self._asked:
                    return None  # asked again next pass
                self._misses.discard(req_id)
                return 0  # refused, or a miss
        self._unscheduled.setdefault(req_id, 0)
        if not self.loads:
            return 0
        held = min(tracked.confirmed * self.page_size, self._loadable(request))
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
        self._unscheduled.pop(request.request_id, None)
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
        """This step's loads and saves; frees what vLLM kept waiting too long."""
        self._absorb()
        self._pass_late = False  # the pass is over: the next one may wait again
        for req_id in list(self._unscheduled):
            self._unscheduled[req_id] += 1
            if self._unscheduled[req_id] > HOLD_PASSES:
                del self._unscheduled[req_id]
                self._release(req_id)
        self._step += 1
        plan = StepPlan(step=self._step, epoch=self.epoch)
        plan.load_pages = [p for p, _ in self._loads]
        plan.load_blocks = [b for _, b in self._loads]
        touched = set(self._load_requests)
        self._loads, self._load_requests = [], set()
        for req_id, n in output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.finished:
                continue
            computed = tracked.request.num_computed_tokens + n
            self._grow(req_id, tracked, computed)
            upto = min(tracked.limit, computed, tracked.capacity) // self.page_size
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
        self._absorb()
        for req_id, upto in report.saved.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or upto <= tracked.confirmed:
                continue
            start = tracked.confirmed * self.page_size
            tokens = _tokens(tracked.request)[start : upto * self.page_size]
            if len(tokens) < (upto - tracked.confirmed) * self.page_size:
                continue  # not every token of the pages is known yet: commit later
            self.link.send(Commit(tracked.seq, tokens, start))
            tracked.confirmed = upto
        finished_commits = False
        for req_id in report.requests:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            tracked.in_flight = max(0, tracked.in_flight - 1)  # < 0: a plan before a reconnect
            if tracked.finished and tracked.in_flight == 0:
                finished_commits |= tracked.confirmed > tracked.hit
                self._release(req_id)
        if finished_commits and not self.loads:
            # a producer's answer means its pages are in kvcore (the consumer asks next)
            self.link.wait_idle(self.config.timeout_s)
        else:
            time.sleep(0)  # hand the link's thread the GIL: the commits go out now

    def on_preempted(self, req_id: str) -> None:
        """vLLM dropped the request's blocks: saves planned but not reported restart
        from what kvcore holds (the next plan saves again from the new blocks)."""
        self.preemptions += 1
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            tracked.scheduled = tracked.confirmed

    def finished(self, request: Request) -> None:
        """The request finished or was aborted: release it once no copy is in flight."""
        req_id = request.request_id
        self._without.discard(req_id)
        self._misses.discard(req_id)
        self._unscheduled.pop(req_id, None)
        self._asked.pop(req_id, None)  # its allocation, when it arrives, is freed
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return
        tracked.finished = True
        if tracked.in_flight == 0:
            self._release(req_id)

    def _wait_for(self, req_id: str) -> _Tracked | None:
        """The request's sequence if its answer comes within ``ask_wait_ms`` (an idle
        daemon answers in under a millisecond: waiting here saves the request a
        pass); None otherwise. Once an answer was late in a pass, the rest of the pass
        does not wait (the daemon is busy: its answers come with the next pass)."""
        if not self._pass_late:
            deadline = time.monotonic() + self.config.ask_wait_ms / 1e3
            while req_id in self._asked and (left := deadline - time.monotonic()) > 0:
                self.link.wait_answer(left)
                self._absorb()
            self._pass_late = req_id in self._asked
        self._absorb()
        return self._tracked.get(req_id)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every call sent so far was answered, and take the answers."""
        idle = self.link.wait_idle(timeout_s)
        self._absorb()
        return idle

    def close(self) -> None:
        self._absorb()
        for req_id in list(self._tracked):
            self._release(req_id)
        self.link.close()

    # -- internals -----------------------------------------------------------------------

    def _allocate(self, request: Request) -> bool:
        """Send the request's allocation; False if it runs without kvcore."""
        key_space = identity(request)
        tokens = _tokens(request)
        if (
            key_space is None
            or len(tokens) < 2
            or request.request_id in self._without
            or self.link.quiet()
        ):
            return False
        seq = random.getrandbits(63) or 1
        self._asked[request.request_id] = _Asked(seq, request, len(tokens))
        self.link.send(Allocate(request.request_id, seq, tokens, *key_space))
        return True

    def _absorb(self) -> None:
        """Take the link's answers: sequences arrive, grow, or were refused."""
        for done in self.link.take():
            if done.kind == "reconnected":  # the old sequences died with the old session
                self._tracked.clear()
                self._asked.clear()
                self._unscheduled.clear()
            elif done.kind == "allocated":
                assert isinstance(done.result, Allocation)
                self._allocated(done, done.result)
            elif done.kind == "extended":
                assert isinstance(done.result, Extension)
                self._extended(done, done.result)
            elif self._asked_seq(done.req_id) == done.seq:  # a failed or refused allocation
                del self._asked[done.req_id]
                (self._misses if done.kind == "failed" else self._without).add(done.req_id)
            elif (tracked := self._tracked.get(done.req_id)) and tracked.seq == done.seq:
                tracked.limit = min(tracked.limit, tracked.capacity)  # no room to grow
                tracked.extending = 0

    def _allocated(self, done: Done, alloc: Allocation) -> None:
        if self._asked_seq(done.req_id) != done.seq:  # finished while asked, or stale
            self.link.send(Free(done.seq))
            return
        asked = self._asked.pop(done.req_id)
        request = asked.request
        hit = alloc.num_cached_tokens // self.page_size
        self._tracked[done.req_id] = _Tracked(
            done.seq,
            request,
            list(alloc.pages),
            asked.num_tokens,
            self._limit(request),
            hit,
            hit,
            hit,
        )
        self._unscheduled.setdefault(done.req_id, 0)

    def _limit(self, request: Request) -> int:
        """Tokens, a whole number of pages: the pages below it are the most this request
        may save (its prompt's, or every page its ``max_tokens`` can fill)."""
        prompt = len(request.prompt_token_ids or ())
        limit = 0
        if self.saves and self.config.save_generated:  # the last token sampled has no K/V
            limit = prompt + (getattr(request, "max_tokens", None) or 1 << 40) - 1
        elif self.saves:
            limit = prompt
        return limit // self.page_size * self.page_size

    def _covered(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether vLLM's own hit already holds every page kvcore could load into this
        request or save from it: then the daemon is not asked at all."""
        loadable = self._loadable(request) if self.loads else 0
        return num_computed_tokens >= max(loadable, self._limit(request))

    def _loadable(self, request: Request) -> int:
        """Tokens, a whole number of pages: the most a hit may cover (never the last
        token, whose forward produces the next one)."""
        return (len(_tokens(request)) - 1) // self.page_size * self.page_size

    def _extended(self, done: Done, ext: Extension) -> None:
        tracked = self._tracked.get(done.req_id)
        if tracked is None or tracked.seq != done.seq:
            return  # released meanwhile (its free follows the extend)
        for src, dst in ext.copies:  # a copy-on-write of the (partial, unsaved) last page
            tracked.pages[tracked.pages.index(src)] = dst
        tracked.pages += ext.new_pages
        tracked.capacity += tracked.extending
        tracked.extending = 0

    def _grow(self, req_id: str, tracked: _Tracked, computed: int) -> None:
        """Extend the sequence ahead of the generated tokens it will save: when the
        step's tokens come within a page of its end, by :data:`EXTEND_PAGES` pages at
        most (no further than ``limit``: the pages its ``max_tokens`` can fill)."""
        if tracked.extending or tracked.limit <= tracked.capacity:
            return
        if computed + self.page_size > tracked.capacity:
            tracked.extending = min(EXTEND_PAGES * self.page_size, tracked.limit - tracked.capacity)
            self.link.send(Extend(req_id, tracked.seq, tracked.extending))

    def _asked_seq(self, req_id: str) -> int:
        asked = self._asked.get(req_id)
        return asked.seq if asked is not None else 0

    def _release(self, req_id: str) -> None:
        tracked = self._tracked.pop(req_id)
        self._unscheduled.pop(req_id, None)
        self.link.send(Free(tracked.seq))
