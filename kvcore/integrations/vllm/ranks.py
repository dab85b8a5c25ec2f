"""Tensor parallelism for the connector's worker side: which shard of the pool a worker maps.

With ``tensor_parallel_size`` = N each worker holds the K/V of its own heads, so
the daemon serves the pool as N shards (``kvcore serve --pool ...,shards=N``,
``num_kv_heads`` = heads per rank): one region per rank and one Manager, page p
being page p of every shard. A worker maps the shard of its tensor-parallel
rank; the scheduler side maps nothing and needs no shard.

What makes one prefix index valid for all ranks together: every rank runs the
same :class:`~kvcore.integrations.vllm.metadata.StepPlan` (vLLM broadcasts one
connector metadata to all workers); vLLM's ``KVOutputAggregator`` folds the
workers' :class:`~kvcore.integrations.vllm.metadata.StepReport` with
``StepReport.aggregate`` (per request, the min of the pages saved), so a page is
committed only once every rank saved it; and it unions the workers' blocks with
load errors (``invalid_block_ids``), so a hit that failed on any rank is
recomputed on all of them.

Only tensor parallelism: pipeline stages hold other layers, and context-parallel
ranks other tokens, under the same TP rank, so they would map one shard and save
different K/V into the same pages. :func:`check_parallelism` refuses them until
the pool is sharded by stage and context rank too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from kvcore.client import Client
from kvcore.errors import LayoutMismatch, Unsupported

UNSHARDED = (
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
)
"""vLLM's ``ParallelConfig`` sizes (vLLM 0.32's names) whose ranks share a TP rank, so
would share a pool shard: each must be 1."""


def check_parallelism(parallel_config: Any) -> None:
    """:class:`~kvcore.errors.Unsupported`, naming the setting, if vLLM runs pipeline or
    context parallelism (a size of :data:`UNSHARDED` over 1; a size vLLM does not have
    counts as 1): its ranks would save different K/V into the same pages."""
    for name in UNSHARDED:
        size = getattr(parallel_config, name, 1)
        if size > 1:
            raise Unsupported(
                f"kvcore's vLLM connector supports tensor parallelism only: {name}={size} "
                f"would have its ranks share one pool shard and save different K/V into "
                f"the same pages; run with {name}=1"
            )


class ShardOptions(TypedDict):
    """``Client.connect`` options of one rank: the shard mapped, the shard count expected."""

    shard: int
    shards: int


@dataclass(frozen=True, slots=True)
class TensorRank:
    """This worker's tensor-parallel ``rank`` (0 <= rank < ``size``) among ``size`` ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, self

    @classmethod
    def current(cls) -> TensorRank:
        """vLLM's tensor-parallel rank and world size of this process; rank 0 of 1 where
        vLLM set up no tensor-parallel group (a plain engine, tests)."""
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return cls()
        return cls(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )

    def connect_options(self) -> ShardOptions:
        """``Client.connect`` options that map this rank's shard and make the daemon refuse
        (LayoutMismatch) a pool of another shard count."""
        return {"shard": self.rank, "shards": self.size}

    def check(self, client: Client, pool: str) -> None:
        """LayoutMismatch, with both numbers and the fix, unless the mapped pool has one
        shard per rank and this rank's is the one mapped (a daemon that predates shards
        ignores the request for one and reports a single shard)."""
        if client.shards != self.size or client.attach_info.shard != self.rank:
            raise LayoutMismatch(
                f"kvcore pool {pool!r} has {client.shards} shard(s) but vLLM runs "
                f"tensor_parallel_size={self.size}: serve it with `kvcore serve --pool "
                f"name={pool},...,shards={self.size}` (num_kv_heads = the heads of one rank)"
            )
