"""A host pool kept across daemon restarts: re-adopted at start, kept at stop.

With ``restore`` on (the default; ``--no-restore``, ``restore = false``,
``KVCORE_RESTORE=0`` turn it off), a configured host pool (with lower tiers or
without) lives in segments that outlive the daemon (untracked:
``HostRegion.create(tracked=False)``), beside an index table
(kvcore.daemon.index_table) in one more segment that only the daemon maps, recorded in
the pool's manifest (kvcore.daemon.restore). A daemon started on the same endpoint
then re-adopts them, however the last one ended:

1. :func:`reopen_pool` checks the manifest and reopens the segments (or decides a cold
   start, with a reason naming the object and the setting);
2. :meth:`IndexTable.open` checks the table's header against the pool's settings and
   scans it: only committed pages whose key is their tokens' come back, as cached
   (evictable) pages, oldest first (``Manager.restore``, which queues their
   ``stored`` events: routers learn them at the first tick);
3. every other page is withheld, and no page is evicted (``Manager.withhold_free``): a
   process that attached to the last daemon may still write pages nobody committed
   through its old mapping, and read the re-adopted ones as the hits that daemon
   granted (so none may go to a writer; they are hits as usual meanwhile).
   :meth:`Kept.release_due` frees them once every process's mappings of the segments
   are its current sessions' (kvcore.daemon.mappings: a client fences its old mapping
   at the first StaleEpoch), or ``fence_timeout_s`` after the start, whichever comes
   first; a pool shared with a group waits for the timeout (its other users' mappings
   cannot be read).

At a clean stop the daemon marks the table clean and keeps the segments and the
manifest (:meth:`Kept.close`); a cold start or ``restore`` off unlinks them.
Ephemeral and CUDA pools are not kept (a CUDA allocation dies with its process):
they start empty.

A tiered pool (kvcore.daemon.tiering) keeps its pool the same way; a page it
promotes from a tier is PENDING in the table until its bytes are copied in. Its host
tier is kept too, however the daemon ended: its slots and their slot table
(kvcore.tiers.host_table) live in one more untracked segment only the daemon maps,
named in the manifest with the settings that fix its bytes (capacity, page bytes,
layout fingerprint); a change there, or a table the tier does not recognise, starts
the host tier alone empty (logged, the old segment unlinked). A host tier that does
not fit /dev/shm's free space is the daemon's private memory instead (logged: lost at
a kill). Neither the kept host tier nor the pool's pages are written down to the disk
tier at a clean stop: they come back themselves, and copies would only push out disk
entries held nowhere else. The disk tier keeps its entries across restarts on its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvcore_ipc.shm import HostRegion

from kvcore.config import PoolConfig
from kvcore.errors import RestoreRefused
from kvcore.manager import Manager, PageManager
from kvcore.tiers import HostTier
from kvcore.tiers.host_table import segment_bytes

from .index_table import IndexTable, MirroredIndex
from .mappings import segment_mappings, stale_mappers
from .restore import (
    ColdStart,
    Readopted,
    host_tier_settings,
    manifest_for,
    manifest_path,
    remove_manifest,
    reopen_pool,
    settings_of,
    write_manifest,
)
from .tiering import TieredManager, open_stack

log = logging.getLogger(__name__)


def keeps(pool: PoolConfig) -> bool:
    """Whether ``pool`` (a configured one) can outlive the daemon: host memory."""
    return pool.device == "cpu"


def settings_digest(pool: PoolConfig) -> bytes:
    """SHA-256 of the settings that fix the pool's pages (restore.settings_of)."""
    return hashlib.sha256(json.dumps(settings_of(pool), sort_keys=True).encode()).digest()


