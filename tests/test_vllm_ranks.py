"""Which KV heads of a pool page each tensor-parallel rank copies, and the connector's
worker sides of several TP sizes on one real daemon's pool, with stand-in caches.

A pool page holds every KV head of the model (kvcore/integrations/vllm/ranks.py). The
properties: the ranks' head ranges are vLLM's (``QKVParallelLinear``: split evenly, or
one head replicated on ``tp // heads`` ranks), and the writers' ranges cover every
head of a page exactly once, so the ranks of any TP size together write a whole page
and no two write the same bytes. End to end with real vLLM engines:
tests/test_vllm_tp.py.

Here the real :class:`~kvcore.integrations.vllm.worker.WorkerSide` of every rank
(vLLM's CPU block layout, stand-in values) saves pages into a real daemon's pool of
each order: a head-outer one (``LPHKT``: a rank's heads of a page are one run of bytes)
and the token-outer ``LPKTH`` (strided copies). Another TP size loads them, head for
head; a replica that is not its head's writer writes nothing (its cache holds NaN
here, and no NaN reaches the pool). Must-not-share: a pool of one shard per rank
(kvcore's earlier layout: one rank's heads per shard) and a pool of another head count
are refused with the pool to start.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vllm_helpers import MODEL, PAGE_SIZE, engine_config, vllm_available, write_model

from kvcore.errors import LayoutMismatch, Unsupported
from kvcore.integrations.vllm.ranks import HeadRange, WorkerRank, head_range

HEADS = MODEL.num_kv_heads  # 2
BLOCKS = 4
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL.num_layers)]


# -- which heads: properties ---------------------------------------------------------


@st.composite
def sizes(draw: st.DrawFn) -> tuple[int, int]:
    """(total KV heads, TP size) as vLLM runs them: one divides the other."""
    total = draw(st.integers(1, 64))
    if draw(st.booleans()):
        return total, draw(st.sampled_from([d for d in range(1, total + 1) if total % d == 0]))
    return total, total * draw(st.integers(1, 8))


@given(sizes())
def test_the_writers_cover_every_head_once_and_every_rank_holds_vllms_heads(
    size: tuple[int, int],
) -> None:
    total, tp = size
    ranges = [head_range(t, tp, total) for t in range(tp)]
    written: list[int] = []
    for t, r in enumerate(ranges):
        assert r.count == max(1, total // tp)  # vLLM's ModelConfig.get_num_kv_heads
        assert r.first >= 0 and r.first + r.count <= total and r.total == total
        if tp > total:  # replicated: rank t holds head t // replicas (QKVParallelLinear)
            assert r.first == t // (tp // total)
        if r.writes:
            written += range(r.first, r.first + r.count)
    assert sorted(written) == list(range(total))  # each head exactly once
    assert ranges[0].writes and ranges[0].first == 0
    assert all(r.whole == (tp == 1 or total == 1) for r in ranges)


@given(st.integers(1, 64), st.integers(1, 64))
def test_sizes_neither_dividing_the_other_are_unsupported(total: int, tp: int) -> None:
    if total % tp == 0 or tp % total == 0:
        return
    with pytest.raises(Unsupported, match=f"{total} KV heads.*tensor_parallel_size={tp}"):
        head_range(0, tp, total)


def test_mlas_latent_is_replicated_on_every_rank_and_written_by_rank_0() -> None:
    assert [head_range(t, 4, 1) for t in range(4)] == [
        HeadRange(0, 1, 1, True),
        *[HeadRange(0, 1, 1, False)] * 3,
    ]


def test_a_stage_is_a_shard_whatever_the_tp_size() -> None:
    assert WorkerRank(1, 2, 1, 2).connect_options() == {"shard": 1, "shards": 2}
    assert WorkerRank(3, 4).connect_options() == {"shard": 0, "shards": 1}


# -- worker sides on a real daemon -----------------------------------------------------

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from kvcore.daemon_process import DaemonProcess

    tmp = tmp_path_factory.mktemp("ranks")
    one_rank = MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=16).replace(
        f"num_kv_heads={HEADS}", "num_kv_heads=1"
    )
    pools = [
        MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=16, name="outer") + ",order=LPHKT",
        MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=16, name="strided") + ",order=LPKTH",
        one_rank.replace("name=default", "name=old") + ",shards=2",  # before: tp shards
        one_rank.replace("name=default", "name=half"),
    ]
    flags = [arg for pool in pools for arg in ("--pool", pool)]
    with DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", *flags) as d:
        yield d.endpoint


def worker(daemon: str, pool: str, rank: WorkerRank) -> Any:
    from kvcore.integrations.vllm.metadata import ConnectorConfig
    from kvcore.integrations.vllm.worker import WorkerSide

    extra = {"endpoint": daemon, "pool": pool, "timeout_s": 5}
    return WorkerSide(ConnectorConfig.from_extra(extra), rank=rank)


class Rank:
    """One TP rank's worker side and its stand-in caches (vLLM CPU's ``[B, h, N, 2D]``)."""

    def __init__(self, daemon: str, pool: str, rank: WorkerRank) -> None:
        from kvcore.integrations.vllm.pages import KV_BLOCKS, block_view

        self.side = worker(daemon, pool, rank)
        self.heads = rank.heads(HEADS)
        shape = (BLOCKS, self.heads.count, PAGE_SIZE, 2 * MODEL.head_dim)
        caches = {name: torch.zeros(shape) for name in LAYERS}
        try:
            self.side.register(caches, KV_BLOCKS, total_heads=HEADS)
        except BaseException:
            self.side.close()
            raise
        self.views = [block_view(caches[name], KV_BLOCKS) for name in LAYERS]  # [B,2,N,h,D]

    def fill(self, model: list[torch.Tensor]) -> None:
        """This rank's heads of ``model`` (per layer ``[B, 2, N, HEADS, D]``); NaN where
        the rank is a replica that must write nothing."""
        for view, full in zip(self.views, model, strict=True):
            if self.heads.writes:
                view.copy_(full[..., self.heads.first : self.heads.first + self.heads.count, :])
            else:
                view.fill_(float("nan"))

    def holds(self, model: list[torch.Tensor], blocks: list[int], of: list[int]) -> bool:
        """Whether block ``blocks[i]`` holds this rank's heads of block ``of[i]`` of ``model``."""
        first, count = self.heads.first, self.heads.count
        return all(
            torch.equal(view[blocks], full[of][..., first : first + count, :])
            for view, full in zip(self.views, model, strict=True)
        )

    def step(
        self,
        step: int,
        save: Sequence[tuple[int, int]] = (),
        load: Sequence[tuple[int, int]] = (),
    ) -> int:
        """One plan: ``save`` (block, page) pairs, ``load`` (page, block) pairs; the
        pages this rank reports saved."""
        from kvcore.integrations.vllm.metadata import StepPlan, Ticket

        ticket = Ticket("r", self.side.client.epoch, step)
        plan = StepPlan(
            step=step,
            epoch=self.side.client.epoch,
            save_blocks=[b for b, _ in save],
            save_pages=[p for _, p in save],
            load_pages=[p for p, _ in load],
            load_blocks=[b for _, b in load],
            saved={ticket: len(save)} if save else {},
            requests=[ticket],
        )
        self.side.load(plan)
        self.side.save(plan)
        report = self.side.take_report()
        assert not self.side.take_failed_blocks()
        return int(report.saved.get(ticket, 0)) if report else 0

    def close(self) -> None:
        self.side.close()


