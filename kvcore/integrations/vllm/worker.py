"""The connector's worker side: copies between the mapped pool and vLLM's blocks.

The worker attaches its own session (it holds no sequence; the scheduler side
does) only to map the pool zero-copy. Per step it runs the :class:`StepPlan`:
loads before the forward (``start_load_kv``; synchronous, so every layer is
loaded before attention reads it), saves after it (``wait_for_save``; one
:class:`~.pages.PageCopy` per layer: a gather and a scatter on a GPU, never waited
for there; a slice copy per run of adjacent pages on the CPU), counts each copy's
bytes and seconds (:class:`~.metadata.KvcoreStats`), and reports each save, once
its copy is complete, in a :class:`StepReport` that the scheduler turns into
commits. A worker of a pipeline-parallel engine maps the shard of its stage, and a
tensor-parallel rank copies its own KV heads of each page, the pool holding them all
(:mod:`.ranks`). No K/V crosses the socket; no Python loop runs per token.

Generations: a plan runs only on the pool of its epoch (the daemon start the
scheduler side built it on). A plan of an epoch the worker has not mapped yet (the
daemon restarted and the scheduler side attached again first) makes the worker attach
again (:mod:`kvcore.integrations.reconnect`: the rule every integration shares); a
plan of an epoch it left behind, or one it cannot map, is refused: its loads are
reported as failed blocks (vLLM recomputes them) and its saves are skipped (never
committed). So is a plan whose loads fail for any reason (the lease lost while
copying): its saves may hold K/V computed from those blocks. The blocks a plan names
in ``fail_blocks`` (loads the scheduler side knows will never run) are reported
failed too.

The scheduler side's session lost while the daemon lives keeps the epoch, so the
worker cannot tell its plans apart: the scheduler plans nothing on that session
once it knows, and the daemon keeps the session's pages fenced (nobody else's)
until the worker reported the plans built on them (:mod:`.scheduler`). That is why
every plan with a copy is reported, refused or not.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from kvcore.client import Client
from kvcore.errors import LayoutMismatch, Timeout
from kvcore.integrations.reconnect import Reconnector
from kvcore.integrations.vllm.metadata import (
    NO_BLOCK,
    ConnectorConfig,
    KvcoreStats,
    KvGroups,
    StepPlan,
    StepReport,
    Ticket,
)
from kvcore.integrations.vllm.orders import CPU_LAYOUT, matching_order
from kvcore.integrations.vllm.pages import (
    HeadLayout,
    PageCopy,
    VllmGeometry,
    block_view,
    check_layout,
)
from kvcore.integrations.vllm.ranks import HeadRange, WorkerRank
from kvcore.integrations.vllm.runs import ByteRuns, Side

log = logging.getLogger("kvcore.vllm")
RETIRED_EPOCHS = 16  # epochs the worker remembers leaving (their plans: refused at once)


def attach(config: ConnectorConfig, *, map_memory: bool, **options: Any) -> Client:
    """A session on the configured pool; a clear Timeout if no daemon answers.
    ``options`` go to Client.connect (a worker's shard)."""
    try:
        return Client.connect(
            config.endpoint,
            pool=config.pool,
            namespace=config.namespace,
            timeout_s=config.timeout_s,
            map_memory=map_memory,
            name="vllm",
            **options,
        )
    except Timeout:
        raise Timeout(
            f"no kvcore daemon answers at {config.endpoint} within {config.timeout_s} s: "
            f"start one (`kvcore serve --pool ...`) or set kv_connector_extra_config "
            f"'endpoint'"
        ) from None


class WorkerSide:
    """Worker half of :class:`~kvcore.integrations.vllm.KvcoreConnector`. ``groups``:
    vLLM's KV cache groups; each layer's copies use its group's blocks (pool layer i
    is the model's attention layer i, whatever its group). ``rank``: this worker's
    tensor-parallel rank and pipeline stage (default: vLLM's, :meth:`WorkerRank.current`)."""

    def __init__(
        self,
        config: ConnectorConfig,
        groups: KvGroups | None = None,
        rank: WorkerRank | None = None,
    ) -> None:
        self.config = config
        self.groups = groups or KvGroups()
        self._layer_groups: list[int] = []  # per layer (as in _blocks): its KV cache group
        self._recv: tuple[set[str], set[str]] = (set(), set())  # hybrid loads: done, failed
        self.rank = rank or WorkerRank.current()
        try:
            self.client = attach(config, map_memory=True, **self.rank.connect_options())
        except LayoutMismatch as refused:  # a pool of other shards: name the one to serve
            raise self.rank.refused(refused, config.pool) from None
        self.rank.check(self.client, config.pool)
        self.heads = HeadRange(0, 1, 1)  # this rank's of a page (register: vLLM's heads)
        self._reconnect = Reconnector.of(self.client, retry_s=config.retry_s, what="vLLM worker")
        self._retired: OrderedDict[int, None] = OrderedDict()  # epochs left behind, oldest first
        self.stats = KvcoreStats()
        self._blocks: list[torch.Tensor] = []  # per layer: [B, parts, N, H, D] views of vLLM caches
        self._block_side: Side | None = None  # vLLM's caches as runs (None: strided copies)
        # per mapping (kv_caches): its layers of this rank's heads, and those as runs
        self._mapping: tuple[list[torch.Tensor], list[torch.Tensor], Side | None] = ([], [], None)
        self._report = StepReport()
        self._unsynced: list[tuple[torch.cuda.Event, StepReport]] = []  # GPU saves, to report
        self._step_saves: list[tuple[torch.cuda.Event, StepReport]] = []  # this step's
        self._failed_blocks: set[int] = set()
        self._refused_step = -1  # the step whose loads were refused: its saves are skipped

    def register(
        self,
        caches: dict[str, torch.Tensor],
        layout: HeadLayout,
        cache_dtype: str = "auto",
        vllm_layout: str = CPU_LAYOUT,
        total_heads: int | None = None,
    ) -> None:
        """Map vLLM's per-layer caches (ordered by layer index) and check the layouts;
        ``cache_dtype`` is vLLM's ``kv_cache_dtype`` (the format of fp8 bytes),
        ``vllm_layout`` its ``KVCacheLayout`` name (the pool order that matches it:
        :func:`~.orders.matching_order`), ``total_heads`` the model's KV heads, a pool
        page's (None: this rank's times the TP size, no head replicated; :mod:`.ranks`)."""
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.platforms import current_platform

        if self.groups.unservable:
            return  # nothing is ever copied (the scheduler side plans no copy)
        ordered = [caches[name] for name in sorted(caches, key=extract_layer_index)]
        fnuz = current_platform.is_fp8_fnuz()
        geometry = VllmGeometry.of(ordered, layout, cache_dtype, fp8_fnuz=fnuz)
        total = total_heads or geometry.num_kv_heads * self.rank.tp_size
        heads = self.rank.heads(total)
        if heads.count != geometry.num_kv_heads:
            raise LayoutMismatch(
                f"vLLM's KV cache holds {geometry.num_kv_heads} head(s) on tensor-parallel "
                f"rank {self.rank.tp_rank} of {self.rank.tp_size}, not the {heads.count} of "
                f"a model of {total} KV heads"
            )
        order = matching_order(vllm_layout, layout)
        page = dataclasses.replace(geometry, num_kv_heads=total)
        check_layout(self.client.layout, page, self.config.pool, order, self.rank.shards)
        self.heads = heads
        pool, model = self.client.kv_caches[0].device, ordered[0].device
        if model != pool:
            log.info(
                "kvcore: pool on %s, vLLM on %s: pages cross devices on each copy", pool, model
            )
        self._blocks = [block_view(cache, layout) for cache in ordered]
        names = sorted(caches, key=extract_layer_index)
        self._layer_groups = [self.groups.layer_group.get(name, 0) for name in names]
        self._block_side = Side.of(self._blocks) if model.type == "cpu" else None
        if self._runs() is None:
            log.info(
                "kvcore: pool %r in order %s, vLLM's %s cache in %s: pages copy strided; "
                "a pool of order=%s copies each page as one run",
                self.config.pool,
                self.client.layout.order,
                layout,
                vllm_layout,
                order,
            )

    def load(self, plan: StepPlan) -> None:
        """Copy the plan's hit pages into vLLM's blocks, every layer, before the forward;
        on a pool that is not the plan's, or a mapping fenced meanwhile, report them
        failed instead (and skip the plan's saves)."""
        self._fail(plan.fail_blocks)
        self._recv[1].update(plan.fail_recv)
        if not plan.load_pages:
            return
        if not self._maps(plan.epoch):
            self._refuse(plan)
            return
        start = time.perf_counter()
        pages = self._copy(plan, save=False)
        _sync(self._blocks[0].device)
        self._count("load", pages, time.perf_counter() - start)
        if self.client.lease_lost:  # fenced while copying: what was read may be scratch
            self._refuse(plan)
            return
        self._recv[0].update(plan.recv)
        self.stats.add("loaded_pages", len(plan.load_pages))

    def save(self, plan: StepPlan) -> None:
        """Copy the plan's new full pages out of vLLM and report them saved once the
        copy is complete (commit after write). On a CPU the copy is done on return; on
        a GPU it is queued on the current stream (anything that later reuses the
        blocks runs after it) and reported one step later (:meth:`take_report`): the
        step itself never waits for it."""
        saved: dict[Ticket, int] = {}  # what kvcore holds once the copy is complete
        pending: torch.cuda.Event | None = None
        if plan.save_pages and plan.step != self._refused_step and self._maps(plan.epoch):
            start = time.perf_counter()
            pages = self._copy(plan, save=True) if self.heads.writes else 0  # else a replica's
            self._count("save", pages, time.perf_counter() - start)
            if self._pool_device.type == "cuda":
                pending = torch.cuda.Event()  # type: ignore[no-untyped-call]
                # the pool's device: its stream runs the scatter (another GPU than vLLM's
                # for a TP rank whose stage's shard is elsewhere)
                pending.record(torch.cuda.current_stream(self._pool_device))
            if not self.client.lease_lost:  # a fenced mapping took scratch: never commit it
                saved = plan.saved
                self.stats.add("saved_pages", len(plan.save_pages))
        if not plan.requests:
            return
        report = StepReport([plan.step], dict(saved), list(plan.requests))
        if pending is not None:
            self._step_saves.append((pending, report))
        else:
            self._merge(report)

    def take_report(self) -> StepReport | None:
        """The steps finished since the last call. A GPU save is reported by the call
        after the one of its step (its copy waited for then, long done): every
        tensor-parallel rank reports the same steps at the same call, so the
        scheduler's min over ranks (StepReport.aggregate) never commits a page one
        rank has not copied yet."""
        for event, earlier in self._unsynced:
            event.synchronize()
            self._merge(earlier)
        self._unsynced, self._step_saves = self._step_saves, []
        report, self._report = self._report, StepReport()
        return report if report.steps else None

    def _merge(self, report: StepReport) -> None:
        self._report.steps += report.steps
        self._report.saved.update(report.saved)
        self._report.requests += report.requests

    def _copy(self, plan: StepPlan, save: bool) -> int:
        """Copy the plan's pages, pool -> vLLM's blocks (loads) or back (saves), per KV
        cache group less the pages it holds no block of: as byte runs where both sides
        allow (:mod:`.runs`), else one :class:`~.pages.PageCopy` per group, run on each of
        its layers. Returns the pages copied, summed over layers."""
        pages = plan.save_pages if save else plan.load_pages
        sides = self._runs()
        kv = self._pool_layers()
        copied = 0
        for g in range(self.groups.count):
            layers = [i for i, group in enumerate(self._layer_groups) if group == g]
            blocks = plan.blocks(g, save)
            pairs = [(p, b) for p, b in zip(pages, blocks, strict=True) if b != NO_BLOCK]
            copied += len(pairs) * len(layers)
            if not pairs or not layers:
                continue
            if sides is None:
                self._copy_strided(kv, layers, pairs, save)
            elif save:
                ByteRuns.plan(sides[1], sides[0], layers, [(b, p) for p, b in pairs]).run()
            else:
                ByteRuns.plan(sides[0], sides[1], layers, pairs).run()
        return copied

    def _copy_strided(
        self,
        kv: list[torch.Tensor],
        layers: list[int],
        pairs: list[tuple[int, int]],
        save: bool,
    ) -> None:
        """One :class:`~.pages.PageCopy` of ``pairs`` (pool page, vLLM block) between
        ``kv`` (the pool's layers, this rank's heads) and vLLM's blocks, run on each of
        ``layers``: slices of adjacent pages on the CPU, a gather and a scatter on a GPU."""
        ps, bs = [p for p, _ in pairs], [b for _, b in pairs]
        pool, model = self._pool_device, self._blocks[0].device
        if save:
            copy = PageCopy.plan(bs, ps, model, pool)
            for layer in layers:
                copy.run(self._blocks[layer], kv[layer])
        else:
            copy = PageCopy.plan(ps, bs, pool, model)
            for layer in layers:
                copy.run(kv[layer], self._blocks[layer])

    def _runs(self) -> tuple[Side, Side] | None:
        """The pool's and vLLM's sides where pages copy as byte runs (both in CPU memory,
        a page of a layer the same dense bytes on both); None: strided copies."""
        block_side = self._block_side
        if block_side is None:
            return None
        pool_side = self._mapped()[1]
        if pool_side is None or not pool_side.runs_with(block_side):
            return None
        return pool_side, block_side

    def _pool_layers(self) -> list[torch.Tensor]:
        """The mapped pool's layers ``[P, parts, N, H, D]``, of this rank's heads only
        (views, ``H`` = ``self.heads.count``)."""
        return self._mapped()[0]

    def _mapped(self) -> tuple[list[torch.Tensor], Side | None]:
        """The mapped pool's layers of this rank's heads and, in CPU memory, their
        :class:`~.runs.Side` (None: they copy strided); computed once per mapping (a new
        one: attached again, other addresses, maybe another order)."""
        kv = self.client.kv_caches
        mapped, views, side = self._mapping
        if mapped is not kv:
            first, count = self.heads.first, self.heads.count
            views = kv if self.heads.whole else [t[:, :, :, first : first + count] for t in kv]
            side = Side.of(views) if views and views[0].device.type == "cpu" else None
            self._mapping = (kv, views, side)
        return views, side

    def _count(self, what: str, pages: int, seconds: float) -> None:
        """Add one step's ``what`` ("load" or "save") copies to the stats: ``pages``
        pages of one layer each (summed over layers, this rank's heads), and the seconds
        they took."""
        page_bytes = self._pool_layers()[0][0].nbytes  # this rank's heads of a page, a layer
        self.stats.add(f"{what}_bytes", pages * page_bytes)
        self.stats.add(f"{what}_copy_s", seconds)

    @property
    def _pool_device(self) -> torch.device:
        return self.client.kv_caches[0].device

    def take_stats(self) -> KvcoreStats | None:
        """The copies' counters since the last call (vLLM's ``get_kv_connector_stats``,
        after every step); None when nothing happened."""
        return self.stats.take()

    def take_recv(self) -> tuple[set[str], set[str]]:
        """Hybrid engines' requests whose loads ran since the last call, and those
        whose loads failed (vLLM wants both as finished, the failed also as failed)."""
        done, failed = self._recv
        self._recv = (set(), set())
        return done | failed, failed

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self) -> None:
        self.client.close()

    def _fail(self, blocks: list[int]) -> None:
        self._failed_blocks.update(blocks)
        self.stats.add("failed_load_pages", len(blocks))

    def _refuse(self, plan: StepPlan) -> None:
        """The plan's loads did not run (or read a fenced mapping): vLLM recomputes their
        blocks, and the plan's saves are skipped (they may hold K/V computed from them)."""
        if plan.recv:  # a hybrid engine's loads: failed by request
            self._recv[1].update(plan.recv)
        else:
            self._fail(plan.load_blocks)
        self._refused_step = plan.step

    def _maps(self, epoch: int) -> bool:
        """Whether the pool mapped now is the one of ``epoch`` (attaching again first if
        ``epoch`` is not one this worker left behind, or the lease was lost)."""
        if epoch in self._retired:
            return False
        before = self._reconnect.attachment.epoch
        if epoch != before:  # a daemon newer than the one mapped
            self._reconnect.stale()
        if not self._reconnect.ready():
            return False
        now = self._reconnect.attachment.epoch
        for left in {before, epoch} - {now}:  # never to be mapped again: refuse at once
            self._retired[left] = None
        while len(self._retired) > RETIRED_EPOCHS:
            self._retired.popitem(last=False)
        return epoch == now


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