@dataclass(slots=True, eq=False)
class Kept:
    """What keeps one host pool across restarts: its index table, the table's segment,
    its manifest, and when its withheld pages are freed whatever still maps them."""

    table: IndexTable
    index: HostRegion  # the table's segment: the daemon's alone (0600), never described
    manifest: Path
    group: str  # the pool's group ("" for none): others' mappings cannot be read
    withheld_until: float = 0.0  # time.monotonic(); 0: nothing withheld
    host: HostTier | None = None  # the pool's host tier, if kept (lives in host_region)
    host_region: HostRegion | None = None  # its segment: the daemon's alone (0600)

    @property
    def segments(self) -> list[str]:
        """The segments besides the pool's shards: the index table, the host tier's."""
        extra = [] if self.host_region is None else [self.host_region.name]
        return [self.index.name, *extra]

    def release_due(self, regions: list[HostRegion], mappers: Counter[int], now: float) -> bool:
        """Whether the withheld pages may be freed now: no process maps ``regions``
        through a mapping that ``mappers`` (pid -> its sessions that said they map the
        pool) does not account for, or the deadline passed. Reads /proc: call it a few
        times a second at most."""
        if not self.withheld_until:
            return False
        if now >= self.withheld_until:
            return True
        if self.group:
            return False
        for region in regions:
            found = segment_mappings(region.name)
            if found is None or stale_mappers(found, mappers):
                return False
        return True

    def close(self, regions: list[HostRegion]) -> None:
        """A clean stop: the table marked clean, every segment and the manifest kept."""
        self.table.mark_clean()
        self.table.close()
        self.index.close(unlink=False)
        if self.host is not None:
            self.host.settle()
        if self.host_region is not None:
            self.host_region.close(unlink=False)
        for region in regions:
            region.close(unlink=False)


def forget(pool: PoolConfig, prefix: str) -> None:
    """This start of ``pool`` is cold (``restore`` off, or a pool not kept): the manifest
    a kept pool of the same name left goes (its segments: the sweep's)."""
    if remove_manifest(manifest_path(prefix, pool.name)):
        log.info("pool %r: starting empty (restore off or a pool not kept)", pool.name)


def open_kept(
    pool: PoolConfig, prefix: str, epoch: int, fence_s: float
) -> tuple[list[HostRegion], PageManager, Kept]:
    """``pool``'s regions (one per shard) and its Manager (a TieredManager over it if
    the pool has tiers): re-adopted from what the last daemon of the endpoint with
    segment prefix ``prefix`` left, or created empty; the manifest written for this
    daemon (``epoch``). Logs which, and why. If the tiers cannot open, the regions and
    the table are closed, kept, and the error raised."""
    regions, manager, kept = _open_pool(pool, prefix, epoch, fence_s)
    if not _tiered(pool):
        return regions, manager, kept
    try:
        stack = open_stack(manager.layout, pool.tiers, pool.name, pool.eviction, host=kept.host)
    except BaseException:
        kept.close(regions)
        raise
    memory = regions[0].as_tensor()  # one shard: PoolConfig.validate
    tiered = TieredManager(
        manager.layout,
        memory,
        stack,
        eviction=pool.eviction,
        manager=manager,
        placed=kept.table.placed,
    )
    return regions, tiered, kept


def _open_pool(
    pool: PoolConfig, prefix: str, epoch: int, fence_s: float
) -> tuple[list[HostRegion], Manager, Kept]:
    """:func:`open_kept` up to the Manager (re-adopted or empty)."""
    layout = pool.layout()
    digest = settings_digest(pool)
    path = manifest_path(prefix, pool.name)
    decision = reopen_pool(pool, prefix)
    if isinstance(decision, Readopted):
        if decision.index is None:
            decision.close(unlink=True)
            decision = ColdStart(f"pool {pool.name!r}: no index table: starting empty", [])
        else:
            index, started = decision.index, time.monotonic()
            try:
                table = IndexTable.open(
                    index.buffer(),
                    num_pages=layout.num_pages,
                    page_size=layout.page_size,
                    settings_digest=digest,
                )
            except RestoreRefused as exc:
                names = decision.names
                decision.close(unlink=True)
                remove_manifest(path)
                decision = ColdStart(f"pool {pool.name!r}: {exc}: starting empty", names)
            else:
                manager = _manager(pool, table)
                manager.restore(table.opened.entries)
                withheld = manager.withhold_free()  # and no eviction, until released
                kept = Kept(table, index, path, pool.group)
                kept.withheld_until = time.monotonic() + fence_s
                try:
                    kept.host_region, kept.host = _host_tier(
                        pool, prefix, decision.host_tier, decision.host_note
                    )
                    write_manifest(
                        path,
                        manifest_for(pool, decision.regions, epoch, index, kept.host_region),
                    )
                except BaseException:
                    kept.close(list(decision.regions))
                    raise
                dropped = sum(table.opened.dropped.values())
                log.info(
                    "pool %r: re-adopted %d committed pages of %s in %.3f s (%s stop; %d "
                    "dropped: %s); %d pages withheld, and none evicted, until the last "
                    "daemon's clients let go",
                    pool.name,
                    len(table.opened.entries),
                    decision.regions[0].name,
                    time.monotonic() - started,
                    "clean" if table.was_clean else "unclean",
                    dropped,
                    dict(table.opened.dropped) or "none",
                    withheld,
                )
                return list(decision.regions), manager, kept
    log.info("%s", decision.reason)
    return _create(pool, prefix, epoch, digest, path)


