"""TieredManager: a pool's Manager with lower tiers below it (docs/concepts.md, "Tiers").

The Manager stays I/O-free; this subclass does the I/O around its operations,
on the daemon's thread, before the reply, so ``op.serve(pool.manager, ...)``
in the handler is unchanged::

    allocate / lookup     pool match k0..k(m-1), then TierStack.locate(k(m)..)
        runs found below:  host | disk | remote      (disk/remote read and verified first)
        Manager.adopt      fresh pages indexed for those keys, one call per run;
                           pages it evicted are copied out (gather) before anything
                           is written into them
        promote            host: HostTier.promote (one copy per byte); disk/remote: scatter
        spill              the evicted pages' bytes -> host (-> disk): TierStack.spill
        then the Manager's own allocate, whose hit now covers the promoted pages
    extend                 the Manager's extend, then spill what it evicted
    commit                 the Manager's commit, then a copy of the newly indexed pages
                           queued for the remote store (published by its thread)
    close                  the host tier's entries and the pool's cached pages written
                           down to the disk tier (a new daemon on it serves them)

So an engine only ever sees ordinary pool pages, written and committed, and a
page evicted by a reply is in a lower tier before the engine can overwrite it.
A tier that misses (evicted since, corrupt, store down or slow) shortens the
run: counted in its TierStats, never an error to the engine. Units: pages
unless named bytes.

Events: the stored event of a promoted page carries the medium it came from;
the removed event of a spilled page carries the medium now holding it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvcore_ipc import messages as msg

from kvcore.allocator import PageId
from kvcore.errors import OutOfPages
from kvcore.layout import KVLayout
from kvcore.manager import DEFAULT_NAMESPACE, Allocation, Extension, Manager, PrefixHit
from kvcore.prefix import PageEvent, PageRemoved, PrefixKey, chain_keys, encode_tokens
from kvcore.tiers import DiskTier, HostTier, RemoteConfig, RemoteTier, TierStack, TierStats
from kvcore.tiers.base import layout_fingerprint, tier_keys
from kvcore.tiers.config import TierConfig
from kvcore.tiers.transfer import gather_pages, scatter_pages

if TYPE_CHECKING:
    import torch
    from prometheus_client.core import Metric


def open_stack(layout: KVLayout, config: TierConfig, pool: str) -> TierStack:
    """The tiers ``config`` declares for a pool of ``layout``. BadRequest if misdeclared."""
    config.validate(pool, layout.page_bytes)
    host_pages = config.host_bytes() // layout.page_bytes
    host = HostTier(layout, host_pages) if host_pages else None
    disk = DiskTier(layout, config.disk, config.disk_bytes()) if config.disk else None
    remote = None
    if config.remote_master:
        remote = RemoteTier(layout, RemoteConfig(
            config.remote_master, config.remote_metadata,
            local_hostname=config.remote_local_hostname, timeout_s=config.remote_timeout_s,
        ))  # fmt: skip
    return TierStack(host, disk, remote)


class TieredManager(Manager):
    """A Manager whose evictions spill to ``tiers`` and whose hits continue into them.

    ``views`` are the pool's layer views (``[num_pages, 2, page_size, H, D]`` each,
    over the pool's memory); only this class reads or writes them, and only on the
    daemon's thread. Not thread-safe.
    """

    def __init__(self, layout: KVLayout, views: Sequence[torch.Tensor], tiers: TierStack) -> None:
        super().__init__(layout, record_evictions=True)
        self.tiers = tiers
        self._views = list(views)
        self._fingerprint = layout_fingerprint(layout)
        self._spill_medium = (
            "host" if tiers.host is not None else "disk" if tiers.disk is not None else ""
        )
        self._moved: dict[PrefixKey, str] = {}  # spilled since the last take_events: medium

    # -- operations that may promote or evict -------------------------------------------

    def allocate(
        self, seq_id: int, tokens: Sequence[int], *, namespace: str = DEFAULT_NAMESPACE
    ) -> Allocation:
        self._check_new(seq_id)  # bad input fails before any I/O
        self._promote(tokens, namespace, for_allocate=True)
        try:
            return super().allocate(seq_id, tokens, namespace=namespace)
        finally:
            self._spill()

    def lookup(self, tokens: Sequence[int], *, namespace: str = DEFAULT_NAMESPACE) -> PrefixHit:
        """:meth:`Manager.lookup`, after promoting what the tiers hold of the rest of
        the chain (as far as free and evictable pages allow)."""
        self._promote(tokens, namespace, for_allocate=False)
        self._spill()
        return super().lookup(tokens, namespace=namespace)

    def extend(self, seq_id: int, num_tokens: int) -> Extension:
        try:
            return super().extend(seq_id, num_tokens)
        finally:
            self._spill()

    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int:
        remote = self.tiers.remote
        seq = self._seqs.get(seq_id) if remote is not None and seq_id in self else None
        before = len(seq.keys) if seq is not None else 0
        end = super().commit(seq_id, tokens, start=start)
        if remote is not None and seq is not None and end > before:
            published = self._key_by_page
            new = [(key, page) for key, page in zip(seq.keys[before:end], seq.pages[before:end],
                                                    strict=True) if published.get(page) == key]  # fmt: skip
            if new:
                pages = gather_pages(self._views, [page for _, page in new], device="cpu")
                remote.put_many(tier_keys(self._fingerprint, [key for key, _ in new]), pages)
        return end

    def take_events(self) -> list[PageEvent]:
        events = super().take_events()
        moved = self._moved
        if moved:
            events = [
                PageRemoved(event.key, event.page, moved[event.key])
                if isinstance(event, PageRemoved) and event.key in moved else event
                for event in events
            ]  # fmt: skip
            moved.clear()
        return events

    def tier_stats(self) -> dict[str, TierStats]:
        """Counters per medium of the tiers present (host, disk, remote)."""
        return self.tiers.stats()

    def close(self) -> None:
        """Write what the pool and the host tier cache down to the disk tier (so a new
        daemon on the same directory serves it), then close the tiers."""
        try:
            self._write_back()
        finally:
            self.tiers.close()

    def check_integrity(self) -> None:
        super().check_integrity()
        for tier in (self.tiers.host, self.tiers.disk, self.tiers.remote):
            if tier is not None:
                tier.check_integrity()

    # -- internals ------------------------------------------------------------------------

    def _promote(self, tokens: Sequence[int], namespace: str, *, for_allocate: bool) -> None:
        """Bring the pages of ``tokens``' chain that the tiers hold, after the pool's own
        hits, into adopted pool pages. OutOfPages (for an allocate that cannot fit
        anyway) before any I/O; otherwise never raises for a tier's miss."""
        root = self._root(namespace)
        token_bytes = encode_tokens(tokens)
        keys, hits = self._match(root, token_bytes)
        page_size = self._page_size
        max_pages = max(len(token_bytes) // 4 - 1, 0) // page_size
        pinned = [self._refcounts[page] for page in hits].count(0)
        room = self._pages.num_available - pinned
        if for_allocate and self.layout.pages_for(len(token_bytes) // 4) - len(hits) > room:
            raise OutOfPages(f"need {self.layout.pages_for(len(token_bytes) // 4) - len(hits)} "
                             f"pages, {room} free or evictable")  # fmt: skip
        if len(hits) >= max_pages or room <= 0:
            return
        stride = 4 * page_size
        want = min(max_pages, len(hits) + room)
        rest = list(chain_keys(keys[-1] if keys else root, token_bytes[: want * stride],
                               page_size, len(hits)))  # fmt: skip
        tkeys = tier_keys(self._fingerprint, rest)
        runs = self.tiers.locate(tkeys)
        if not runs:
            return
        fetched: list[tuple[list[int], torch.Tensor | None, int]] = []  # pages, data, start
        done = 0
        for run in runs:  # read disk and remote runs now: what they cannot give ends it
            count = run.count
            data = None
            if not isinstance(run.tier, HostTier):
                data = run.tier.get_many(tkeys[run.start : run.start + run.count])
                count = len(data)
            if count:
                pages = self.adopt(tokens, count, namespace=namespace, medium=run.tier.medium)
                fetched.append((pages, data, done))
                count = len(pages)
            done += count
            if count < run.count:
                break
        evicted = self.take_evicted()  # pages adopt took from the LRU: copy them out first
        spilled = self._gather(evicted)
        for pages, data, start in fetched:
            if data is None:
                host = self.tiers.host
                assert host is not None
                got = host.promote(tkeys[start : start + len(pages)], self._views, pages)
                assert got == len(pages), "the host tier lost entries inside one request"
            else:
                scatter_pages(self._views, pages, data[: len(pages)])
        self._put_down(evicted, spilled)

    def _write_back(self, chunk: int = 256) -> None:
        """Host entries, then the pool's cached pages (most recent last), to the disk
        tier, ``chunk`` pages per copy; bounded by the disk tier's own size."""
        disk, host = self.tiers.disk, self.tiers.host
        if disk is None:
            return
        if host is not None:
            keys = host.keys()
            for at in range(0, len(keys), chunk):
                disk.put_many(keys[at : at + chunk], host.get_many(keys[at : at + chunk]))
        entries = self.prefix_snapshot()
        for at in range(0, len(entries), chunk):
            part = entries[at : at + chunk]
            pages = gather_pages(self._views, [e.page for e in part], device="cpu")
            disk.put_many(tier_keys(self._fingerprint, [e.key for e in part]), pages)

    def _spill(self) -> None:
        """Copy what the last Manager operation evicted into the tiers (before the reply)."""
        evicted = self.take_evicted()
        if evicted:
            self._put_down(evicted, self._gather(evicted))

    def _gather(self, evicted: list[tuple[PrefixKey, PageId]]) -> torch.Tensor | None:
        if not evicted or not self._spill_medium:
            return None
        return gather_pages(self._views, [page for _, page in evicted], device="cpu")

    def _put_down(
        self, evicted: list[tuple[PrefixKey, PageId]], pages: torch.Tensor | None
    ) -> None:
        if pages is None:
            return
        keys = [key for key, _ in evicted]
        self.tiers.spill(tier_keys(self._fingerprint, keys), pages)
        for key in keys:
            self._moved[key] = self._spill_medium


def tier_metric_families(pools: list[msg.PoolStats]) -> Iterator[Metric]:
    """Prometheus families of the pools' lower tiers (kvcore.daemon.metrics), labelled
    by pool and medium: pages held (gauge), pages hit, missed, corrupt, stored and
    evicted, bytes in and out (counters)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["pool", "medium"]
    held = GaugeMetricFamily("kvcore_tier_pages", "Pages held in a lower tier of a pool "
                             "(remote: pages this daemon published)", labels=labels)  # fmt: skip
    counters = {
        name: CounterMetricFamily(f"kvcore_tier_{name}", text, labels=labels)
        for name, text in (
            ("hits_pages", "Pages read back from a lower tier into the pool"),
            ("misses_pages", "Pages asked of a lower tier and not returned (corrupt included)"),
            ("corrupt_pages", "Entries of a lower tier that failed verification"),
            ("stored_pages", "Pages written into a lower tier"),
            ("evicted_pages", "Entries a lower tier pushed out to make room"),
            ("in_bytes", "Payload bytes written into a lower tier"),
            ("out_bytes", "Payload bytes read back out of a lower tier"),
            ("timeouts", "Store calls abandoned at their bound (remote)"),
        )
    }  # fmt: skip
    for pool in pools:
        for t in pool.tiers:
            key = [pool.name, t.medium]
            held.add_metric(key, t.pages)
            for name, value in (("hits_pages", t.hits), ("misses_pages", t.misses),
                                ("corrupt_pages", t.corrupt), ("stored_pages", t.stored),
                                ("evicted_pages", t.evicted), ("in_bytes", t.bytes_in),
                                ("out_bytes", t.bytes_out), ("timeouts", t.timeouts)):  # fmt: skip
                counters[name].add_metric(key, value)
    yield held
    yield from counters.values()
