"""Pools: a memory region, the Manager of its pages, and the numbering of its events.

The Manager does no I/O: it queues page events, and :meth:`PoolTable.publish`
drains every pool's queue after each request (or batch) into one
:class:`~kvcore_ipc.messages.EventBatch` per pool, numbered on from the pool's
last event. Numbers are kept per pool *name* for the whole epoch, so a pool
that is closed and created again goes on counting (a subscriber never sees a
number twice in one epoch). Closing a pool publishes a ``removed`` event for
every page still in its prefix index. One published message carries at most
:data:`MAX_EVENTS_PER_MESSAGE` events (a larger batch is split, numbers
continuing), so the bytes buffered for a slow subscriber are bounded by its
high-water mark in messages.

A pool whose configuration declares lower tiers (kvcore.config.TierConfig) is served
by a :class:`~.tiering.TieredManager` over its memory (a kept pool's too:
:meth:`PoolTable.adopt`): the handler calls it like any Manager;
:meth:`Pool.tier_stats` gives its counters per medium.

A pool of ``shards`` > 1 (tensor parallelism: one shard a rank) has that many regions
of its layout and still one Manager: page p is page p of every shard, so one prefix
index and one set of quotas serve all ranks, and a page is as valid as the ranks that
wrote it (the connector commits only what every rank saved). Host shards are separate
segments; CUDA shard i lies on the i-th GPU after the configured one.

Host segments are named ``<segment_prefix>-<pid>-<random>``: the prefix is
derived from the daemon's endpoint, so a daemon started on the same endpoint
finds and removes what a killed one left (:func:`kvcore_ipc.memory.sweep`).
"""

from __future__ import annotations

import dataclasses
import logging
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcore_ipc import messages as msg
from kvcore_ipc.events import Publisher
from kvcore_ipc.memory import CudaRegion, HostRegion

from kvcore.config import MAX_SHARDS, TierConfig
from kvcore.errors import BadRequest, UnknownPool
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.hits import Histogram
from kvcore.layout import KVLayout
from kvcore.manager import Manager, PageManager
from kvcore.prefix import PageEvent, PageRemoved, PageStored

from .restart import Kept
from .tiering import TieredManager, open_stack

log = logging.getLogger(__name__)

MAX_EPHEMERAL_BYTES = 1 << 30
MAX_EPHEMERAL_PAGES = 1 << 20
MAX_EVENTS_PER_MESSAGE = 256  # a stored event is < 100 bytes: a message stays < 32 KiB
MAX_EVENT_MESSAGE_BYTES = 32 << 10


@dataclass(slots=True, eq=False)
class Pool:
    """One served pool. ``manager`` is changed only by the request handler."""

    name: str
    device: str  # "cpu" or "cuda:N"
    manager: PageManager  # a Manager, or a TieredManager holding one
    regions: list[HostRegion | CudaRegion]  # one per shard, each of ``layout``
    ephemeral: bool = False  # created by an attach; closed when its last session leaves
    kept: Kept | None = None  # kept across restarts (kvcore.daemon.restart): host regions

    @property
    def layout(self) -> KVLayout:
        """The layout of one shard."""
        return self.manager.layout

    @property
    def shards(self) -> int:
        return len(self.regions)

    @property
    def region(self) -> HostRegion | CudaRegion:
        """Shard 0's region (the only one of an unsharded pool)."""
        return self.regions[0]

    @property
    def total_bytes(self) -> int:
        """Bytes of every shard together."""
        return self.layout.total_bytes * self.shards

    def memory(self, shard: int) -> msg.Memory:
        """The wire description of ``shard``'s region; BadRequest past the last shard."""
        if not 0 <= shard < self.shards:
            raise BadRequest(
                f"pool {self.name!r} has {self.shards} shard(s) (0 to {self.shards - 1}); "
                f"no shard {shard}"
            )
        return self.regions[shard].describe()

    def host_regions(self) -> list[HostRegion]:
        return [region for region in self.regions if isinstance(region, HostRegion)]

    def close_regions(self) -> None:
        """Unmap the pool's memory: unlinked, or kept for the next daemon if ``kept``."""
        if self.kept is not None:
            self.kept.close(self.host_regions())
            return
        for region in self.regions:
            region.close()

    def layout_message(self) -> msg.PoolLayout:
        return msg.PoolLayout(**self.layout.to_dict())

    def hit_stats(
        self, sees: Callable[[str], bool]
    ) -> tuple[list[msg.NamespaceHits], list[msg.PrefixHeat]]:
        """The pool's hits per namespace and its busiest prefixes (hit tokens first), of
        the namespaces ``sees`` (a requester's grant) only; the "(other)" row needs a
        grant of every namespace."""
        book = self.manager.hits
        namespaces = [
            msg.NamespaceHits(ns, count.query_tokens, count.by_medium())
            for ns, count in sorted(book.namespaces.items())
            if sees(ns)
        ]
        ranked = sorted(book.busiest.items(), key=lambda item: -item[1].hit_tokens)
        busiest = [
            msg.PrefixHeat(count.namespace, key, count.hit_tokens, count.hits)
            for key, count in ranked
            if sees(count.namespace)
        ]
        return namespaces, busiest

    def tier_stats(self) -> list[msg.TierStats]:
        """Counters of the pool's lower tiers, top down ([] without tiers)."""
        manager = self.manager
        if not isinstance(manager, TieredManager):
            return []
        stats = []
        for medium, counters in manager.tier_stats().items():
            took = manager.promotions.get(medium) or Histogram()
            stats.append(
                msg.TierStats(
                    medium=medium,
                    **dataclasses.asdict(counters),
                    promote_bounds_s=list(took.bounds),
                    promote_counts=list(took.counts),
                    promote_s=took.sum_s,
                )
            )
        return stats


