"""TierStack: the lower tiers of one pool, top down, as the daemon drives them.

::

    pool  --evict-->  host  --its LRU spills-->  disk  --its LRU drops-->  (gone)
    pool  --commit (background publish)------------------------------->  remote
    lookup/allocate: pool hits, then runs of the chain found below, top down:
        keys   k0 k1 k2 | k3 k4 | k5 | k6 k7 k8 | k9 ...
        where  pool     | host  | disk| remote  | miss  -> promote k3..k8 into pool pages

There is no second index to keep in step: each tier answers for its own keys
(O(1) per key locally, one batched call for the remote store), so "where does
this key live" is :meth:`TierStack.locate`; the runs it finds are brought into pool
pages by :class:`kvcore.daemon.tiering.TieredManager` (around ``Manager.adopt``).
Not thread-safe (the daemon's thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcore.errors import BadRequest
from kvcore.tiers.base import Tier, TierKey, TierStats
from kvcore.tiers.disk import DiskTier
from kvcore.tiers.host import HostTier
from kvcore.tiers.remote import RemoteTier
from kvcore.tiers.transfer import gather_pages

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive keys of a chain, from ``start``, held by ``tier``."""

    tier: Tier
    start: int
    count: int


class TierStack:
    """host / disk / remote below one pool; any of them may be absent."""

    def __init__(
        self,
        host: HostTier | None = None,
        disk: DiskTier | None = None,
        remote: RemoteTier | None = None,
    ) -> None:
        present: list[Tier] = [t for t in (host, disk, remote) if t is not None]
        if len({t.fingerprint for t in present}) > 1:
            raise BadRequest("the tiers of one pool must share its layout")
        self.host, self.disk, self.remote = host, disk, remote
        self._local: list[Tier] = [t for t in (host, disk) if t is not None]

    def spill(self, keys: Sequence[TierKey], pages: torch.Tensor) -> None:
        """Pages the pool evicts, as a batch (``[n, *stored_page_shape]``, on the CPU):
        into the host tier, whose own evictions go to the disk tier (or straight to disk)."""
        if self.host is not None:
            spilled = self.host.put_spill(keys, pages)
            keys, pages = spilled.keys, spilled.pages
        if self.disk is not None and keys:
            self.disk.put_many(keys, pages)

    def spill_from(
        self, keys: Sequence[TierKey], pool: torch.Tensor, page_ids: Sequence[int]
    ) -> None:
        """:meth:`spill` of pool pages ``page_ids`` read from the pool's rows ``pool``
        (KVLayout.pages_view) while they still hold them: copied straight into host
        slots (each byte once, no batch); only what goes to disk becomes a batch."""
        if self.host is not None:
            spilled = self.host.spill_from(keys, pool, page_ids)
            if self.disk is not None and spilled.keys:
                self.disk.put_many(spilled.keys, spilled.pages)
        elif self.disk is not None and keys:
            self.disk.put_many(keys, gather_pages(pool, page_ids, device="cpu"))

    def locate(self, keys: Sequence[TierKey], *, remote: bool = True) -> list[Run]:
        """Runs covering the longest leading part of ``keys`` held below the pool, top
        tier first at every position; the remote store is asked once, for the rest
        (``remote=False``: local tiers only, no network). Read-only."""
        runs: list[Run] = []
        start = 0
        while start < len(keys):
            for tier in self._local:
                count = tier.match(keys[start:])
                if count:
                    runs.append(Run(tier, start, count))
                    start += count
                    break
            else:
                break
        if remote and self.remote is not None and start < len(keys):
            count = self.remote.match(keys[start:])
            if count:
                runs.append(Run(self.remote, start, count))
        return runs

    def stats(self) -> dict[str, TierStats]:
        """Counters per medium ("host", "disk", "remote") of the tiers present."""
        tiers: list[Tier] = [t for t in (self.host, self.disk, self.remote) if t is not None]
        return {tier.medium: tier.stats() for tier in tiers}

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()
