"""One pipeline stage's worker, in its own process, for tests/test_vllm_pipeline.py.

The stage holds the caches of its own layers (global layer ``pp_rank`` of a model with
one layer per stage, laid out as vLLM's CPU attention lays them out) and the real
:class:`~kvcore.integrations.vllm.worker.WorkerSide` of its rank, which maps the
stage's shard of the daemon's pool. The test process is the scheduler: it sends each
step's plan and schedule over a pipe; the stage loads, runs a stand-in forward (the
K/V of each token, a value that names the token, its position and the GLOBAL layer,
or POISON where the context it computes from was not loaded), saves, and answers with
its connector output, as a vLLM worker returns it to the executor.
"""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection
from typing import Any

import torch

POISON = -1.0
NUM_BLOCKS = 64


def value(token: int, pos: int, layer: int, kv: int) -> float:
    """The stand-in K/V of ``token`` at position ``pos`` in ``layer`` (exact in fp32)."""
    return token * 4096 + pos + layer * 0.25 + kv * 0.5


class Stage:
    """A stage's caches (its layer as ``[B, 2, N, H, D]``) and its worker side."""

    def __init__(self, extra: dict[str, Any], pp_rank: int, pp_size: int, shape: Any) -> None:
        from kvcore.integrations.vllm.metadata import ConnectorConfig
        from kvcore.integrations.vllm.pages import KV_BLOCKS, block_view
        from kvcore.integrations.vllm.ranks import WorkerRank
        from kvcore.integrations.vllm.worker import WorkerSide

        self.layer = pp_rank
        rank = WorkerRank(pp_rank=pp_rank, pp_size=pp_size)
        self.worker = WorkerSide(ConnectorConfig.from_extra(extra), rank=rank)
        cache = torch.zeros(shape)
        self.worker.register({f"model.layers.{pp_rank}.self_attn.attn": cache}, KV_BLOCKS)
        self.view = block_view(cache, KV_BLOCKS)
        self.page_size = shape[2]

    def alloc(self, blocks: list[int]) -> None:
        """Newly allocated blocks hold garbage (NaN) until loaded or computed."""
        for block in blocks:
            self.view[block].fill_(float("nan"))

    def holds(self, blocks: list[int], tokens: list[int], stop: int) -> bool:
        """Whether ``blocks`` hold this layer's K/V of ``tokens[:stop]``."""
        for pos in range(stop):
            row = self.view[blocks[pos // self.page_size], :, pos % self.page_size]
            for kv in (0, 1):
                if not bool((row[kv] == value(tokens[pos], pos, self.layer, kv)).all()):
                    return False
        return True

    def step(
        self, plan: Any, scheduled: list[tuple[list[int], list[int], int, int]], save: bool
    ) -> Any:
        """start_load_kv, the forward of ``scheduled`` (blocks, tokens, start, stop each),
        wait_for_save (skipped if not ``save``: the copy of a stage that failed), then
        the connector output this worker returns."""
        from vllm.v1.outputs import KVConnectorOutput

        self.worker.load(plan)
        for blocks, tokens, start, stop in scheduled:
            good = self.holds(blocks, tokens, start)
            for pos in range(start, stop):
                row = self.view[blocks[pos // self.page_size], :, pos % self.page_size]
                for kv in (0, 1):
                    fill = value(tokens[pos], pos, self.layer, kv) if good else POISON
                    row[kv].fill_(fill)
        if not save:
            plan = dataclasses.replace(plan, save_pages=[], save_blocks=[])
        self.worker.save(plan)
        return KVConnectorOutput(
            kv_connector_worker_meta=self.worker.take_report(),
            invalid_block_ids=self.worker.take_failed_blocks(),
        )


def main(conn: Connection, extra: dict[str, Any], pp_rank: int, pp_size: int, shape: Any) -> None:
    """Serve ``(method, args)`` commands on ``conn`` until ``None``; each answer is the
    method's result, or the exception it raised."""
    stage = Stage(extra, pp_rank, pp_size, shape)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        method, args = command
        try:
            conn.send(getattr(stage, method)(*args))
        except Exception as exc:  # the test shows it
            conn.send(exc)
    stage.worker.close()
