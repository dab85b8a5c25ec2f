"""Tensor and pipeline parallelism for the connector's worker side: which shard of the
pool a worker maps.

Each worker holds the K/V of its own heads (its tensor-parallel rank) of its own layers
(its pipeline stage), so the daemon serves the pool as ``tp * pp`` shards (``kvcore
serve --pool ...,shards=<tp*pp>``, ``num_kv_heads`` = heads per TP rank, ``num_layers``
= layers per stage): one region per worker and one Manager, page p being page p of
every shard. The worker of TP rank t in stage s maps shard ``s * tp + t``; the
scheduler side maps nothing and needs no shard.

What makes one prefix index valid for all workers together: every worker runs the same
:class:`~kvcore.integrations.vllm.metadata.StepPlan` (vLLM broadcasts one connector
metadata to all of them, every stage included); vLLM's ``KVOutputAggregator`` folds
every worker's :class:`~kvcore.integrations.vllm.metadata.StepReport` (a stage that is
not the last passes its connector output through ``sample_tokens``) with
``StepReport.aggregate`` (per request, the min of the pages saved), so a page is
committed only once every rank of every stage saved it; and it unions the workers'
blocks with load errors (``invalid_block_ids``), so a hit that failed on any worker is
recomputed on all of them: a hit loads on every stage or none.

Stages must hold equal numbers of layers (one layout serves every shard): the worker's
layout check (:func:`~kvcore.integrations.vllm.pages.check_layout`) names the layer
counts otherwise. Context-parallel ranks hold
other tokens under the same shard: :func:`check_parallelism` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from kvcore.client import Client
from kvcore.errors import LayoutMismatch, Unsupported

UNSHARDED = (
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
)
"""vLLM's ``ParallelConfig`` sizes (vLLM 0.32's names) whose ranks share a worker's
shard, so would share pool pages: each must be 1."""


def check_parallelism(parallel_config: Any) -> None:
    """:class:`~kvcore.errors.Unsupported`, naming the setting, if vLLM runs context
    parallelism (a size of :data:`UNSHARDED` over 1; a size vLLM does not have counts
    as 1): its ranks would save different tokens' K/V into the same pages."""
    for name in UNSHARDED:
        size = getattr(parallel_config, name, 1)
        if size > 1:
            raise Unsupported(
                f"kvcore's vLLM connector supports tensor and pipeline parallelism, not "
                f"{name}={size}: its ranks would share one pool shard and save different "
                f"tokens' K/V into the same pages; run with {name}=1"
            )


class ShardOptions(TypedDict):
    """``Client.connect`` options of one rank: the shard mapped, the shard count expected."""

    shard: int
    shards: int


@dataclass(frozen=True, slots=True)
class WorkerRank:
    """A worker's place: tensor-parallel ``tp_rank`` of ``tp_size`` in pipeline stage
    ``pp_rank`` of ``pp_size`` (0 <= rank < size for both)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size, self

    @property
    def shard(self) -> int:
        """The pool shard of this worker: stage-major, ``pp_rank * tp_size + tp_rank``."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def shards(self) -> int:
        """Shards the pool needs: one per worker, ``tp_size * pp_size``."""
        return self.tp_size * self.pp_size

    @classmethod
    def current(cls) -> WorkerRank:
        """vLLM's ranks and world sizes of this process; rank 0 of 1 where vLLM set up no
        model-parallel groups (a plain engine, tests)."""
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return cls()
        pp = parallel_state.get_pp_group()
        return cls(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            pp.rank_in_group,
            pp.world_size,
        )

    def connect_options(self) -> ShardOptions:
        """``Client.connect`` options that map this worker's shard and make the daemon
        refuse (LayoutMismatch) a pool of another shard count."""
        return {"shard": self.shard, "shards": self.shards}

    def check(self, client: Client, pool: str) -> None:
        """LayoutMismatch, with both numbers and the fix, unless the mapped pool has one
        shard per worker and this worker's is the one mapped (a daemon that predates
        shards ignores the request for one and reports a single shard)."""
        if client.shards != self.shards or client.attach_info.shard != self.shard:
            raise LayoutMismatch(
                f"kvcore pool {pool!r} has {client.shards} shard(s) but vLLM runs "
                f"tensor_parallel_size={self.tp_size} x pipeline_parallel_size="
                f"{self.pp_size} workers: serve it with `kvcore serve --pool name={pool},"
                f"...,shards={self.shards}` (num_kv_heads = the heads of one tensor-parallel "
                f"rank, num_layers = the layers of one stage)"
            )