class PoolTable:
    """The daemon's pools by name, and their event streams."""

    __slots__ = ("_publisher", "_seq_no", "epoch", "pools", "segment_prefix")

    def __init__(
        self, epoch: int, publisher: Publisher | None, segment_prefix: str = "kvcore"
    ) -> None:
        self.epoch = epoch
        self.segment_prefix = segment_prefix
        self.pools: dict[str, Pool] = {}
        self._publisher = publisher
        self._seq_no: dict[str, int] = {}  # pool name -> seq_no of its last event (this epoch)

    def get(self, name: str) -> Pool:
        pool = self.pools.get(name)
        if pool is None:
            raise UnknownPool(f"no pool {name!r}; serving {sorted(self.pools)}")
        return pool

    def open(
        self,
        name: str,
        device: str,
        layout: KVLayout,
        *,
        ephemeral: bool = False,
        group: str = "",
        tiers: TierConfig | None = None,
        shards: int = 1,
        eviction: str = DEFAULT_EVICTION,
    ) -> Pool:
        """Create the pool's memory (``shards`` regions of ``layout``) and Manager.
        BadRequest if the name is taken or a CUDA shard has no GPU. A host segment is mode
        0600 (the daemon's user), or 0660 of ``group`` if given (tenants of other uids in
        that group can map it). With ``tiers`` that declare any tier, the Manager is a
        TieredManager over the pool's memory (one shard only)."""
        if name in self.pools:
            raise BadRequest(f"pool {name!r} exists")
        if not 1 <= shards <= MAX_SHARDS:
            raise BadRequest(f"a pool has 1 to {MAX_SHARDS} shards, not {shards}")
        if ephemeral and (
            layout.total_bytes * shards > MAX_EPHEMERAL_BYTES
            or layout.num_pages > MAX_EPHEMERAL_PAGES
        ):
            raise BadRequest("ephemeral pools are limited to 1 GiB and 2**20 pages")
        tiered = tiers is not None and tiers.enabled
        if tiered and shards > 1:
            raise BadRequest(f"pool {name!r}: lower tiers serve pools of one shard only")
        regions = self._create_regions(device, layout.total_bytes, shards, group)
        manager: PageManager = Manager(layout, eviction=eviction)
        if tiered:
            assert tiers is not None
            try:
                stack = open_stack(layout, tiers, name, eviction)
            except BaseException:
                _close_all(regions)
                raise
            memory = regions[0].as_tensor()
            manager = TieredManager(layout, memory, stack, eviction=eviction)
        pool = Pool(name, device, manager, regions, ephemeral)
        self.pools[name] = pool
        return pool

    def adopt(self, name: str, regions: list[HostRegion], manager: PageManager, kept: Kept) -> Pool:
        """Serve a host pool kvcore.daemon.restart made or re-adopted (its regions and
        Manager, or TieredManager over one, kept across restarts). BadRequest if the
        name is taken."""
        if name in self.pools:
            raise BadRequest(f"pool {name!r} exists")
        pool = Pool(name, "cpu", manager, list(regions), kept=kept)
        self.pools[name] = pool
        return pool

    def kept_segments(self) -> list[str]:
        """The segments of every kept pool (its regions, its index table, its host tier's)."""
        names: list[str] = []
        for pool in self.pools.values():
            if pool.kept is not None:
                names += [region.name for region in pool.host_regions()]
                names += pool.kept.segments
        return names

    def release_withheld(self, mappers: Callable[[str], Counter[int]], now: float) -> None:
        """Free each kept pool's withheld pages once their release is due
        (kvcore.daemon.restart.Kept.release_due; ``mappers``: SessionTable.mappers)."""
        for pool in self.pools.values():
            kept = pool.kept
            if kept is not None and kept.release_due(pool.host_regions(), mappers(pool.name), now):
                manager = pool.manager
                if isinstance(manager, TieredManager):
                    manager = manager.manager
                assert isinstance(manager, Manager), "a kept pool's Manager"
                freed = manager.release_withheld()
                kept.withheld_until = 0.0
                log.info("pool %r: %d withheld pages released", pool.name, freed)

    def _create_regions(
        self, device: str, size: int, shards: int, group: str
    ) -> list[HostRegion | CudaRegion]:
        """``shards`` regions of ``size`` bytes each (host: one segment each; cuda: shard
        i on GPU base + i), or none: a failure closes those already made."""
        devices = shard_devices(device, shards)
        regions: list[HostRegion | CudaRegion] = []
        try:
            for where in devices:
                if where == "cpu":
                    host = HostRegion.create(size, self.segment_prefix)
                    regions.append(host)
                    if group:
                        host.share_with_group(group)
                else:
                    regions.append(CudaRegion.create(size, where))
        except BaseException:
            _close_all(regions)
            raise
        return regions

    def close(self, name: str) -> None:
        """Remove a pool: publish its pending events and a removal of every cached page,
        then unlink its memory."""
        pool = self.pools.pop(name)
        removed = [PageRemoved(entry.key, entry.page) for entry in pool.manager.prefix_snapshot()]
        self._send(name, [*pool.manager.take_events(), *removed])
        if isinstance(pool.manager, TieredManager):  # a kept pool keeps its own pages
            pool.manager.close(pool_pages=pool.kept is None)
        pool.close_regions()

    def close_all(self) -> None:
        for name in list(self.pools):
            self.close(name)

    def publish(self) -> None:
        """Publish what each pool's Manager queued since the last call (one message a pool)."""
        for pool in self.pools.values():
            events = pool.manager.take_events()
            if events:
                self._send(pool.name, events)

    def last_seq_no(self, name: str) -> int:
        return self._seq_no.get(name, 0)

    def snapshot(self, pool: Pool) -> msg.SnapshotOk:
        """The pool's prefix index as of its last published event."""
        self.publish()  # so that seq_no covers every change the snapshot shows
        pages = [
            msg.SnapshotPage(entry.key, entry.parent_key, entry.page)
            for entry in pool.manager.prefix_snapshot()
        ]
        return msg.SnapshotOk(self.epoch, self.last_seq_no(pool.name), pages)

    def check_integrity(self) -> None:
        """Assert every pool's Manager invariants."""
        for pool in self.pools.values():
            pool.manager.check_integrity()

    def _send(self, name: str, events: Sequence[PageEvent]) -> None:
        """Number ``events`` on from the pool's last one; publish them if events are on
        (converted to the wire's form only then: a re-adopted pool queues one a page)."""
        if not events:
            return
        first = self._seq_no.get(name, 0) + 1
        self._seq_no[name] = first + len(events) - 1
        if self._publisher is not None:
            for i in range(0, len(events), MAX_EVENTS_PER_MESSAGE):
                chunk = [_wire(e) for e in events[i : i + MAX_EVENTS_PER_MESSAGE]]
                self._publisher.publish(msg.EventBatch(name, self.epoch, first + i, chunk))


