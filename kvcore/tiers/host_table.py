"""The host tier's slot table: which slot of a kept host tier holds which entry, in
memory that outlives the daemon (issue 40: a host tier that comes back after any end).

A kept host tier (kvcore.daemon.restart) lives in one untracked POSIX shm segment that
only the daemon maps (mode 0600, never described to a client)::

    offset                        bytes             what
    0                             HEADER_BYTES      Header: magic, version, capacity (slots),
                                                    page bytes, layout fingerprint, byte order
    HEADER_BYTES + s * SLOT_BYTES SLOT_BYTES        slot s: state u8 | pad 7 | seq u64 | key[48]
    data_offset(capacity)         capacity * page   slot s's page at data_offset + s * page
                                                    (4096-aligned)

Integers are little-endian; ``key`` is the entry's TierKey (layout fingerprint ||
prefix key); ``seq`` orders entries by when they were stored (the recency a restart
restores; a clean stop renumbers them in the tier's eviction order).

The durability rule, the index table's (kvcore.daemon.index_table): a crash leaves a
prefix (in program order) of the stores to the segment, and every such prefix brings
back only entries whose bytes are what their key says.

* A slot is FREE (0) or STORED (1); only STORED slots come back.
* A slot is set FREE *before* its bytes may be overwritten or its entry leaves the
  tier (an eviction, a discard): :meth:`SlotTable.free`.
* A FREE slot's page bytes, seq and key are written first, its state byte last
  (:meth:`SlotTable.store`, after the copy): a slot torn by a crash is FREE.

So a STORED slot's bytes are those put under its key, with no checksum. Opening
(:meth:`SlotTable.open`) trusts nothing: the header must be what :meth:`SlotTable.create`
writes for this tier's capacity, page bytes and fingerprint (RestoreRefused names each
difference), and a STORED slot comes back only if its state byte is one this module
writes, its key carries this tier's fingerprint and no other slot claims the key; the
rest are set FREE and counted by cause. The slot index is the slot's place, always in
range.
"""

from __future__ import annotations

import struct
import sys
from collections import Counter
from dataclasses import dataclass, fields

from kvcore.errors import BadRequest, RestoreRefused
from kvcore.tiers.base import FINGERPRINT_BYTES, TIER_KEY_BYTES, TierKey

FREE, STORED = 0, 1
MAGIC = b"KVCHOST\0"
VERSION = 1
HEADER_BYTES = 4096  # the fixed fields use < 64; the rest is room for later versions
SLOT_BYTES = 64  # state, pad, seq, key: one cache line a slot
ALIGN = 4096  # the pages start on a page boundary

_HEADER = struct.Struct(f"<8sIQQ{FINGERPRINT_BYTES}s6s")
_SLOT = struct.Struct(f"<B7xQ{TIER_KEY_BYTES}s")
_FIELDS = struct.Struct(f"<Q{TIER_KEY_BYTES}s")  # seq, key: from offset 8 of a slot
_U64 = struct.Struct("<Q")
assert _SLOT.size == SLOT_BYTES and _HEADER.size <= HEADER_BYTES


