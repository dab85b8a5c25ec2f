"""HostTier: daemon-owned host memory below a pool, a fixed number of page slots.

One preallocated tensor ``[capacity_pages, *stored_page_shape]`` holds every entry; a
slot is one page in its stored form (``page_bytes`` bytes, the pool's order:
kvcore.layout). Every copy is kvcore.tiers.transfer's, bytes through memmoves (float8
as bytes): a put or a spill straight from the pool's rows (:meth:`HostTier.spill_from`)
copies each byte once, as does a promotion (:meth:`HostTier.promote`); either is one
memmove per page when the pool is page-major, one per page and layer when it is
layer-major. A get is one memmove per page. No Python copy of bytes.

Invariants (:meth:`HostTier.check_integrity`):

* ``_where`` (key -> slot) and ``_free`` (slots) are disjoint and together name
  every slot exactly once; the eviction policy ``_order`` holds ``_where``'s keys;
* ``stats.pages == len(_where)``, ``stats.bytes_used == pages * page_bytes``.

Inclusive caching: a get leaves the entry in place (a page promoted to the
pool and evicted again costs no second copy: its put only refreshes it).

Kept across restarts (``segment``: kvcore.daemon.restart gives an untracked shm
segment only the daemon maps): the slots live in the segment beside a slot table
(kvcore.tiers.host_table) that says which slot holds which key, written in the order
that makes any crash image safe: a slot is set FREE when its entry is evicted or
discarded (before its bytes can be overwritten), and STORED, with its key, only after
its page is copied in. ``restore=True`` takes back the entries the table vouches for.
The copies are unchanged (one memmove per page); the table costs a few bytes per
entry stored or dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcore.errors import BadRequest
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.eviction import make_policy
from kvcore.layout import KVLayout
from kvcore.tiers.base import (
    LocalKeys,
    TierKey,
    TierStats,
    check_keys,
    check_pages,
    layout_fingerprint,
)
from kvcore.tiers.host_table import STORED, SlotTable, data_offset
from kvcore.tiers.transfer import copy_rows, promote_rows, spill_rows, take_rows

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Spilled:
    """Entries a put pushed out of the host tier, least recently used first, with
    their bytes: ``pages`` is ``[len(keys), *stored_page_shape]``, for the next tier
    down."""

    keys: list[TierKey]
    pages: torch.Tensor


class HostTier(LocalKeys):
    """Pages in preallocated host memory, evicted by the policy ``eviction`` names
    (kvcore.eviction). Not thread-safe (the daemon's thread).

    ``segment``: a flat uint8 CPU tensor of ``host_table.segment_bytes(capacity_pages,
    layout.page_bytes)`` bytes to keep the slots and their slot table in (a kept tier,
    module docstring): a new table is written over it, or, with ``restore``, the one it
    holds is opened (RestoreRefused if its header is not this tier's) and its verified
    entries held again, oldest first (``restored``; ``dropped``: the rest by cause)."""

    medium = "host"
    slot_table: type[SlotTable] = SlotTable  # a kept tier's table (a test records its stores)

    def __init__(
        self,
        layout: KVLayout,
        capacity_pages: int,
        *,
        pin_memory: bool = False,
        eviction: str = DEFAULT_EVICTION,
        segment: torch.Tensor | None = None,
        restore: bool = False,
    ) -> None:
        import torch

        if (
            not isinstance(capacity_pages, int)
            or isinstance(capacity_pages, bool)
            or capacity_pages < 1
        ):
            raise BadRequest(f"capacity_pages must be a positive int, got {capacity_pages!r}")
        self.layout = layout
        self.fingerprint = layout_fingerprint(layout)
        self.capacity_pages = capacity_pages
        self._page_bytes = layout.page_bytes
        self._table: SlotTable | None = None  # a kept tier's slot table
        if segment is None:
            self._slots = torch.empty(
                (capacity_pages, *layout.stored_page_shape),
                dtype=layout.torch_dtype(),
                pin_memory=pin_memory,
            )
        else:
            self._slots = self._over(segment, restore)
        self._where: dict[TierKey, int] = {}  # key -> its slot
        self._order = make_policy(eviction, capacity_pages)
        self._free: list[int] = list(range(capacity_pages - 1, -1, -1))  # pop() takes slot 0 first
        self._stats = TierStats()
        self.restored, self.dropped = 0, Counter[str]()  # a kept tier's restore
        if self._table is not None and restore:
            self._restore(self._table)

    def _over(self, segment: torch.Tensor, restore: bool) -> torch.Tensor:
        """The slots inside a kept tier's ``segment``, its slot table made or opened."""
        import torch

        capacity, page_bytes = self.capacity_pages, self._page_bytes
        at, size = data_offset(capacity), capacity * page_bytes
        if segment.dtype != torch.uint8 or segment.dim() != 1 or len(segment) < at + size:
            raise BadRequest(f"a kept host tier needs a flat uint8 segment of {at + size} bytes")
        view = segment.numpy().data.cast("B")  # CPU, zero-copy
        make = self.slot_table.open if restore else self.slot_table.create
        self._table = make(
            view, capacity=capacity, page_bytes=page_bytes, fingerprint=self.fingerprint
        )
        data = segment[at : at + size].view(self.layout.torch_dtype())
        return data.view(capacity, *self.layout.stored_page_shape)

    def _restore(self, table: SlotTable) -> None:
        """Hold again what ``table`` vouched for at open, oldest first."""
        for slot, key in table.opened.entries:
            self._store(key, slot)
        used = set(self._where.values())
        self._free = [slot for slot in self._free if slot not in used]
        self.restored, self.dropped = len(self._where), table.opened.dropped
        self._stats.pages = len(self._where)
        self._stats.bytes_used = len(self._where) * self._page_bytes

    @property
    def kept(self) -> bool:
        """Whether the tier lives in a segment that outlives the daemon."""
        return self._table is not None

    def settle(self) -> None:
        """A kept tier at a clean stop: its entries renumbered in eviction order (the
        recency a restart restores), the table let go. The tier is unusable after."""
        table, self._table = self._table, None
        if table is not None:
            where = self._where
            table.renumber([where[key] for key in self._order])
            table.close()

    def match(self, keys: Sequence[TierKey]) -> int:
        where = self._where
        for i, key in enumerate(keys):
            if key not in where:
                return i
        return len(keys)

    def get_many(self, keys: Sequence[TierKey], *, out: torch.Tensor | None = None) -> torch.Tensor:
        """See :class:`~kvcore.tiers.base.Tier`. ``out``: a reusable batch of at least
        len(keys) pages to fill (its first m pages are returned); fresh memory costs page
        faults that dwarf the copy itself."""
        import torch

        if out is not None and (
            out.shape[1:] != self._slots.shape[1:]
            or out.dtype != self._slots.dtype
            or len(out) < len(keys)
        ):
            raise BadRequest("out must be a batch of at least len(keys) pages of this layout")
        slots = self._take(keys)
        if out is None:
            out = torch.empty((len(slots), *self._slots.shape[1:]), dtype=self._slots.dtype)
        copy_rows(out, range(len(slots)), self._slots, slots)
        return out[: len(slots)]

    def promote(self, keys: Sequence[TierKey], pool: torch.Tensor, page_ids: Sequence[int]) -> int:
        """Copy the pages of the leading run of ``keys`` held here straight into pool
        pages ``page_ids[:m]`` of the pool's rows ``pool`` (KVLayout.pages_view), each
        byte copied once; returns m (pages). Counted as a get."""
        if len(page_ids) < len(keys):
            raise BadRequest("promote needs a pool page for every key")
        slots = self._take(keys)
        promote_rows(pool, page_ids[: len(slots)], self._slots, slots)
        return len(slots)

    def _take(self, keys: Sequence[TierKey]) -> list[int]:
        """Slots of the leading run of ``keys`` held, touched in the policy and counted."""
        check_keys(self.fingerprint, keys)
        count = self.match(keys)
        where, touch = self._where, self._order.touch
        slots = [where[key] for key in keys[:count]]
        for key in keys[:count]:
            touch(key)
        stats = self._stats
        stats.hits += count
        stats.misses += len(keys) - count
        stats.bytes_out += count * self._page_bytes
        return slots

    def put_many(self, keys: Sequence[TierKey], pages: torch.Tensor) -> list[TierKey]:
        return self.put_spill(keys, pages).keys

    def put_spill(self, keys: Sequence[TierKey], pages: torch.Tensor) -> Spilled:
        """:meth:`put_many`, also returning the bytes of what was pushed out.

        ``keys`` are taken oldest first: if the new keys outnumber the slots, the
        first ones go straight to the result, never stored. Keys repeated in the
        batch are stored once (the first occurrence)."""
        check_keys(self.fingerprint, keys)
        check_pages(self.layout, keys, pages)
        return self._put(keys, pages, range(len(keys)))

    def spill_from(
        self, keys: Sequence[TierKey], pool: torch.Tensor, page_ids: Sequence[int]
    ) -> Spilled:
        """:meth:`put_spill` of pool pages ``page_ids[i]`` of the pool's rows ``pool``
        (KVLayout.pages_view) under ``keys[i]``, copied straight into the slots: no
        staging batch, each byte copied once (a GPU pool's pages gathered there, one
        transfer). The bytes of what was pushed out come back as a batch."""
        check_keys(self.fingerprint, keys)
        if (
            tuple(pool.shape[1:]) != self.layout.stored_page_shape
            or pool.dtype != self._slots.dtype
        ):
            raise BadRequest(f"pool must be the rows of a pool of {self.layout}")
        if len(page_ids) != len(keys):
            raise BadRequest("spill_from needs one pool page per key")
        if page_ids and (min(page_ids) < 0 or max(page_ids) >= len(pool)):
            raise BadRequest(f"page ids must be in [0, {len(pool)})")
        return self._put(keys, pool, page_ids)

    def _put(self, keys: Sequence[TierKey], source: torch.Tensor, rows: Sequence[int]) -> Spilled:
        """Store ``source[rows[i]]`` under ``keys[i]`` (:meth:`put_spill`'s rules), the
        evicted entries' bytes copied out before their slots are written."""
        import torch

        where = self._where
        new: dict[TierKey, int] = {}  # key -> its row in ``source``
        for i, key in enumerate(keys):
            if key in where:
                self._order.touch(key)
            elif key not in new:
                new[key] = rows[i]
        overflow = max(len(new) - self.capacity_pages, 0)
        new_rows = list(new.values())
        passed_keys, passed_rows = list(new)[:overflow], new_rows[:overflow]
        store_keys, store_rows = list(new)[overflow:], new_rows[overflow:]
        evict = max(len(store_keys) - len(self._free), 0)
        evicted = [self._evict() for _ in range(evict)]
        table = self._table
        if table is not None:  # FREE before anything is written into them
            for _, slot in evicted:
                table.free(slot)
        self._free.extend(slot for _, slot in reversed(evicted))
        spilled = torch.empty((overflow + evict, *self._slots.shape[1:]), dtype=self._slots.dtype)
        copy_rows(spilled, range(overflow), source, passed_rows)
        take_rows(self._slots, [slot for _, slot in evicted], spilled[overflow:])
        targets = [self._free.pop() for _ in store_keys]
        self._place(store_keys, source, store_rows, targets)
        stats = self._stats
        stats.stored += len(store_keys)
        stats.evicted += evict
        stats.bytes_in += len(store_keys) * self._page_bytes
        stats.pages = len(where)
        stats.bytes_used = len(where) * self._page_bytes
        return Spilled(passed_keys + [key for key, _ in evicted], spilled)

    def _place(
        self,
        keys: Sequence[TierKey],
        source: torch.Tensor,
        rows: Sequence[int],
        slots: Sequence[int],
    ) -> None:
        """Copy ``source[rows[i]]`` into free slot ``slots[i]`` (one memmove per page),
        then hold ``keys[i]`` there: a kept tier's slot is STORED only after its copy."""
        spill_rows(source, rows, self._slots, slots)
        table = self._table
        for key, slot in zip(keys, slots, strict=True):
            self._store(key, slot)
            if table is not None:
                table.store(slot, key)

    def discard(self, keys: Sequence[TierKey]) -> int:
        """Drop the entries of ``keys`` that are held; returns how many."""
        dropped = 0
        for key in keys:
            if key in self._where:
                slot = self._forget(key)
                if self._table is not None:
                    self._table.free(slot)
                self._free.append(slot)
                dropped += 1
        self._stats.pages = len(self._where)
        self._stats.bytes_used = len(self._where) * self._page_bytes
        return dropped

    def check_integrity(self) -> None:
        used = list(self._where.values())
        assert set(self._order) == set(self._where), "the policy and the slots hold other keys"
        assert len(set(used)) == len(used), "two keys share a host slot"
        assert not set(used) & set(self._free), "a slot is both used and free"
        assert len(used) + len(self._free) == self.capacity_pages, "a slot is lost"
        assert len(set(self._free)) == len(self._free), "a free slot is listed twice"
        assert self._stats.pages == len(used), "stats.pages drifted"
        assert self._stats.bytes_used == len(used) * self._page_bytes, "stats.bytes_used drifted"
        if self._table is not None:
            key_of = {slot: key for key, slot in self._where.items()}
            for slot, (state, key) in enumerate(self._table.states()):
                held = key_of.get(slot)
                assert (state == STORED) == (held is not None), f"slot {slot}: table, tier differ"
                assert held is None or key == held, f"slot {slot}: another key in the table"