def model_kv(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, 2, PAGE_SIZE, HEADS, MODEL.head_dim)
    return [torch.randn(shape, generator=gen) for _ in LAYERS]


def ranks(daemon: str, pool: str, tp: int) -> list[Rank]:
    return [Rank(daemon, pool, WorkerRank(t, tp)) for t in range(tp)]


@needs_vllm
@pytest.mark.parametrize("pool", ["outer", "strided"])
@pytest.mark.parametrize(("writer", "reader"), [(2, 1), (1, 2), (4, 1), (4, 2), (1, 4)])
def test_pages_saved_at_one_tp_size_load_at_another(
    daemon: str, pool: str, writer: int, reader: int
) -> None:
    model = model_kv(seed=10 * writer + reader)
    pages = [3, 4, 9]  # blocks 0, 1, 2 -> pool pages
    saving, loading = ranks(daemon, pool, writer), ranks(daemon, pool, reader)
    try:
        for r in saving:
            r.fill(model)
            assert r.step(1, save=list(zip([0, 1, 2], pages, strict=True))) == 3
        assert sum(r.side.stats.totals()["save_bytes"] > 0 for r in saving) == min(writer, HEADS)
        assert not loading[0].holds(model, [3, 2, 1], [0, 1, 2])  # zeros until loaded
        for r in loading:
            r.step(2, load=list(zip(pages, [3, 2, 1], strict=True)))
            assert r.holds(model, [3, 2, 1], [0, 1, 2]), r.heads
        whole = loading[0].side.client.kv_caches if reader == 1 else None
        if whole is not None:  # no NaN of a replica reached the pool
            assert not any(bool(layer[pages].isnan().any()) for layer in whole)
    finally:
        for r in saving + loading:
            r.close()


