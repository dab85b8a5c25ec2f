"""TieredManager: a pool's Manager with lower tiers below it (docs/concepts.md, "Tiers").

The Manager stays I/O-free; this wrapper holds one and does the I/O around its
operations, on the daemon's thread, before the reply. It serves the same
operations (:class:`~kvcore.manager.PageManager`), so ``op.serve(pool.manager,
...)`` in the handler is unchanged, and drives the Manager only through its
public calls (``plan``, ``adopt``, ``take_evicted``, ``take_events``)::

    allocate / lookup     Manager.plan: keys k0..k(m-1), the pool's hits k0..k(h-1), room
        runs found below:  host | disk | remote      (disk/remote read and verified first)
        Manager.adopt      fresh pages indexed for those keys, one call per run;
                           pages it evicted are copied out (gather) before anything
                           is written into them
        promote            host: HostTier.promote (one copy per byte); disk/remote: scatter
        spill              the evicted pages' bytes (gathered first) -> host (-> disk)
        then the Manager's own allocate or lookup, whose hit now covers the promoted pages;
        spill              what it evicted: pool pages -> host slots (one copy per byte,
                           TierStack.spill_from), the host's own evictions -> disk
    allocate_pages /       one-page chains (SGLang's storage): each chain the pool
      lookup_pages         misses and the host or disk tier holds is promoted on its
                           own (Manager.adopt_pages pins the call's pool pages); then
                           the Manager's op, and spill what it evicted, as above
    extend                 the Manager's extend, then spill what it evicted (the same)
    commit, commit_pages   the Manager's commit, then a copy of the pages it indexed (its
                           PageStored events) queued for the remote store (published by
                           the store's thread)
    close                  unless the pool is kept across restarts, the host tier's
                           entries and the pool's cached pages written down to the disk
                           tier (a new daemon on it serves them); a kept pool's pool and
                           host tier come back themselves

So an engine only ever sees ordinary pool pages, written and committed, and a
page evicted by a reply is in a lower tier before the engine can overwrite it.
A promoted page is indexed (by adopt) before its bytes are copied in: a pool kept
across restarts (kvcore.daemon.restart) mirrors it PENDING into its index table
until ``placed`` (IndexTable.placed) marks it STORED after the copy, so a crash
in between never brings it back.
Every copy moves a page in its stored form, a row of the pool's
:meth:`~kvcore.layout.KVLayout.pages_view` (kvcore.tiers.transfer): one run per
page when the pool's order is page-major, one per page and layer when layer-major.
A tier that misses (evicted since, corrupt, store down or slow) shortens the
run: counted in its TierStats, never an error to the engine. Units: pages
unless named bytes.

Lookup is not read-only here: a lookup on a tiered pool may bring pages up from
the lower tiers (adopting pool pages for them, which may evict and spill others,
with their events), as allocate does, so that it answers what an allocate would
hit. It changes which pages are cached, never any sequence, and raises nothing
an untiered lookup would not.

Events: the stored event of a promoted page carries the medium it came from;
the removed event of a spilled page carries the medium now holding it.

The file is over 400 lines on purpose: TieredManager is one class whose promotions
(chains and one-page chains), spills and write-back keep one rule over the same pool
bytes (evicted pages are copied out before anything is written into them), so they
read together; the metric families at the end are what its counters become.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvcore_ipc import messages as msg

from kvcore.allocator import PageId
from kvcore.config import TierConfig
from kvcore.errors import OutOfPages
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.hits import MEDIA, Histogram, HitBook
from kvcore.layout import KVLayout
from kvcore.manager import Allocation, Extension, Manager, PagesAllocation, PrefixHit, Stats
from kvcore.prefix import (
    KeySpace,
    PackedTokens,
    PageEvent,
    PageRemoved,
    PageStored,
    PrefixKey,
    encode_tokens,
)
from kvcore.tiers import DiskTier, HostTier, RemoteConfig, RemoteTier, TierStack, TierStats
from kvcore.tiers.base import layout_fingerprint, tier_keys
from kvcore.tiers.secret import keyring_of
from kvcore.tiers.transfer import gather_pages, scatter_pages

if TYPE_CHECKING:
    import torch
    from prometheus_client.core import Metric


def host_pages(layout: KVLayout, config: TierConfig) -> int:
    """Pages of the host tier ``config`` declares for a pool of ``layout`` (0: none)."""
    return config.host_bytes() // layout.page_bytes


def open_stack(
    layout: KVLayout,
    config: TierConfig,
    pool: str,
    eviction: str = DEFAULT_EVICTION,
    *,
    host: HostTier | None = None,
) -> TierStack:
    """The tiers ``config`` declares for a pool of ``layout``, the host and disk tiers
    evicting by the pool's policy ``eviction``; ``host``: the host tier to use (a kept
    one, of the declared capacity) instead of a new one. BadRequest if misdeclared."""
    config.validate(pool, layout.page_bytes)
    keyring = keyring_of(config)  # None: no secret (entries checksummed, names unkeyed)
    pages = host_pages(layout, config)
    if host is None:
        host = HostTier(layout, pages, eviction=eviction) if pages else None
    assert (0 if host is None else host.capacity_pages) == pages, "a host tier of another size"
    disk = (
        DiskTier(layout, config.disk, config.disk_bytes(), keyring=keyring, eviction=eviction)
        if config.disk
        else None
    )
    remote = None
    if config.remote_master:
        remote_config = RemoteConfig(
            config.remote_master,
            config.remote_metadata,
            local_hostname=config.remote_local_hostname,
            timeout_s=config.remote_timeout_s,
        )
        remote = RemoteTier(layout, remote_config, keyring=keyring)
    return TierStack(host, disk, remote)


class TieredManager:
    """A Manager (``manager``) whose evictions spill to ``tiers`` and whose hits
    continue into them; the Manager's operations and promises otherwise (a failed
    operation changed nothing), lookup aside (module docstring).

    ``pool`` is the pool's memory (a contiguous tensor over its bytes, as
    :meth:`KVLayout.pages_view` takes); only
    this class reads or writes the pool's pages through it, and only on the daemon's
    thread. ``manager`` is driven by this class alone. Not thread-safe.

    A pool kept across restarts passes its own ``manager`` (over its index table,
    recording evictions, perhaps restored: kvcore.daemon.restart) and ``placed``
    (IndexTable.placed), called with the pages of each promotion once its copy is done.
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: torch.Tensor,
        tiers: TierStack,
        *,
        eviction: str = DEFAULT_EVICTION,
        manager: Manager | None = None,
        placed: Callable[[Iterable[PageId]], None] | None = None,
    ) -> None:
        self.layout = layout
        if manager is None:
            manager = Manager(layout, eviction=eviction, record_evictions=True)
        assert manager.records_evictions, "a tiered pool's Manager records its evictions"
        self.manager = manager
        self._placed = placed
        self.tiers = tiers
        self._pool = layout.pages_view(pool)  # [num_pages, *stored_page_shape]
        self._fingerprint = layout_fingerprint(layout)
        self._spill_medium = (
            "host" if tiers.host is not None else "disk" if tiers.disk is not None else ""
        )
        self._moved: dict[PrefixKey, str] = {}  # spilled since the last take_events: medium
        self._events: list[PageEvent] = []  # taken from the Manager by commit, not yet handed on
        # medium -> seconds each request took to bring pages up from it (read, copy)
        self.promotions: dict[str, Histogram] = {}

    @property
    def hits(self) -> HitBook:
        """The Manager's book; this class adds what the tiers brought up."""
        return self.manager.hits

    @property
    def eviction(self) -> str:
        """The name of the pool's eviction policy (the Manager's; its tiers use it too)."""
        return self.manager.eviction

    # -- operations that may promote or evict -------------------------------------------

    def allocate(
        self,
        seq_id: int,
        tokens: Sequence[int],
        space: KeySpace = KeySpace(),
        *,
        compute_last: bool = True,
    ) -> Allocation:
        """:meth:`Manager.allocate`, after promoting what the tiers hold of the rest of
        the chain; OutOfPages before any I/O if the tokens cannot fit anyway."""
        self.manager.check_new(seq_id)  # bad input fails before any I/O
        num_hit, runs = self._promote(tokens, space, for_allocate=True, compute_last=compute_last)
        try:
            allocation = self.manager.allocate(seq_id, tokens, space, compute_last=compute_last)
        finally:
            self._spill()
        if runs:
            allocation.sources = self._sources(allocation.num_cached_tokens, num_hit, runs)
            for medium, num_tokens in allocation.sources[1:]:
                self.manager.hits.lower(space.namespace, medium, num_tokens)
        return allocation

    def _sources(
        self, num_cached: int, num_hit: int, runs: list[tuple[str, int]]
    ) -> list[tuple[str, int]]:
        """The allocation's hit as runs (medium, tokens) in chain order (kvcore.results.
        Allocation.sources): the pool's ``num_hit`` pages, then the promoted ``runs``
        (medium, pages), cut at ``num_cached`` tokens; "pool" first even if 0 tokens."""
        page_size = self.layout.page_size
        left = num_cached - num_hit * page_size
        sources = [("pool", min(num_cached, num_hit * page_size))]
        for medium, pages in runs:
            if left <= 0:
                break
            sources.append((medium, min(left, pages * page_size)))
            left -= pages * page_size
        return sources

    def lookup(
        self,
        tokens: Sequence[int],
        space: KeySpace = KeySpace(),
        *,
        compute_last: bool = True,
    ) -> PrefixHit:
        """:meth:`Manager.lookup`, after promoting what the tiers hold of the rest of
        the chain (as far as free and evictable pages allow): not read-only, it may
        change which pages are cached (never a sequence); see the module docstring."""
        self._promote(tokens, space, for_allocate=False, compute_last=compute_last)
        self._spill()
        return self.manager.lookup(tokens, space, compute_last=compute_last)

    def extend(self, seq_id: int, num_tokens: int) -> Extension:
        try:
            return self.manager.extend(seq_id, num_tokens)
        finally:
            self._spill()

    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int:
        """:meth:`Manager.commit`; with a remote tier, the pages it indexed are copied
        out and queued for the store (the reply does not wait for the store)."""
        end = self.manager.commit(seq_id, tokens, start=start)
        self._publish()
        return end

    # -- one-page chains (SGLang's storage): each promoted on its own ----------------------

    def allocate_pages(
        self, seq_id: int, tokens: Sequence[int], space: KeySpace = KeySpace()
    ) -> PagesAllocation:
        """:meth:`Manager.allocate_pages`, after promoting the chains the pool misses and
        the host or disk tier holds (each chain is its own: a miss ends nothing);
        ``media`` says where each hit was. OutOfPages before any I/O if the fresh pages
        cannot fit anyway."""
        self.manager.check_new(seq_id)  # bad input fails before any I/O
        tokens = PackedTokens(encode_tokens(tokens))  # once: every step below slices bytes
        media = self._promote_pages(tokens, space, for_allocate=True)
        try:
            allocation = self.manager.allocate_pages(seq_id, tokens, space)
        finally:
            self._spill()
        if media:
            ps = self.layout.page_size
            stride = 4 * ps
            allocation.media = [
                media.get(tokens[i * stride : (i + 1) * stride], "pool") if hit else ""
                for i, hit in enumerate(allocation.hits)
            ]
            for medium in MEDIA[1:]:
                count = allocation.media.count(medium)
                if count:
                    self.manager.hits.lower(space.namespace, medium, count * ps)
        return allocation

    def lookup_pages(self, tokens: Sequence[int], space: KeySpace = KeySpace()) -> list[bool]:
        """:meth:`Manager.lookup_pages`, after promoting what the host or disk tier holds
        of the chains the pool misses (not read-only: see :meth:`lookup`)."""
        tokens = PackedTokens(encode_tokens(tokens))
        self._promote_pages(tokens, space, for_allocate=False)
        self._spill()
        return self.manager.lookup_pages(tokens, space)

    def commit_pages(self, seq_id: int, tokens: Sequence[int]) -> int:
        """:meth:`Manager.commit_pages`; what it indexed goes to the remote store as
        :meth:`commit`'s pages do."""
        indexed = self.manager.commit_pages(seq_id, tokens)
        self._publish()
        return indexed

    def _promote_pages(
        self, tokens: PackedTokens, space: KeySpace, *, for_allocate: bool
    ) -> dict[bytes, str]:
        """:meth:`_promote` for one-page chains: bring the chains of ``tokens`` that the
        pool misses and the host or disk tier holds into adopted pool pages, as many as
        the room beside the chains' pool pages allows (Manager.adopt_pages pins those).
        Disk entries are read and verified first, one by one, so that a bad one costs
        only its own chain. The remote store is not asked (one round trip per chain).
        Returns the (packed) tokens of each chain promoted -> the medium it came from."""
        found = self.manager.lookup_pages(tokens, space)  # BadRequest before any I/O
        if for_allocate:
            stats = self.manager.stats()
            room = stats.free_pages + stats.evictable_pages
            if found.count(False) > room:
                raise OutOfPages(f"need {found.count(False)} pages, {room} free or evictable")
        host, disk = self.tiers.host, self.tiers.disk
        if all(found) or (host is None and disk is None):
            return {}
        stride = 4 * self.layout.page_size
        missing: dict[bytes, int] = {}  # a chain's tokens -> its first index
        for i, hit in enumerate(found):
            if not hit:
                missing.setdefault(tokens[i * stride : (i + 1) * stride], i)
        firsts = list(missing.values())  # one page index per chain
        prefix_keys = self.manager.one_page_keys(tokens, firsts, space)
        keys = dict(zip(firsts, tier_keys(self._fingerprint, prefix_keys), strict=True))
        took: dict[str, float] = {}  # medium -> seconds spent bringing its pages up
        on_host = [i for i, key in keys.items() if host is not None and key in host]
        read: list[tuple[int, torch.Tensor]] = []  # disk chains and their verified pages
        if disk is not None:
            start = time.perf_counter()
            for i, key in keys.items():
                if (host is None or key not in host) and key in disk:
                    data = disk.get_many([key])
                    if len(data):
                        read.append((i, data[0]))
            took["disk"] = time.perf_counter() - start
        host_pages = self.manager.adopt_pages(tokens, on_host, space, medium="host")
        disk_pages = self.manager.adopt_pages(tokens, [i for i, _ in read], space, medium="disk")
        evicted = self.manager.take_evicted()  # adopt took them from the LRU: copy out first
        spilled = self._gather(evicted)
        if host_pages:
            assert host is not None
            start = time.perf_counter()
            got = host.promote([keys[i] for i in on_host], self._pool, host_pages)
            assert got == len(host_pages), "the host tier lost entries inside one request"
            took["host"] = time.perf_counter() - start
        if disk_pages:
            import torch

            start = time.perf_counter()
            data = torch.stack([page for _, page in read[: len(disk_pages)]])
            scatter_pages(self._pool, disk_pages, data)
            took["disk"] += time.perf_counter() - start
        self._mark_placed(host_pages + disk_pages)
        self._put_down(evicted, spilled)
        for medium, seconds in took.items():
            self.promotions.setdefault(medium, Histogram()).observe(seconds)
        chains = {i: "host" for i in on_host[: len(host_pages)]}
        chains.update((i, "disk") for i, _ in read[: len(disk_pages)])
        return {chunk: chains[i] for chunk, i in missing.items() if i in chains}

    def _publish(self) -> None:
        """With a remote tier, copy the pages the last commit indexed out and queue them
        for the store (the reply does not wait for the store)."""
        remote = self.tiers.remote
        if remote is None:
            return
        # Every commit takes the Manager's events, so its committed PageStored
        # events (medium "") are exactly the pages this commit indexed.
        events = self.manager.take_events()
        self._events += events
        new = [e for e in events if isinstance(e, PageStored) and not e.medium]
        if new:
            pages = gather_pages(self._pool, [e.page for e in new], device="cpu")
            remote.put_many(tier_keys(self._fingerprint, [e.key for e in new]), pages)

    # -- the Manager's, unchanged (never allocate, so never evict) ------------------------

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        return self.manager.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        self.manager.free(seq_id)

    def block_table(self, seq_id: int) -> list[int]:
        return self.manager.block_table(seq_id)

    def num_tokens(self, seq_id: int) -> int:
        return self.manager.num_tokens(seq_id)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.manager

    def stats(self) -> Stats:
        return self.manager.stats()

    def prefix_snapshot(self) -> list[PageStored]:
        return self.manager.prefix_snapshot()

    # -- events, tiers, integrity -----------------------------------------------------------

    def take_events(self) -> list[PageEvent]:
        """The Manager's events since the last call, oldest first, a spilled page's
        PageRemoved naming the medium now holding it."""
        events, self._events = self._events + self.manager.take_events(), []
        moved = self._moved
        if moved:
            events = [
                PageRemoved(event.key, event.page, moved[event.key])
                if isinstance(event, PageRemoved) and event.key in moved
                else event
                for event in events
            ]
            moved.clear()
        return events

    def tier_stats(self) -> dict[str, TierStats]:
        """Counters per medium of the tiers present (host, disk, remote)."""
        return self.tiers.stats()

    def close(self, *, pool_pages: bool = True) -> None:
        """Write what the host tier and (if ``pool_pages``) the pool cache down to the
        disk tier (so a new daemon on the same directory serves it), then close the
        tiers. A pool kept across restarts passes False: its pages stay in it, and
        copies of them would push out disk entries it does not hold. A kept host tier
        is not written down either, for the same reason: it comes back itself."""
        try:
            self._write_back(pool_pages=pool_pages)
        finally:
            self.tiers.close()

    def check_integrity(self) -> None:
        self.manager.check_integrity()
        for tier in (self.tiers.host, self.tiers.disk, self.tiers.remote):
            if tier is not None:
                tier.check_integrity()

    # -- internals ------------------------------------------------------------------------

    def _promote(
        self, tokens: Sequence[int], space: KeySpace, *, for_allocate: bool, compute_last: bool
    ) -> tuple[int, list[tuple[str, int]]]:
        """Bring the pages of ``tokens``' chain in key space ``space`` that the tiers
        hold, after the pool's own hits, into adopted pool pages, as many as the room
        beside the hits allows. Tier keys derive from prefix keys, which hash the key
        space, so pages of another model, salt or adapter are never found below either.
        OutOfPages (for an allocate that cannot fit anyway) before any I/O; otherwise
        never raises for a tier's miss. Returns the pool's own hit (pages) and the runs
        promoted after it, (medium, pages) in chain order; the time each medium took
        (read, verify, copy) goes to its promotion histogram."""
        num_new = self.manager.layout.pages_for(len(tokens))  # before the hits
        if not compute_last:  # a hit may cover the last token: plan as if one followed
            tokens = [*tokens, 0]
        plan = self.manager.plan(tokens, space)
        num_new -= plan.num_hit
        if for_allocate and num_new > plan.room:
            raise OutOfPages(f"need {num_new} pages, {plan.room} free or evictable")
        rest = plan.keys[plan.num_hit : plan.num_hit + plan.room]
        if not rest:
            return plan.num_hit, []
        tkeys = tier_keys(self._fingerprint, rest)
        runs = self.tiers.locate(tkeys)
        if not runs:
            return plan.num_hit, []
        took: dict[str, float] = {}  # medium -> seconds spent bringing its pages up
        fetched: list[tuple[str, list[int], torch.Tensor | None, int]] = []  # + data, start
        done = 0
        for run in runs:  # read disk and remote runs now: what they cannot give ends it
            count = run.count
            data = None
            medium = run.tier.medium
            if not isinstance(run.tier, HostTier):
                start = time.perf_counter()
                data = run.tier.get_many(tkeys[run.start : run.start + run.count])
                took[medium] = took.get(medium, 0.0) + time.perf_counter() - start
                count = len(data)
            if count:
                pages = self.manager.adopt(tokens, count, space, medium=medium)
                fetched.append((medium, pages, data, done))
                count = len(pages)
            done += count
            if count < run.count:
                break
        evicted = self.manager.take_evicted()  # adopt took them from the LRU: copy out first
        spilled = self._gather(evicted)
        for medium, pages, data, at in fetched:
            start = time.perf_counter()
            if data is None:
                host = self.tiers.host
                assert host is not None
                got = host.promote(tkeys[at : at + len(pages)], self._pool, pages)
                assert got == len(pages), "the host tier lost entries inside one request"
            else:
                scatter_pages(self._pool, pages, data[: len(pages)])
            took[medium] = took.get(medium, 0.0) + time.perf_counter() - start
        self._mark_placed([page for _, pages, _, _ in fetched for page in pages])
        self._put_down(evicted, spilled)
        for medium, seconds in took.items():
            self.promotions.setdefault(medium, Histogram()).observe(seconds)
        return plan.num_hit, [(medium, len(pages)) for medium, pages, _, _ in fetched]

    def _write_back(self, chunk: int = 256, *, pool_pages: bool = True) -> None:
        """Host entries (unless the host tier is kept), then (if ``pool_pages``) the
        pool's cached pages (most recent last), to the disk tier, ``chunk`` pages per
        copy; bounded by the disk tier's size."""
        disk, host = self.tiers.disk, self.tiers.host
        if disk is None:
            return
        if host is not None and not host.kept:
            keys = host.keys()
            for at in range(0, len(keys), chunk):
                disk.put_many(keys[at : at + chunk], host.get_many(keys[at : at + chunk]))
        entries = self.manager.prefix_snapshot() if pool_pages else []
        for at in range(0, len(entries), chunk):
            part = entries[at : at + chunk]
            pages = gather_pages(self._pool, [e.page for e in part], device="cpu")
            disk.put_many(tier_keys(self._fingerprint, [e.key for e in part]), pages)

    def _mark_placed(self, pages: list[int]) -> None:
        """The promotion's copy into ``pages`` is done: ``placed`` (a kept pool's
        IndexTable.placed, PENDING -> STORED). No Manager call since their adopt could
        evict them: a later adopt of the same request pins the pages adopted before it."""
        if self._placed is not None and pages:
            self._placed([PageId(page) for page in pages])

    def _spill(self) -> None:
        """Copy what the last Manager operation evicted into the tiers (before the reply),
        straight from the pool's pages: nothing is written into them before the reply."""
        evicted = self.manager.take_evicted()
        if not evicted or not self._spill_medium:
            return
        keys = [key for key, _ in evicted]
        self.tiers.spill_from(
            tier_keys(self._fingerprint, keys), self._pool, [page for _, page in evicted]
        )
        for key in keys:
            self._moved[key] = self._spill_medium

    def _gather(self, evicted: list[tuple[PrefixKey, PageId]]) -> torch.Tensor | None:
        """The evicted pages' bytes as a batch, for pages about to be written over (a
        promotion's): a host tier's spill could push out the very entries promoted."""
        if not evicted or not self._spill_medium:
            return None
        return gather_pages(self._pool, [page for _, page in evicted], device="cpu")

    def _put_down(
        self, evicted: list[tuple[PrefixKey, PageId]], pages: torch.Tensor | None
    ) -> None:
        if pages is None:
            return
        keys = [key for key, _ in evicted]
        self.tiers.spill(tier_keys(self._fingerprint, keys), pages)
        for key in keys:
            self._moved[key] = self._spill_medium


