"""A kept host tier (kvcore.tiers.host_table): its slots and slot table in one segment
that outlives the daemon, re-adopted after any end (issue 40, point 1, "Tiers").

In process: a HostTier over a segment (a tensor standing for the shm segment), every
entry's page filled with its key's marker. A crash image (a copy of the segment) is
taken after every store to the slot table (a multi-byte store also half done) and
during every page copy into a slot (half the page, then all of it); a restart from any
image brings back only entries holding their key's marker. Two controls, each a table
that breaks one rule, must be caught: one that marks a slot STORED before its copy,
one that leaves an evicted slot STORED while another key's bytes go in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import RestoreRefused
from kvcore.layout import KVLayout
from kvcore.tiers import HostTier
from kvcore.tiers import host as host_module
from kvcore.tiers.base import TierKey, layout_fingerprint, tier_keys
from kvcore.tiers.host_table import (
    FREE,
    HEADER_BYTES,
    SLOT_BYTES,
    STORED,
    SlotTable,
    data_offset,
    segment_bytes,
)
from kvcore.tiers.transfer import spill_rows

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32", num_pages=8
)
KEYS = tier_keys(layout_fingerprint(LAYOUT), [bytes([i + 1]) * 32 for i in range(10)])


def marker(key: TierKey) -> float:
    return float(KEYS.index(key) + 1)


def pages_of(keys: Sequence[TierKey]) -> torch.Tensor:
    """A batch of ``keys``' pages, each filled with its key's marker."""
    batch = torch.empty((len(keys), *LAYOUT.stored_page_shape), dtype=torch.float32)
    for i, key in enumerate(keys):
        batch[i].fill_(marker(key))
    return batch


def reopen(image: torch.Tensor, capacity: int) -> HostTier:
    """The host tier a restart would find in (a copy of) ``image``."""
    return HostTier(LAYOUT, capacity, segment=image.clone(), restore=True)


def check_image(image: torch.Tensor, capacity: int) -> HostTier:
    """A restart from ``image`` brings back only entries holding their key's marker."""
    tier = reopen(image, capacity)
    assert not tier.dropped, tier.dropped  # this table never writes a slot it must drop
    held = tier.keys()
    for key in held:
        page = tier.get_many([key])[0]
        assert bool((page == marker(key)).all()), f"entry {marker(key)}: not its bytes"
    tier.check_integrity()
    return tier


class RecordingTable(SlotTable):
    """A SlotTable that calls ``on_store`` after each store (a multi-byte store twice:
    after its first half too, as a torn store leaves it)."""

    on_store: Any = staticmethod(lambda: None)

    def _store(self, at: int, data: bytes) -> None:
        if len(data) > 1:
            super()._store(at, data[: len(data) // 2])
            RecordingTable.on_store()
        super()._store(at, data)
        RecordingTable.on_store()

    def _store_byte(self, at: int, value: int) -> None:
        super()._store_byte(at, value)
        RecordingTable.on_store()


class LazyFree(RecordingTable):
    """Control: a slot stays STORED while its entry is evicted and its bytes overwritten."""

    def free(self, slot: int) -> None:
        pass


class Recorded(HostTier):
    slot_table = RecordingTable


class StoredFirst(Recorded):
    """Control: a slot marked STORED, with its key, before its page is copied in."""

    def _place(
        self,
        keys: Sequence[TierKey],
        source: torch.Tensor,
        rows: Sequence[int],
        slots: Sequence[int],
    ) -> None:
        table = self._table
        assert table is not None
        for key, slot in zip(keys, slots, strict=True):
            self._store(key, slot)
            table.store(slot, key)
        spill_rows(source, rows, self._slots, slots)


class LazyFreeTier(Recorded):
    slot_table = LazyFree


class Rig:
    """A kept host tier of ``capacity`` slots over ``segment``, a crash image checked at
    every table store and every page copy (half a page, then the whole)."""

    def __init__(self, capacity: int, tier_type: type[HostTier] = Recorded) -> None:
        self.capacity = capacity
        self.segment = torch.zeros(segment_bytes(capacity, LAYOUT.page_bytes), dtype=torch.uint8)
        RecordingTable.on_store = staticmethod(self.crash_point)
        self.tier = tier_type(LAYOUT, capacity, segment=self.segment)
        self.images = 0

    def crash_point(self) -> None:
        self.images += 1
        check_image(self.segment, self.capacity)

    def copy_by_page(
        self, src: torch.Tensor, rows: Sequence[int], dst: torch.Tensor, targets: Sequence[int]
    ) -> None:
        """spill_rows into the slots a page at a time, a crash image mid-page and after."""
        for row, slot in zip(rows, targets, strict=True):
            into = dst[slot].reshape(-1).view(torch.uint8)
            data = src[row].reshape(-1).view(torch.uint8)
            half = len(into) // 2
            into[:half].copy_(data[:half])
            self.crash_point()
            into.copy_(data)
            self.crash_point()

    def restart(self) -> None:
        """A clean stop (renumbered in eviction order), then a start on the same segment."""
        order = self.tier.keys()
        self.tier.settle()
        self.tier = type(self.tier)(LAYOUT, self.capacity, segment=self.segment, restore=True)
        assert self.tier.keys() == order, "the eviction order did not come back"


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "spill_from", "discard", "get", "promote", "restart"]),
        st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=5),
    ),
    min_size=1,
    max_size=25,
)