def _create(
    pool: PoolConfig, prefix: str, epoch: int, digest: bytes, path: Path
) -> tuple[list[HostRegion], Manager, Kept]:
    """A new kept pool: untracked segments, an empty table, the manifest."""
    layout = pool.layout()
    made: list[HostRegion] = []
    try:
        for _ in range(pool.shards):
            made.append(HostRegion.create(layout.total_bytes, prefix, tracked=False))
            if pool.group:
                made[-1].share_with_group(pool.group)
        size = IndexTable.size_for(layout.num_pages, layout.page_size)
        index = HostRegion.create(size, prefix, tracked=False)
        made.append(index)
        table = IndexTable.create(
            index.buffer(),
            num_pages=layout.num_pages,
            page_size=layout.page_size,
            settings_digest=digest,
        )
        regions = made[: pool.shards]
        host_region, host = _host_tier(pool, prefix, None, "", reserve=pool.total_bytes())
        if host_region is not None:
            made.append(host_region)
        write_manifest(path, manifest_for(pool, regions, epoch, index, host_region))
    except BaseException:
        for region in made:
            region.close(unlink=True)
        raise
    kept = Kept(table, index, path, pool.group, host=host, host_region=host_region)
    return regions, _manager(pool, table), kept


def _host_tier(
    pool: PoolConfig, prefix: str, old: HostRegion | None, note: str, *, reserve: int = 0
) -> tuple[HostRegion | None, HostTier | None]:
    """The pool's host tier and the segment it lives in: ``old`` (a re-adopted segment)
    with the entries its slot table vouches for, or a new, empty one (``note``: why,
    logged); (None, None) if the pool declares no host tier, or if /dev/shm has no
    room for a new segment besides ``reserve`` bytes (segments just made, not yet
    touched): then open_stack makes the tier in private memory (logged)."""
    settings = host_tier_settings(pool)
    if settings is None:
        if old is not None:
            old.close(unlink=True)
        return None, None
    layout, capacity = pool.layout(), int(settings["capacity_pages"])
    if old is not None:
        started = time.monotonic()
        try:
            tier = HostTier(
                layout, capacity, eviction=pool.eviction, segment=old.as_tensor(), restore=True
            )
        except RestoreRefused as exc:
            old.close(unlink=True)
            note = str(exc)
        else:
            log.info(
                "pool %r: host tier re-adopted %d entries of %s in %.3f s (%d dropped: %s)",
                pool.name,
                tier.restored,
                old.name,
                time.monotonic() - started,
                sum(tier.dropped.values()),
                dict(tier.dropped) or "none",
            )
            return old, tier
    if note:
        log.info("pool %r: %s: starting the host tier empty", pool.name, note)
    size = segment_bytes(capacity, layout.page_bytes)
    room = _shm_free()
    if room is not None and size > room - reserve:
        log.warning(
            "pool %r: the host tier needs %d bytes of /dev/shm, %d free: it is kept in the "
            "daemon's private memory instead, and lost at a kill",
            pool.name,
            size,
            room - reserve,
        )
        return None, None
    region = HostRegion.create(size, prefix, tracked=False)
    try:
        tier = HostTier(layout, capacity, eviction=pool.eviction, segment=region.as_tensor())
    except BaseException:
        region.close(unlink=True)
        raise
    return region, tier


def _shm_free(shm: str = "/dev/shm") -> int | None:
    """Bytes free in ``shm`` (None if there is no such filesystem)."""
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _manager(pool: PoolConfig, table: IndexTable) -> Manager:
    """An empty Manager of ``pool`` over ``table``; recording its evictions if the pool
    has tiers (the TieredManager that serves it spills them)."""
    index, tiered = MirroredIndex(table), _tiered(pool)
    return Manager(pool.layout(), eviction=pool.eviction, record_evictions=tiered, index=index)


def _tiered(pool: PoolConfig) -> bool:
    return pool.tiers.enabled
