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

State: one :class:`~.records.RequestRecord` per request, its phase explicit
(asked, held, running, finished, missed, without kvcore; :mod:`.records`), kept by
a :class:`~.book.RequestBook` (:mod:`.book`: what the link's answers and the
worker's reports do to them). Every page number in a StepPlan belongs to a
sequence this session holds (so nobody else writes or evicts it while the copy
runs); a page is committed only after the worker reported it saved, and saved at
most once. :meth:`SchedulerSide.check_integrity` checks every invariant.

Sessions (:mod:`.session`): the records are those of one attachment (the daemon's
epoch and this session), whose life is one :class:`~.session.Session`, changed only
by the link's records, never read live from the client. ATTACHED: asks and plans go
on. Lost with the daemon alive (its lease ran out), it is DRAINING: nothing asked
or planned on it, while plans built before may still run in the worker on its
(fenced) pages; RETIRED once the worker reported them (:class:`~.link.Retire` sent:
the link may attach again). A loss or a re-attach drops every record at once
(queued loads become load errors: vLLM recomputes them); a plan carries the epoch
of the records it was built from, and a report counts only for the (epoch,
sequence) it was planned for.

vLLM's contract: ``get_num_new_matched_tokens`` may be asked many times. A
request answered and then not scheduled keeps its pin for at most
:data:`HOLD_PASSES` scheduling passes (vLLM usually schedules it in the next one:
it waited for memory or a batch slot), then it is freed and asked afresh; a
request aborted while waiting is freed at ``request_finished``.

Identity: the engine's model, a request's ``cache_salt`` and LoRA adapter (its
name and a digest of its files) select its key space on the daemon
(:class:`~.records.KeySpaces`, spec/hashing.md): no two of them share a page.
Requests kvcore cannot key (multimodal inputs, prompt embeddings: their tokens do
not say what the K/V holds) get 0 matched tokens and save nothing.

Roles: ``kv_producer`` saves and never loads, ``kv_consumer`` loads and never
saves, ``kv_both`` (the default) does both. A producer's finished request is
returned only once its commits are on the daemon (the link waited for them, at
most ``timeout_s``): the consumer asked next finds them. That is the one wait.

Hybrid models (several KV cache groups; docs/architecture.md, "Hybrid models"):
a page's block travels per group; a save stops for good at the first page some
group holds no block of (vLLM's null block: outside a sliding window), and loads
skip such blocks; a hybrid engine's loads are asynchronous in vLLM's terms (they
fail by request, :class:`~.metadata.StepPlan`). An engine with a group kvcore
cannot serve (Mamba state) is all misses.

Figures: vLLM's external hit of a request is split by the tier that supplied it
(:meth:`SchedulerSide.hit_sources`: the allocation's ``sources`` kept on its record,
:mod:`.sources`), and each request kvcore allocated is timed to its first token, with
and without a kvcore hit (:mod:`.first_tokens`); both go through vLLM's own metrics.

Failures never fail vLLM: a refused allocation (a quota, a forbidden namespace,
a prompt over ``max_request_tokens``) makes its request run without kvcore; so does
an answer that does not fit what was asked (:meth:`~.records.RequestRecord.fits`,
logged); out of pages is a miss; the daemon gone, or this session lost, makes every
request a miss until the link attaches again (:mod:`kvcore.integrations.reconnect`).
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from kvcore.errors import LayoutMismatch
from kvcore.integrations.reconnect import Attachment
from kvcore.integrations.vllm.book import RequestBook
from kvcore.integrations.vllm.first_tokens import FirstTokens
from kvcore.integrations.vllm.link import Allocate, DaemonLink
from kvcore.integrations.vllm.metadata import (
    NO_BLOCK,
    ConnectorConfig,
    KvcoreStats,
    KvGroups,
    StepPlan,
    StepReport,
)
from kvcore.integrations.vllm.records import (
    HOLDING,
    KeySpaces,
    Phase,
    Reach,
    RequestRecord,
    tokens_of,
)
from kvcore.integrations.vllm.session import Session
from kvcore.integrations.vllm.sources import hit_sources, pool_source

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import Request

log = logging.getLogger("kvcore.vllm")
HOLD_PASSES = 8  # scheduling passes an answered, unscheduled request keeps its pin


class SchedulerSide:
    """Scheduler half of :class:`~kvcore.integrations.vllm.KvcoreConnector`. ``model``
    is the engine's model identity (:func:`kvcore.integrations.identity.vllm_model`):
    part of every request's key space, so required (no default that would put every
    engine's pages in one space). ``groups``: vLLM's KV cache groups (hybrid models:
    several; :class:`~.metadata.KvGroups`); one kvcore page holds a page of every
    group's layers (docs/architecture.md), so its block ids travel per group, and an
    engine with a group kvcore cannot serve is all misses. ``loads`` False: save pages
    and load none, whatever the role (vLLM refuses cached context here:
    :func:`~.backends.refusal`)."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        role: str = "kv_both",
        *,
        model: str,
        groups: KvGroups | None = None,
        loads: bool = True,
    ) -> None:
        from kvcore.integrations.vllm.worker import attach

        self.config = config
        self.spaces = KeySpaces(model)
        self.groups = groups or KvGroups()
        self.serves = not self.groups.unservable
        if not self.serves:
            log.warning(
                "kvcore: vLLM's KV cache %s is no per-token attention K/V kvcore can hold: "
                "every request of this engine is a kvcore miss (nothing loaded or saved)",
                self.groups.unservable,
            )
        self.null_block = 0  # vLLM's null block id (bind_kv_cache_manager reads it)
        client = attach(config, map_memory=False)
        self.page_size = client.layout.page_size
        if block_size != self.page_size and self.serves:
            client.close()
            raise LayoutMismatch(
                f"vLLM's block_size is {block_size}, pool {config.pool!r} has page_size "
                f"{self.page_size}: run vLLM with --block-size {self.page_size} or the daemon "
                f"with a pool of page_size={block_size}"
            )
        self.session = Session(Attachment.of(client))  # its life: the link's records only
        # vLLM's source of the pool's own pages (its device; a daemon restarted on another
        # device keeps the first one's: the pool's device is its operator's choice)
        self.pool_source = pool_source(client.attach_info.device)
        self.link = DaemonLink(client, retry_s=config.retry_s, timeout_s=config.timeout_s)
        loads = loads and role != "kv_producer"
        self.reach = Reach(self.page_size, loads, role != "kv_consumer", config.save_generated)
        self.stats = KvcoreStats()
        self.first_tokens = FirstTokens()  # requests kvcore allocated, timed to their first token
        self.book = RequestBook(
            self.session, self.link, self.page_size, self.groups.count > 1, self.reach
        )
        self._pass_late = False  # an answer came late in this pass: wait for no more
        self.preemptions = 0  # requests vLLM preempted (for tests and logs)
        self.kv_cache_manager: KVCacheManager | None = None

    @property
    def attachment(self) -> Attachment:
        """The session the records and plans are of (:class:`~.session.Session`)."""
        return self.session.attachment

    # -- vLLM's scheduler hooks ---------------------------------------------------------

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own hit, block aligned) that
        kvcore holds and pins for this request; None while its allocation is on the
        way past ``ask_wait_ms`` (vLLM asks again next pass)."""
        self.book.absorb()
        req_id = request.request_id
        record = self.book.records.get(req_id)
        if record is None:
            if not self.serves or self.reach.covered(request, num_computed_tokens):
                return 0
            record = self._allocate(request)
            if record is None:
                return 0
        record.local_hit = num_computed_tokens
        if record.phase is Phase.ASKED:
            record = self._wait_for(req_id)
            if record is None:
                return None  # a re-attach dropped it meanwhile: asked afresh next pass
            if record.phase is Phase.ASKED:
                return None  # asked again next pass
        if record.phase is Phase.MISSED:
            del self.book.records[req_id]  # a miss now; asked afresh if vLLM asks again
            return 0
        if record.phase is Phase.WITHOUT:
            return 0
        if record.phase is Phase.RUNNING:  # preempted, asked again: pinned while it waits
            record.phase, record.passes = Phase.HELD, 0
        held = min(record.confirmed * self.page_size, self.reach.loadable(request))
        return max(0, held - num_computed_tokens)

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """vLLM scheduled the request: keep its sequence, and plan the load of the
        ``num_external_tokens`` after vLLM's own hit (as it was when vLLM asked)."""
        record = self.book.records.get(request.request_id)
        if record is None or record.phase not in (Phase.HELD, Phase.RUNNING):
            # external tokens only come from a grant, and vLLM calls this hook right after
            # the ask that granted them: no record is dropped in between
            assert num_external_tokens == 0, (request.request_id, num_external_tokens)
            return
        record.phase, record.passes = Phase.RUNNING, 0
        self.first_tokens.start(request, hit=num_external_tokens > 0)
        if num_external_tokens <= 0:
            return
        first = record.local_hit // self.page_size
        last = first + num_external_tokens // self.page_size
        assert last <= record.confirmed, (first, last, record.confirmed)
        ids = blocks.get_block_ids()
        record.loads = [(record.pages[i], self._group_blocks(ids, i)) for i in range(first, last)]
        self.stats.add("external_hit_tokens", num_external_tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's ``get_external_cache_hit_sources``, right after :meth:`after_alloc`: the
        ``num_external_tokens`` after vLLM's own hit (``local_hit``, as when vLLM asked) by
        the source that supplied them (:mod:`.sources`: the allocation's runs intersected
        with that range). A request without its record (none, or dropped meanwhile) is
        the pool's whole; the counts add up to ``num_external_tokens`` whatever happens."""
        record = self.book.records.get(request.request_id)
        runs: list[tuple[str, int]] = []
        start = 0
        if record is not None and record.phase in HOLDING:
            runs, start = record.sources, record.local_hit
        return hit_sources(runs, start, num_external_tokens, self.pool_source)

    def build_plan(self, output: SchedulerOutput) -> StepPlan:
        """This step's loads and saves, on the state this side holds; frees what vLLM
        kept waiting too long."""
        self.book.absorb()
        self._pass_late = False  # the pass is over: the next one may wait again
        for hit, seconds in self.first_tokens.step(output.num_scheduled_tokens, time.time()):
            self._first_token(hit, seconds)
        fail_blocks, fail_recv = self.book.take_failed()
        plan = StepPlan(
            epoch=self.session.attachment.epoch,
            fail_blocks=fail_blocks,
            load_more=[[] for _ in range(self.groups.count - 1)],
            save_more=[[] for _ in range(self.groups.count - 1)],
            fail_recv=fail_recv,
        )
        touched: dict[str, RequestRecord] = {}  # request id -> record with a copy in the plan
        for record in list(self.book.records.values()):
            if record.phase is Phase.HELD:
                record.passes += 1
                if record.passes > HOLD_PASSES and not record.in_flight:
                    self.book.release(record)
            elif record.loads:
                for page, blocks in record.loads:
                    plan.load_pages.append(page)
                    for g, block in enumerate(blocks):
                        plan.blocks(g, save=False).append(block)
                if self.groups.count > 1:
                    plan.recv.append(record.request.request_id)
                record.loads = []
                touched[record.request.request_id] = record
        for req_id, n in output.num_scheduled_tokens.items():
            running = self.book.records.get(req_id)
            if running is None or running.phase is not Phase.RUNNING:
                continue
            computed = running.request.num_computed_tokens + n
            self.book.grow(running, computed)
            upto = min(running.limit, computed, running.capacity) // self.page_size
            if upto <= running.scheduled:
                continue
            assert self.kv_cache_manager is not None, "bind_kv_cache_manager was not called"
            ids = self.kv_cache_manager.get_block_ids(req_id)
            for i in range(running.scheduled, upto):
                blocks = self._group_blocks(ids, i)
                if NO_BLOCK in blocks:  # a group holds none of it: it and all after it
                    upto = i  # stay unsaved (commits are prefix chains)
                    running.limit = i * self.page_size
                    break
                for g, block in enumerate(blocks):
                    plan.blocks(g, save=True).append(block)
                plan.save_pages.append(running.pages[i])
            if upto <= running.scheduled:
                continue
            running.scheduled = upto
            plan.saved[self.book.ticket(running)] = upto
            touched[req_id] = running
        for record in touched.values():
            record.in_flight += 1
        plan.requests = sorted(self.book.ticket(record) for record in touched.values())
        plan.step = self.session.planned(copies=bool(plan.requests))
        return plan

    def on_report(self, report: StepReport) -> None:
        """The worker finished steps: commit what it saved, release finished requests.
        Only entries of this side's epoch and of the very sequences planned count."""
        self.book.absorb()
        for ticket, upto in report.saved.items():
            self.book.saved(ticket, upto)
        finished_commits = False
        for ticket in report.requests:
            finished_commits |= self.book.copied(ticket)
        self.session.steps_reported(report.steps)  # a lost session drained: retired
        self.book.flush()
        if finished_commits and not self.reach.loads:
            # a producer's answer means its pages are in kvcore (the consumer asks next)
            self.link.wait_idle(self.config.timeout_s)
        else:
            time.sleep(0)  # hand the link's thread the GIL: the commits go out now

    def on_preempted(self, req_id: str) -> None:
        """vLLM dropped the request's blocks: saves planned but not reported restart
        from what kvcore holds (the next plan saves again from the new blocks)."""
        self.preemptions += 1
        record = self.book.records.get(req_id)
        if record is not None and record.phase in HOLDING:
            record.scheduled = record.confirmed

    def finished(self, request: Request) -> None:
        """The request finished or was aborted: release it once no copy is in flight (an
        allocation still on its way is freed when its answer comes)."""
        timed = self.first_tokens.finished(request.request_id, time.time())
        if timed is not None:  # its first token came with the last step: no step may follow
            self._first_token(*timed)
        record = self.book.records.get(request.request_id)
        if record is None:
            return
        if record.phase not in HOLDING:
            del self.book.records[request.request_id]
        elif record.in_flight:
            record.phase = Phase.FINISHED
        else:
            self.book.release(record)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every call sent so far was answered, and take the answers."""
        idle = self.link.wait_idle(timeout_s)
        self.book.absorb()
        return idle

    def check_integrity(self) -> None:
        """Every record's invariants (:meth:`RequestRecord.check`) and the session's
        (:meth:`~.session.Session.check_integrity`); AssertionError if one is broken."""
        self.book.check_integrity()

    def take_stats(self) -> KvcoreStats | None:
        """This side's counters since the last call (the link's round trips folded in),
        for vLLM's ``get_kv_connector_stats``; None when nothing happened."""
        trips, seconds = self.link.take_round_trips()
        self.stats.add("daemon_round_trips", trips)
        self.stats.add("daemon_round_trip_s", seconds)
        return self.stats.take()

    def close(self) -> None:
        self.book.absorb()
        self.book.close()
        self.link.close()

    # -- internals -----------------------------------------------------------------------

    def _first_token(self, hit: bool, seconds: float) -> None:
        """One request's time to first token (:mod:`.first_tokens`) into the stats."""
        self.stats.observe("ttft_hit_s" if hit else "ttft_miss_s", seconds)

    def _allocate(self, request: Request) -> RequestRecord | None:
        """Send the request's allocation; its record (ASKED), or None if it runs without
        kvcore this time (its tokens do not determine its K/V, the daemon is gone, or
        this session is lost)."""
        if not self.session.attached or self.link.quiet():
            return None
        space = self.spaces.of(request)
        tokens = tokens_of(request)
        if space is None or len(tokens) < 2:
            return None
        seq = random.getrandbits(63) or 1
        record = RequestRecord(request, Phase.ASKED, seq, asked_tokens=len(tokens))
        self.book.records[request.request_id] = record
        self.link.send(Allocate(self.session.attachment, request.request_id, seq, tokens, space))
        return record

    def _wait_for(self, req_id: str) -> RequestRecord | None:
        """The request's record once its answer came within ``ask_wait_ms`` (an idle
        daemon answers in under a millisecond: waiting here saves the request a pass),
        else as it is (still ASKED); None if a re-attach dropped it. Once an answer was
        late in a pass, the rest of the pass does not wait (the daemon is busy: its
        answers come with the next pass)."""
        if not self._pass_late:
            deadline = time.monotonic() + self.config.ask_wait_ms / 1e3
            while self._asked(req_id) and (left := deadline - time.monotonic()) > 0:
                self.link.wait_answer(left)
                self.book.absorb()
            self._pass_late = self._asked(req_id)
        self.book.absorb()
        return self.book.records.get(req_id)

    def _asked(self, req_id: str) -> bool:
        record = self.book.records.get(req_id)
        return record is not None and record.phase is Phase.ASKED

    def _group_blocks(self, ids: tuple[list[int], ...], i: int) -> tuple[int, ...]:
        """Block ``i`` of a request in each KV cache group (``ids``: vLLM's block ids per
        group); NO_BLOCK where the group holds none (vLLM's null block, or none yet)."""
        return tuple(
            g[i] if i < len(g) and g[i] != self.null_block else NO_BLOCK
            for g in ids[: self.groups.count]
        )