def drive(rig: Rig, ops: list[tuple[str, list[int]]]) -> None:
    pool = LAYOUT.pages_view(torch.zeros(LAYOUT.total_bytes, dtype=torch.uint8))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host_module, "spill_rows", rig.copy_by_page)
        for op, which in ops:
            keys = [KEYS[i] for i in which]
            tier = rig.tier
            if op == "put":
                tier.put_spill(keys, pages_of(keys))
            elif op == "spill_from":
                page_ids = list(range(len(keys)))
                pool[page_ids] = pages_of(keys)
                tier.spill_from(keys, pool, page_ids)
            elif op == "discard":
                tier.discard(keys)
            elif op == "get":
                for key, page in zip(keys, tier.get_many(keys), strict=False):
                    assert bool((page == marker(key)).all())
            elif op == "promote":
                got = tier.promote(keys, pool, list(range(len(keys))))
                assert bool((pool[:got] == pages_of(keys[:got])).all())
            else:
                rig.restart()
            rig.tier.check_integrity()
            check_image(rig.segment, rig.capacity)


@settings(max_examples=80, deadline=None)
@given(capacity=st.integers(1, 4), ops=OPS)
def test_no_crash_image_of_a_kept_host_tier_restores_a_wrong_entry(
    capacity: int, ops: list[tuple[str, list[int]]]
) -> None:
    """Random puts, spills from a pool, discards, reads and clean restarts of a tier of
    1 to 4 slots (evictions overwrite slots): every crash image restores only entries
    holding their key's marker, and between operations the table mirrors the tier."""
    drive(Rig(capacity), ops)


def churn(rig: Rig) -> None:
    """Enough traffic through two slots that every slot is evicted and written over."""
    drive(rig, [("put", [0, 1]), ("put", [2]), ("put", [3, 4]), ("discard", [4]), ("put", [5])])


def test_churn_checks_images_and_restores_the_last_entries() -> None:
    rig = Rig(2)
    churn(rig)
    assert rig.images > 20
    back = check_image(rig.segment, 2)
    assert back.keys() == [KEYS[3], KEYS[5]] and back.restored == 2


def test_control_a_slot_stored_before_its_copy_is_caught() -> None:
    with pytest.raises(AssertionError, match="not its bytes"):
        churn(Rig(2, StoredFirst))


def test_control_a_slot_left_stored_while_overwritten_is_caught() -> None:
    with pytest.raises(AssertionError, match="not its bytes"):
        churn(Rig(2, LazyFreeTier))


def test_reopen_drops_what_it_cannot_vouch_for() -> None:
    """A slot of another fingerprint, a key in two slots (both go), a state byte this
    module never writes: set FREE and counted; the rest come back."""
    segment = torch.zeros(segment_bytes(4, LAYOUT.page_bytes), dtype=torch.uint8)
    tier = HostTier(LAYOUT, 4, segment=segment)
    tier.put_many(KEYS[:4], pages_of(KEYS[:4]))
    tier.settle()
    raw = segment.numpy()
    slot = [HEADER_BYTES + s * SLOT_BYTES for s in range(4)]
    raw[slot[0] + 16] ^= 0xFF  # the key's fingerprint, first byte
    raw[slot[2] + 16 : slot[2] + 64] = raw[slot[1] + 16 : slot[1] + 64]  # slot 1's key twice
    raw[slot[3]] = 7
    back = HostTier(LAYOUT, 4, segment=segment, restore=True)
    assert back.restored == 0 and len(back) == 0
    assert dict(back.dropped) == {"bad_fingerprint": 1, "duplicate_key": 2, "bad_state": 1}
    assert all(raw[at] == FREE for at in slot)
    back.check_integrity()
    back.put_many(KEYS[:4], pages_of(KEYS[:4]))  # every slot usable again
    assert all(raw[at] == STORED for at in slot)


def test_reopen_refuses_another_tier_by_name() -> None:
    segment = torch.zeros(segment_bytes(3, LAYOUT.page_bytes), dtype=torch.uint8)
    HostTier(LAYOUT, 3, segment=segment).settle()
    with pytest.raises(RestoreRefused, match="capacity 3 -> 2"):
        HostTier(LAYOUT, 2, segment=segment, restore=True)
    other = KVLayout(2, 1, 4, 2, "bfloat16", 8)
    bigger = torch.zeros(segment_bytes(3, LAYOUT.page_bytes), dtype=torch.uint8)
    with pytest.raises(RestoreRefused, match="page_bytes"):
        HostTier(other, 3, segment=segment, restore=True)
    with pytest.raises(RestoreRefused, match="magic"):
        HostTier(LAYOUT, 3, segment=bigger, restore=True)  # zeros: never a table
    assert data_offset(3) % 4096 == 0