def test_a_ranks_heads_of_a_page_are_one_run_in_a_head_outer_order(daemon: str) -> None:
    from kvcore import Client
    from kvcore.integrations.vllm.runs import Side

    for pool, runs in (("outer", True), ("strided", False)):
        with Client.connect(daemon, pool, heartbeat=False) as client:
            rank1 = [layer[:, :, :, 1:2] for layer in client.kv_caches]  # TP=2 rank 1's
            side = Side.of(rank1)
            assert (side is not None) == runs, pool
            if side is not None:  # half a page of a layer, one dense run; pages apart
                page = client.kv_caches[0][0].nbytes
                assert (side.unit, side.page_stride) == (page // 2, page)


@needs_vllm
def test_a_pool_of_one_shard_per_rank_is_refused_naming_the_pool_to_start(daemon: str) -> None:
    """kvcore's earlier pools for TP=2: two shards of one rank's heads each."""
    with pytest.raises(LayoutMismatch, match=r"2 shard.*expects 1.*num_kv_heads = every KV head"):
        worker(daemon, "old", WorkerRank(1, 2))


@needs_vllm
def test_a_pool_of_another_head_count_is_refused_naming_the_pool_to_start(daemon: str) -> None:
    """One rank's heads in one shard: bytes of another count than a page of the model."""
    with pytest.raises(LayoutMismatch, match=rf"num_kv_heads: pool 1, vLLM {HEADS}.*heads={HEADS}"):
        Rank(daemon, "half", WorkerRank(0, 2))
    with pytest.raises(LayoutMismatch, match=r"holds 2 head\(s\).*rank 0 of 2.*not the 1"):
        side = worker(daemon, "outer", WorkerRank(0, 2))
        try:
            from kvcore.integrations.vllm.pages import KV_BLOCKS

            shape = (BLOCKS, HEADS, PAGE_SIZE, 2 * MODEL.head_dim)
            side.register({n: torch.zeros(shape) for n in LAYERS}, KV_BLOCKS, total_heads=HEADS)
        finally:
            side.close()


@needs_vllm
def test_the_identity_names_the_pipeline_size_and_not_the_tp_size(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from kvcore.integrations.identity import vllm_identity, vllm_model

    model = write_model(tmp_path_factory.mktemp("tiny-llama"))
    one = engine_config(model)
    two = engine_config(model, tensor_parallel_size=2)
    assert vllm_model(two) == vllm_model(one)
    assert vllm_identity(two).tp_size == 1 and vllm_identity(two).tp_rank is None
    assert vllm_model(engine_config(model, pipeline_parallel_size=2)) != vllm_model(one)


def test_the_gather_and_scatter_copy_moves_a_ranks_heads_only() -> None:
    """The copy a GPU (or a pool on another device) runs, on a rank's head slice of a
    pool page, both ways: the other heads of every page are untouched."""
    from kvcore.integrations.vllm.pages import PageCopy

    gen = torch.Generator().manual_seed(0)
    pool = torch.zeros(6, 2, PAGE_SIZE, 4, 8)  # [P, 2, N, H, D], 4 heads
    blocks = torch.randn(3, 2, PAGE_SIZE, 2, 8, generator=gen)  # rank 1 of 2: heads 2, 3
    mine = pool[:, :, :, 2:4]
    index = torch.tensor([0, 1, 2]), torch.tensor([4, 0, 5])
    PageCopy(3, src_index=index[0], dst_index=index[1]).run(blocks, mine)
    assert torch.equal(mine[[4, 0, 5]], blocks)
    assert not bool(pool[:, :, :, :2].any()) and not bool(pool[[1, 2, 3]].any())
    back = torch.zeros_like(blocks)
    PageCopy(3, src_index=index[1], dst_index=index[0]).run(mine, back)
    assert torch.equal(back, blocks)
