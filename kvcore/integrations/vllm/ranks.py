"""Tensor and pipeline parallelism for the connector's worker side: which shard of the
pool a worker maps, and which KV heads of its pages it copies.

A pool holds every KV head of the model, whatever the tensor-parallel size, so an
engine at TP=1 and one at TP=2 of the same model share pages (and so do a prefill
instance and a decode instance of other TP sizes). Pipeline stages hold other layers,
so the daemon serves the pool as ``pp`` shards (``kvcore serve --pool ...,
num_kv_heads=<the model's KV heads>,num_layers=<one stage's>,shards=<pp>``): one
region per stage and one Manager, page p being page p of every shard. Every worker of
stage s maps shard s; the scheduler side maps nothing and needs no shard.

Inside a page, the worker of TP rank t copies its own heads (:func:`head_range`), as
vLLM's ``QKVParallelLinear`` gives them out::

    4 KV heads, TP=2: rank 0 heads [0, 2), rank 1 heads [2, 4)   (each writes its own)
    2 KV heads, TP=4: rank 0 head 0, rank 1 head 0 (replica), rank 2 head 1, rank 3 head 1
    MLA (one latent "head", replicated on every rank): every rank head 0

A rank's heads are disjoint bytes of the page; where vLLM replicates a head on several
ranks (fewer KV heads than ranks, or MLA's latent), the bytes are equal on all of them,
so only the first replica writes it (saves) and every replica reads it (loads). In a
head-outer pool order (``LPHKT``, ``PLHKT``) a rank's heads of one page and layer are
one run of bytes (:mod:`.runs`); in any other order they copy strided.

What makes one prefix index valid for all workers together: every worker runs the same
:class:`~kvcore.integrations.vllm.metadata.StepPlan` (vLLM broadcasts one connector
metadata to all of them, every stage included); vLLM's ``KVOutputAggregator`` folds
every worker's :class:`~kvcore.integrations.vllm.metadata.StepReport` (a stage that is
not the last passes its connector output through ``sample_tokens``) with
``StepReport.aggregate`` (per request, the min of the pages saved), so a page is
committed only once every rank of every stage saved it (a replica that writes nothing
reports its save with the writer's step, so the writer's copy decides); and it unions
the workers' blocks with load errors (``invalid_block_ids``), so a hit that failed on
any worker is recomputed on all of them: a hit loads on every rank and stage or none.

Why the identity does not name the TP size (kvcore/integrations/identity.py): a KV
head's K and V are the model's, computed from the same weights on whichever rank holds
it (the all-reduces of a TP engine change only float rounding, as a batch size does);
what the TP size changes is which rank holds which heads, and that is this module's.
Pools of one shard per tensor-parallel rank (``shards = tp * pp``, ``num_kv_heads`` =
one rank's heads: kvcore before pages were shared across TP sizes) are refused with
the pool to start instead (:meth:`WorkerRank.check`, :meth:`WorkerRank.refused`).

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
class HeadRange:
    """The KV heads of a pool page that one TP rank holds: ``[first, first + count)``
    of the model's ``total``; ``writes``: whether this rank saves them (the first
    replica of each head does; module docstring)."""

    first: int
    count: int
    total: int
    writes: bool = True

    @property
    def whole(self) -> bool:
        """Whether the range is every head of the page (TP=1, or MLA's one latent)."""
        return self.count == self.total


def head_range(tp_rank: int, tp_size: int, total: int) -> HeadRange:
    """The heads of ``total`` KV heads that vLLM gives TP rank ``tp_rank`` of
    ``tp_size`` (``QKVParallelLinear``: ``total // tp_size`` each where ``tp_size``
    divides ``total``; else one each, head ``tp_rank // (tp_size // total)``, where
    ``total`` divides ``tp_size``). Unsupported for sizes vLLM does not run either."""
    assert 0 <= tp_rank < tp_size and total >= 1, (tp_rank, tp_size, total)
    if total % tp_size == 0:
        count = total // tp_size
        return HeadRange(tp_rank * count, count, total)
    if tp_size % total == 0:
        replicas = tp_size // total
        return HeadRange(tp_rank // replicas, 1, total, tp_rank % replicas == 0)
    raise Unsupported(
        f"{total} KV heads over tensor_parallel_size={tp_size}: neither divides the other "
        f"(vLLM splits or replicates heads evenly)"
    )


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
        """The pool shard of this worker: its stage's, ``pp_rank`` (every TP rank of a
        stage maps it, each copying its own heads)."""
        return self.pp_rank

    @property
    def shards(self) -> int:
        """Shards the pool needs: one per stage, ``pp_size``."""
        return self.pp_size

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

    def heads(self, total: int) -> HeadRange:
        """This rank's heads of a page of ``total`` KV heads (:func:`head_range`)."""
        return head_range(self.tp_rank, self.tp_size, total)

    def connect_options(self) -> ShardOptions:
        """``Client.connect`` options that map this worker's shard and make the daemon
        refuse (LayoutMismatch) a pool of another shard count."""
        return {"shard": self.shard, "shards": self.shards}

    def pool_flag(self, pool: str) -> str:
        """What to serve the pool with, in words an operator can act on."""
        shards = f",shards={self.shards}" if self.shards > 1 else ""
        return (
            f"`kvcore serve --pool name={pool},...{shards}` with num_kv_heads = every KV "
            f"head of the model (whatever tensor_parallel_size={self.tp_size}) and "
            f"num_layers = the layers of one of the {self.pp_size} pipeline stage(s)"
        )

    def refused(self, error: LayoutMismatch, pool: str) -> LayoutMismatch:
        """The daemon's refusal of this worker's shard (``error``) with the pool to start."""
        return LayoutMismatch(f"{error}; for vLLM, serve it with {self.pool_flag(pool)}")

    def check(self, client: Client, pool: str) -> None:
        """LayoutMismatch, with both numbers and the fix, unless the mapped pool has one
        shard per stage and this worker's is the one mapped (a daemon that predates
        shards ignores the request for one and reports a single shard)."""
        if client.shards != self.shards or client.attach_info.shard != self.shard:
            raise LayoutMismatch(
                f"kvcore pool {pool!r} has {client.shards} shard(s) but vLLM runs "
                f"pipeline_parallel_size={self.pp_size} stage(s) (one shard each; tensor-"
                f"parallel ranks share their stage's): serve it with {self.pool_flag(pool)}"
            )