def tier_metric_families(
    pools: list[msg.PoolStats], eviction: dict[str, str] | None = None
) -> Iterator[Metric]:
    """Prometheus families of the pools' lower tiers (kvcore.daemon.metrics), labelled
    by pool and medium: pages held (gauge), pages hit, missed, corrupt, stored and
    evicted (also by ``eviction[pool]``, the policy that chose them), bytes in and out
    (counters)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["pool", "medium"]
    held_text = "Pages held in a lower tier of a pool (remote: pages this daemon published)"
    held = GaugeMetricFamily("kvcore_tier_pages", held_text, labels=labels)
    counters = {
        name: CounterMetricFamily(f"kvcore_tier_{name}", text, labels=labels)
        for name, text in (
            ("hits_pages", "Pages read back from a lower tier into the pool"),
            ("misses_pages", "Pages asked of a lower tier and not returned (corrupt included)"),
            ("corrupt_pages", "Entries of a lower tier that failed verification"),
            ("stored_pages", "Pages written into a lower tier"),
            ("in_bytes", "Payload bytes written into a lower tier"),
            ("out_bytes", "Payload bytes read back out of a lower tier"),
            ("timeouts", "Store calls abandoned at their bound (remote)"),
        )
    }
    evicted = CounterMetricFamily(
        "kvcore_tier_evicted_pages",
        "Entries a lower tier pushed out to make room, by the pool's eviction policy",
        labels=[*labels, "policy"],
    )
    for pool in pools:
        for t in pool.tiers:
            key = [pool.name, t.medium]
            held.add_metric(key, t.pages)
            values = {
                "hits_pages": t.hits,
                "misses_pages": t.misses,
                "corrupt_pages": t.corrupt,
                "stored_pages": t.stored,
                "evicted_pages": t.evicted,
                "in_bytes": t.bytes_in,
                "out_bytes": t.bytes_out,
                "timeouts": t.timeouts,
            }
            for name, value in values.items():
                if name != "evicted_pages":
                    counters[name].add_metric(key, value)
            evicted.add_metric([*key, (eviction or {}).get(pool.name, "")], t.evicted)
    yield held
    yield from counters.values()
    yield evicted
    yield _promotion_family(pools)


def _promotion_family(pools: list[msg.PoolStats]) -> Metric:
    """``kvcore_tier_promotion_seconds{pool,medium}``: a histogram of the seconds one
    request took to bring pages up from a tier (TierStats.promote_*)."""
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(
        "kvcore_tier_promotion_seconds",
        "Seconds one request took to bring pages up from a lower tier (read, verify, copy)",
        labels=["pool", "medium"],
    )
    for pool in pools:
        for t in pool.tiers:
            if len(t.promote_counts) != len(t.promote_bounds_s) + 1:
                continue  # no histogram (a TierStats built without one)
            buckets, total = [], 0
            bounds = [*map(repr, t.promote_bounds_s), "+Inf"]
            for bound, count in zip(bounds, t.promote_counts, strict=True):
                total += count
                buckets.append((bound, total))
            family.add_metric([pool.name, t.medium], buckets, t.promote_s)
    return family