def shard_devices(device: str, shards: int) -> list[str]:
    """The device of each shard: "cpu" for all of a host pool; ``cuda:N`` .. ``cuda:N+shards-1``
    for a GPU pool, BadRequest (with the counts) if this machine has fewer GPUs."""
    if device == "cpu":
        return ["cpu"] * shards
    base = int(device.removeprefix("cuda:"))
    if shards > 1:
        import torch

        have = torch.cuda.device_count()
        if base + shards > have:
            raise BadRequest(
                f"a pool of {shards} shards on {device} needs GPUs {base} to "
                f"{base + shards - 1}; this machine has {have}"
            )
    return [f"cuda:{base + i}" for i in range(shards)]


def _close_all(regions: list[HostRegion | CudaRegion]) -> None:
    for region in regions:
        region.close()


def _wire(event: PageEvent) -> msg.Event:
    if isinstance(event, PageStored):
        tokens = array("I", event.tokens)  # u32 little-endian (the host's order, checked)
        return msg.PageStoredEvent(
            event.key,
            event.parent_key,
            event.page,
            tokens.tolist(),
            event.space.namespace or "",
            medium=event.medium,
            lora=event.space.lora,
            salt=event.space.salt,
            model=event.space.model,
        )
    return msg.PageRemovedEvent(event.key, event.page, medium=event.medium)