def data_offset(capacity: int) -> int:
    """Where slot 0's page starts in the segment: after the header and slots, aligned."""
    return -(-(HEADER_BYTES + capacity * SLOT_BYTES) // ALIGN) * ALIGN


def segment_bytes(capacity: int, page_bytes: int) -> int:
    """Bytes of the segment of a host tier of ``capacity`` slots of ``page_bytes``."""
    return data_offset(capacity) + capacity * page_bytes


@dataclass(frozen=True, slots=True)
class Header:
    """What the segment's bytes mean; defaults: this process's."""

    capacity: int  # slots
    page_bytes: int
    fingerprint: bytes  # kvcore.tiers.base.layout_fingerprint of the pages
    magic: bytes = MAGIC
    version: int = VERSION
    byte_order: bytes = sys.byteorder.encode()

    @classmethod
    def unpack(cls, view: memoryview) -> Header:
        if len(view) < HEADER_BYTES:
            raise RestoreRefused(f"host tier segment truncated: {len(view)} bytes, no header")
        magic, version, capacity, page_bytes, fingerprint, order = _HEADER.unpack_from(view)
        return cls(capacity, page_bytes, fingerprint, magic, version, order.rstrip(b"\0"))

    def pack_into(self, view: memoryview) -> None:
        _HEADER.pack_into(
            view,
            0,
            self.magic,
            self.version,
            self.capacity,
            self.page_bytes,
            self.fingerprint,
            self.byte_order,
        )

    def differences(self, wanted: Header) -> list[str]:
        """Per field that differs, "name found -> wanted"; the magic or version alone."""
        names = [f.name for f in fields(self) if getattr(self, f.name) != getattr(wanted, f.name)]
        names = [name for name in names if name in ("magic", "version")][:1] or names
        return [
            f"{name} {_show(getattr(self, name))} -> {_show(getattr(wanted, name))}"
            for name in names
        ]


def _show(value: object) -> str:
    return (
        value.hex() if isinstance(value, bytes) and len(value) == FINGERPRINT_BYTES else repr(value)
    )


@dataclass(frozen=True, slots=True)
class Found:
    """What :meth:`SlotTable.open` found: the entries to keep, the rest by cause."""

    entries: list[tuple[int, TierKey]]  # (slot, key), oldest seq first
    dropped: Counter[str]  # cause -> slots set FREE: bad_state, bad_fingerprint, duplicate_key


class SlotTable:
    """The slot table over a segment's first bytes: :meth:`create` it or :meth:`open` one
    a dead daemon left; :meth:`free` and :meth:`store` follow the tier. Every store is one
    call of ``_store`` or ``_store_byte`` (a test records the segment after each)."""

    __slots__ = ("_seq", "_view", "header", "opened")

    def __init__(self, view: memoryview, header: Header) -> None:
        """Use :meth:`create` or :meth:`open`."""
        self._view, self.header = view, header
        self._seq = 0  # the last seq written
        self.opened = Found([], Counter())

    @classmethod
    def create(
        cls, buf: memoryview, *, capacity: int, page_bytes: int, fingerprint: bytes
    ) -> SlotTable:
        """A new, empty table over ``buf`` (writable, at least the header and slots): every
        slot FREE, the header, the magic last (:meth:`open` refuses one cut short)."""
        view = _writable(buf, data_offset(capacity))
        if capacity < 1 or page_bytes < 1 or len(fingerprint) != FINGERPRINT_BYTES:
            raise BadRequest(f"a host slot table of {capacity} slots of {page_bytes} bytes")
        view[: data_offset(capacity)] = bytes(data_offset(capacity))
        header = Header(capacity, page_bytes, fingerprint)
        Header(capacity, page_bytes, fingerprint, magic=bytes(len(MAGIC))).pack_into(view)
        view[: len(MAGIC)] = header.magic
        return cls(view, header)

    @classmethod
    def open(
        cls, buf: memoryview, *, capacity: int, page_bytes: int, fingerprint: bytes
    ) -> SlotTable:
        """The table a dead daemon left in ``buf``: RestoreRefused, naming each difference,
        unless its header is what :meth:`create` writes for these settings and ``buf``
        holds every slot and page. Then its slots are checked (the result: ``opened``)."""
        view = _writable(buf, 0)
        found = Header.unpack(view)
        if differences := found.differences(Header(capacity, page_bytes, fingerprint)):
            raise RestoreRefused(f"host tier segment unlike this tier: {'; '.join(differences)}")
        if len(view) < (size := segment_bytes(capacity, page_bytes)):
            raise RestoreRefused(f"host tier segment truncated: {len(view)} bytes of {size}")
        table = cls(view, found)
        table.opened = table._scan()
        return table

    def store(self, slot: int, key: TierKey) -> None:
        """Slot ``slot`` (FREE, its page's bytes already copied in) holds ``key``: its seq
        and key, then its state byte."""
        at = HEADER_BYTES + slot * SLOT_BYTES
        self._seq = seq = self._seq + 1
        self._store(at + 8, _FIELDS.pack(seq, key))
        self._store_byte(at, STORED)

    def free(self, slot: int) -> None:
        """Set slot ``slot`` FREE: before its bytes may change or its entry leaves."""
        self._store_byte(HEADER_BYTES + slot * SLOT_BYTES, FREE)

    def renumber(self, slots: list[int]) -> None:
        """At a clean stop: new seqs for the STORED ``slots``, in that order (the tier's
        eviction order), after every seq so far: the recency a restart restores."""
        for slot in slots:
            at = HEADER_BYTES + slot * SLOT_BYTES
            if self._view[at] == STORED:
                self._seq += 1
                self._store(at + 8, _U64.pack(self._seq))

    def states(self) -> list[tuple[int, bytes]]:
        """(state, key) of every slot, in slot order: for integrity checks."""
        end = HEADER_BYTES + self.header.capacity * SLOT_BYTES
        with self._view[HEADER_BYTES:end] as region:
            return [(state, key) for state, _, key in _SLOT.iter_unpack(region)]

    def close(self) -> None:
        """Release the buffer; the table is unusable."""
        self._view.release()

    def _scan(self) -> Found:
        """Every STORED slot that verifies (module docstring), oldest seq first; the
        others counted by cause and set FREE. O(slots)."""
        fingerprint = self.header.fingerprint
        end = HEADER_BYTES + self.header.capacity * SLOT_BYTES
        dropped: Counter[str] = Counter()
        kept: dict[bytes, tuple[int, int]] = {}  # key -> (seq, slot)
        twice: set[bytes] = set()
        bad: list[int] = []
        last_seq = 0
        with self._view[HEADER_BYTES:end] as region:
            for slot, (state, seq, key) in enumerate(_SLOT.iter_unpack(region)):
                if state == FREE:
                    continue
                last_seq = max(last_seq, seq)
                if state != STORED:
                    cause = "bad_state"
                elif key[:FINGERPRINT_BYTES] != fingerprint:
                    cause = "bad_fingerprint"
                elif key in kept or key in twice:
                    cause = "duplicate_key"
                    if key in kept:  # the first slot of this key goes too
                        twice.add(key)
                        bad.append(kept.pop(key)[1])
                        dropped[cause] += 1
                else:
                    kept[key] = (seq, slot)
                    continue
                dropped[cause] += 1
                bad.append(slot)
        for slot in bad:
            self.free(slot)
        self._seq = min(last_seq, 1 << 62)  # a garbage seq must not overflow the next ones
        ordered = sorted((seq, slot, key) for key, (seq, slot) in kept.items())
        return Found([(slot, TierKey(key)) for _, slot, key in ordered], dropped)

    # -- stores: each is one crash point ----------------------------------------------

    def _store(self, at: int, data: bytes) -> None:
        self._view[at : at + len(data)] = data

    def _store_byte(self, at: int, value: int) -> None:
        self._view[at] = value


def _writable(buf: memoryview, size: int) -> memoryview:
    view = memoryview(buf).cast("B")
    if view.readonly or len(view) < size:
        raise BadRequest(f"a host slot table needs {size} writable bytes, got {len(view)}")
    return view
