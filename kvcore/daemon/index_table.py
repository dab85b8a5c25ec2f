"""The durable index table: a pool's prefix index mirrored, one slot per page, into
memory that outlives the daemon (issue 40, "restart without losing the cache").

A dead daemon leaves its host pool's segment and this table behind; the next one
re-adopts the pages it says are committed (:meth:`IndexTable.open` scans it,
``Manager.restore`` indexes them). A fixed-size writable buffer (the daemon's: an
untracked POSIX shm segment only it maps)::

    offset                         bytes         what
    0                              HEADER_BYTES  Header (magic, version, prefix.DOMAIN, byte
                                                 order, sizes, settings digest); clean flag
                                                 at CLEAN_AT, arena tail at TAIL_AT
    HEADER_BYTES + p * slot_bytes  slot_bytes    slot of page p: state u8 | pad 3 | space_ref
                                                 u32 | seq u64 | key[32] | parent[32] |
                                                 tokens[4 * page_size] | pad to 8
    HEADER_BYTES + n * slot_bytes  arena_bytes   KeySpace records: crc32 u32 | len u16 | msgpack

Integers are little-endian; sizes in bytes, tokens u32 as kvcore.prefix encodes them;
``seq`` orders slots by when they were stored (the recency a restart restores).

The durability rule: a crash leaves a prefix (in program order) of the table's stores;
every such prefix restores only pages whose bytes are what their key says.

* A slot is FREE (0), PENDING (1) or STORED (2); only STORED slots are restored.
* A slot is set FREE *before* its page leaves the index (:class:`MirroredIndex`), so
  before any writer (an engine, a promotion copy) may be handed the page.
* A slot's fields are written while it is FREE, its state byte last: a torn slot is
  FREE, a STORED one whole.
* A page an engine committed (its bytes landed first) is STORED at once; one indexed
  "as if committed" before its bytes exist (adopt, adopt_pages with a medium) is
  PENDING until :meth:`IndexTable.placed`, called after the copy.
* A KeySpace record is written whole before the tail moves past it; a slot names it
  by offset. A full arena leaves the page FREE: indexed, not durable (``unstored``).

So a slot is STORED or PENDING iff its page is indexed under its key, but for pages
the arena had no room for (:meth:`MirroredIndex.check_integrity`). Opening trusts
nothing: the header must be what this process writes (RestoreRefused names each
difference); a STORED slot must hold ``page_key(parent, tokens) == key``, a record
(CRC'd, of a key space ``root_key`` takes) at ``space_ref``, a key no other slot
holds and the key space its chain proves, or be dropped and set FREE.

The key binds the tokens to the parent, not to ``space_ref``: a ref rewritten to
another record would restore the page under another tenant, model, adapter or salt.
So a slot whose parent is a root (``root_key`` of a record's space, as
kvcore.prefix derives a chain's first parent) must name that space, and one whose
parent is another kept slot's key the space that slot's chain proves, resolved from
the root down (so a slot dropped for its space still passes the right one on);
else it is dropped ("wrong_space"). An orphan, a slot whose parent is neither, is a
page whose chain's head left first, which the index does hold: eviction is not leaf
first across sequences (two that computed one prefix: the second's later pages hang
off the first's pages, which can be evicted before them), and an orphan hits again
once its parent is committed again. So orphans are kept, but nothing can prove an
orphan's space: its chain (it and the kept slots below it) must name one space, or
all of it is dropped ("mixed_space"); a lone orphan's ``space_ref`` is the one field
a restart takes on trust.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
import sys
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace

import msgspec

from kvcore.allocator import PageId
from kvcore.errors import BadRequest, RestoreRefused
from kvcore.prefix import (
    DOMAIN,
    KeySpace,
    PageStored,
    PrefixIndex,
    PrefixKey,
    page_key,
    root_key,
)

FREE, PENDING, STORED = 0, 1, 2
MAGIC = b"KVCIDXT\0"
VERSION = 1
HEADER_BYTES = 4096  # fixed fields use < 256; the rest is room for later versions
CLEAN_AT = 240  # u8: 1 after a clean stop, 0 while a daemon uses the table
TAIL_AT = 248  # u64: arena bytes holding whole records
SLOT_HEAD = 80  # state, pad, space_ref, seq, key, parent: the bytes before the tokens
MAX_DIGEST = 64  # bytes of the caller's settings digest
MIN_ARENA, ARENA_PER_PAGE = 1 << 20, 16  # default arena: the larger, in bytes

_HEADER = struct.Struct("<8sI64s6sQIQB64s")  # Header's fields, magic first; digest: u8 len
_U64 = struct.Struct("<Q")
_RECORD = struct.Struct("<IH")  # crc32 of the body, body bytes; body: msgpack [4 x str]
_SPACE = msgspec.msgpack.Decoder(tuple[str, str, str, str])
assert _HEADER.size <= CLEAN_AT < TAIL_AT and TAIL_AT + 8 <= HEADER_BYTES
assert len(DOMAIN) <= 64 and not DOMAIN.endswith(b"\0")

WritableBuffer = mmap.mmap | bytearray | memoryview
_insert_chain, _remove = PrefixIndex.insert_chain, PrefixIndex.remove  # for MirroredIndex


def slot_bytes(page_size: int) -> int:
    """Bytes of one slot: its head and ``page_size`` u32 tokens, 8-byte aligned."""
    return -(-(SLOT_HEAD + 4 * page_size) // 8) * 8


@dataclass(frozen=True, slots=True)
class Header:
    """The fixed fields, what the bytes mean: written at create; defaults: this process's."""

    num_pages: int
    page_size: int  # tokens per page
    arena_bytes: int
    settings_digest: bytes  # the caller's digest of the settings a re-adoption needs equal
    magic: bytes = MAGIC
    version: int = VERSION
    domain: bytes = DOMAIN  # kvcore.prefix.DOMAIN: the key derivation the keys follow
    byte_order: bytes = sys.byteorder.encode()  # the pool's pages are in it

    @classmethod
    def unpack(cls, view: memoryview) -> Header:
        """The header at the start of ``view``; RestoreRefused if it is too short."""
        if len(view) < HEADER_BYTES:
            raise RestoreRefused(f"index table truncated: {len(view)} bytes, no whole header")
        magic, version, domain, order, pages, size, arena, n, digest = _HEADER.unpack_from(view)
        domain, order = domain.rstrip(b"\0"), order.rstrip(b"\0")
        return cls(pages, size, arena, digest[:n], magic, version, domain, order)

    def pack_into(self, view: memoryview) -> None:
        head = (self.magic, self.version, self.domain, self.byte_order, self.num_pages)
        sizes = (self.page_size, self.arena_bytes, len(self.settings_digest))
        _HEADER.pack_into(view, 0, *head, *sizes, self.settings_digest)

    def differences(self, wanted: Header) -> list[str]:
        """Per field that differs, "name found -> wanted"; the magic or version alone."""
        names = [f.name for f in fields(self) if getattr(self, f.name) != getattr(wanted, f.name)]
        names = [name for name in names if name in ("magic", "version")][:1] or names
        return [f"{name} {getattr(self, name)!r} -> {getattr(wanted, name)!r}" for name in names]


@dataclass(frozen=True, slots=True)
class Scan:
    """What a scan of the slots found: the entries to restore, the rest by cause."""

    entries: list[PageStored]  # STORED and verified, oldest seq first; medium ""
    dropped: Counter[str]  # cause -> slots set FREE: pending, bad_{state,space,key},
    # duplicate_key, {wrong,mixed}_space


class IndexTable:
    """The table over one buffer: :meth:`create` it or :meth:`open` what a dead daemon
    left; :meth:`store`, :meth:`free`, :meth:`placed` follow the index. Every store is
    one call of a ``_store*`` method (a test records the buffer after each)."""

    def __init__(self, view: memoryview, header: Header, tail: int) -> None:
        """Use :meth:`create` or :meth:`open`."""
        self._view, self.header = view, header
        self._stride = slot_bytes(header.page_size)
        self._arena = HEADER_BYTES + header.num_pages * self._stride
        self._fields = struct.Struct(f"<IQ32s32s{4 * header.page_size}s")  # from space_ref on
        self._spaces, self._tail = _parse_arena(view[self._arena :], tail)
        self._refs = {space: ref for ref, space in self._spaces.items()}
        self._last: tuple[KeySpace | None, int] = (None, 0)  # the last space stored, its ref
        self._seq = self.unstored = 0  # the last seq written; pages not stored (arena full)
        self.was_clean = view[CLEAN_AT] == 1
        self.opened = Scan([], Counter())

    @staticmethod
    def size_for(num_pages: int, page_size: int, arena_bytes: int | None = None) -> int:
        """Bytes of a table of ``num_pages`` pages of ``page_size`` tokens."""
        arena = max(MIN_ARENA, ARENA_PER_PAGE * num_pages) if arena_bytes is None else arena_bytes
        return HEADER_BYTES + num_pages * slot_bytes(page_size) + arena

    @classmethod
    def create(
        cls,
        buf: WritableBuffer,
        *,
        num_pages: int,
        page_size: int,
        settings_digest: bytes,
        arena_bytes: int | None = None,
    ) -> IndexTable:
        """A new, empty table over ``buf`` (writable, :meth:`size_for` bytes at least):
        zeros, the header, the magic last (:meth:`open` refuses a table cut short). The
        arena is 16 B a page, >= 1 MiB, by default. BadRequest for bad sizes."""
        size = cls.size_for(num_pages, page_size, arena_bytes)
        arena = size - cls.size_for(num_pages, page_size, 0)
        if min(num_pages, page_size, arena + 1) < 1 or len(settings_digest) > MAX_DIGEST:
            raise BadRequest(
                f"an index table of {num_pages} pages of {page_size} tokens, {arena} arena "
                f"bytes, a digest of {len(settings_digest)} bytes (at most {MAX_DIGEST})"
            )
        view, chunk = _writable(buf, size), bytes(1 << 20)
        for at in range(0, size, len(chunk)):
            view[at : at + min(len(chunk), size - at)] = chunk[: size - at]
        header = Header(num_pages, page_size, arena, settings_digest)
        replace(header, magic=bytes(len(MAGIC))).pack_into(view)
        view[: len(MAGIC)] = MAGIC
        return cls(view, header, 0)

    @classmethod
    def open(
        cls, buf: WritableBuffer, *, num_pages: int, page_size: int, settings_digest: bytes
    ) -> IndexTable:
        """The table a dead daemon left in ``buf``, adopted: RestoreRefused, naming each
        difference, unless its header is what :meth:`create` writes for these settings
        and ``buf`` holds all of it. Then it scans the slots (the result: ``opened``),
        notes whether the last daemon stopped cleanly (``was_clean``), clears the flag."""
        view = _writable(buf, 0)
        found = Header.unpack(view)
        wanted = Header(num_pages, page_size, found.arena_bytes, settings_digest)
        if differences := found.differences(wanted):
            raise RestoreRefused(f"index table unlike this pool's: {'; '.join(differences)}")
        size = cls.size_for(num_pages, page_size, found.arena_bytes)
        if len(view) < size:
            raise RestoreRefused(f"index table truncated: {len(view)} bytes of {size}")
        table = cls(view, found, _U64.unpack_from(view, TAIL_AT)[0])
        table._store(TAIL_AT, _U64.pack(table._tail))  # past the last whole record
        table._store_byte(CLEAN_AT, 0)
        table.opened = table.scan()
        return table

    def store(self, entry: PageStored, pending: bool = False) -> bool:
        """Write ``entry``'s FREE slot, then its state: PENDING (its bytes are not placed
        yet) or STORED; a slot STORED under this key (a restored page) is left as it is.
        False, the slot left FREE, if the arena has no room for a new key space."""
        page = entry.page
        assert 0 <= page < self.header.num_pages, f"page {page} is not in the table"
        at = HEADER_BYTES + page * self._stride
        if self._view[at] != FREE:  # a restored page: STORED under this key already
            key = self._view[at + 16 : at + 48].tobytes()
            assert self._view[at] == STORED and key == entry.key, f"page {page}: another key"
            return True
        assert len(entry.tokens) == 4 * self.header.page_size, f"page {page}: not a page"
        space, (last, ref) = entry.space, self._last
        if space is not last:
            found = self._refs.get(space)
            if found is None and (found := self._add_space(space)) is None:
                self.unstored += 1
                return False
            self._last, ref = (space, found), found
        self._seq = seq = self._seq + 1
        self._store_fields(at, ref, seq, entry.key, entry.parent_key, entry.tokens)
        self._store_byte(at, PENDING if pending else STORED)
        return True

    def free(self, page: PageId) -> None:
        """Set page ``page``'s slot FREE: before the page leaves the index."""
        assert 0 <= page < self.header.num_pages, f"page {page} is not in the table"
        self._store_byte(HEADER_BYTES + page * self._stride, FREE)

    def placed(self, pages: Iterable[PageId]) -> None:
        """PENDING -> STORED for each of ``pages``: their bytes are in the pool now. Call
        after the copy, with no Manager call since the adopt that indexed them (nothing
        could evict them meanwhile); a slot not PENDING is left as it is."""
        for page in pages:
            assert 0 <= page < self.header.num_pages, f"page {page} is not in the table"
            if self._view[at := HEADER_BYTES + page * self._stride] == PENDING:
                self._store_byte(at, STORED)

    def scan(self) -> Scan:
        """Every STORED slot that verifies (the module docstring), oldest seq first; the
        others are counted by cause and set FREE. O(pages), one SHA-256 per STORED slot
        and one per key-space record (:func:`_misplaced`)."""
        page_size, stride = self.header.page_size, self._stride
        slot = struct.Struct(f"<B3xIQ32s32s{4 * page_size}s{stride - SLOT_HEAD - 4 * page_size}x")
        region = self._view[HEADER_BYTES : self._arena]
        spaces: dict[int, KeySpace] = {}  # ref -> space, of each record with a root
        roots: dict[bytes, KeySpace] = {}  # root_key(space) -> space, of each record
        for ref, record in self._spaces.items():
            with contextlib.suppress(BadRequest):  # a part over 256 bytes: no index has it
                roots.setdefault(root_key(record), record)
                spaces[ref] = record
        dropped: Counter[str] = Counter()
        kept: dict[bytes, tuple[int, PageStored]] = {}  # key -> (seq, entry)
        bad: list[int] = []
        twice: set[bytes] = set()  # keys dropped for being in two slots
        last_seq = self._seq
        for page, (state, ref, seq, key, parent, tokens) in enumerate(slot.iter_unpack(region)):
            if state == FREE:
                continue
            last_seq = max(last_seq, seq)
            space = spaces.get(ref)
            if state != STORED:
                cause = "pending" if state == PENDING else "bad_state"
            elif space is None:
                cause = "bad_space"
            elif page_key(parent, tokens) != key:
                cause = "bad_key"
            elif key in kept or key in twice:
                cause = "duplicate_key"
                if key in kept:  # the first slot of this key goes too
                    twice.add(key)
                    bad.append(kept.pop(key)[1].page)
                    dropped[cause] += 1
            else:  # NewType calls skipped: one per slot of a million
                kept[key] = (seq, PageStored(key, parent, page, tokens, space))  # type: ignore[arg-type]
                continue
            dropped[cause] += 1
            bad.append(page)
        region.release()
        ordered = [entry for _, entry in sorted(kept.values(), key=lambda p: (p[0], p[1].page))]
        if causes := _misplaced(ordered, kept, roots):
            ordered = [entry for entry in ordered if entry.key not in causes]
            dropped.update(causes.values())
            bad += [kept[key][1].page for key in causes]
        for page in bad:
            self._store_byte(HEADER_BYTES + page * stride, FREE)
        self._seq = min(last_seq, 1 << 63)  # a garbage seq must not overflow the next ones
        return Scan(ordered, dropped)

    def mark_clean(self, order: Iterable[PageId] = ()) -> None:
        """At a clean stop: new seqs for the STORED pages of ``order``, in that order,
        after every seq so far (the recency a restart restores); then the clean flag."""
        for page in order:
            if self._view[at := HEADER_BYTES + page * self._stride] == STORED:
                self._seq += 1
                self._store(at + 8, _U64.pack(self._seq))
        self._store_byte(CLEAN_AT, 1)

    def slots(self) -> list[tuple[int, bytes]]:
        """(state, key) of every slot, in page order: for integrity checks."""
        with self._view[HEADER_BYTES : self._arena] as region:
            return list(struct.iter_unpack(f"<B15x32s{self._stride - 48}x", region))

    def close(self) -> None:
        """Release the buffer (an mmap can be closed only then); the table is unusable."""
        self._view.release()

    # -- stores: each is one crash point ----------------------------------------

    def _store(self, at: int, data: bytes) -> None:
        self._view[at : at + len(data)] = data

    def _store_fields(
        self, at: int, ref: int, seq: int, key: bytes, parent: bytes, tokens: bytes
    ) -> None:
        """The slot's fields after its state byte (space_ref on): one multi-byte store."""
        self._fields.pack_into(self._view, at + 4, ref, seq, key, parent, tokens)

    def _store_byte(self, at: int, value: int) -> None:
        self._view[at] = value

    def _add_space(self, space: KeySpace) -> int | None:
        """Append ``space``'s record, then move the tail past it: its ref (None: full)."""
        assert space.namespace is not None, "an indexed key space is resolved"
        body = msgspec.msgpack.encode(tuple(space))
        record = _RECORD.pack(zlib.crc32(body), len(body)) + body
        if (ref := self._tail) + len(record) > self.header.arena_bytes:
            return None
        self._store(self._arena + ref, record)
        self._tail = ref + len(record)
        self._store(TAIL_AT, _U64.pack(self._tail))
        self._refs[space], self._spaces[ref] = ref, space
        return ref


def _writable(buf: WritableBuffer, size: int) -> memoryview:
    """``buf`` as a writable byte view of at least ``size`` bytes; BadRequest if not."""
    view = memoryview(buf).cast("B")
    if view.readonly or len(view) < size:
        raise BadRequest(f"an index table needs {size} writable bytes, got {len(view)}")
    return view


def _parse_arena(arena: memoryview, tail: int) -> tuple[dict[int, KeySpace], int]:
    """(ref -> KeySpace of each whole record before ``tail``, the end of the last): up
    to the first record cut off, failing its CRC, or not four strs."""
    spaces: dict[int, KeySpace] = {}
    at, end = 0, min(tail, len(arena))
    while at + _RECORD.size <= end:
        crc, size = _RECORD.unpack_from(arena, at)
        body = bytes(arena[at + _RECORD.size : at + _RECORD.size + size])
        if at + _RECORD.size + size > end or zlib.crc32(body) != crc:
            break
        try:
            spaces[at] = KeySpace(*_SPACE.decode(body))
        except msgspec.DecodeError:
            break
        at += _RECORD.size + size
    return spaces, at


def _misplaced(
    entries: list[PageStored],
    kept: dict[bytes, tuple[int, PageStored]],
    roots: dict[bytes, KeySpace],
) -> dict[bytes, str]:
    """key -> cause, of each of ``entries`` (verified keys; ``kept``: key -> (seq,
    entry) of each) whose key space its chain contradicts. A chain starts at a root
    (``roots``: root_key(space) -> space) or at an orphan, an entry whose parent key
    is neither a root nor a key of ``kept``; every entry below a root must have that
    root's space ("wrong_space"), and every entry of an orphan's chain one space,
    whichever it is ("mixed_space": the whole chain goes, as nothing tells which
    entry is wrong). O(entries), in any order: an entry's parent is resolved first
    (walking up to one resolved before); in seq order (a parent is stored before its
    children, but for an orphan's parent committed again) it is at once."""
    chain: dict[bytes, KeySpace | bytes] = dict(roots)  # key -> its root's space or orphan
    get, limit = chain.get, len(kept)
    causes: dict[bytes, str] = {}
    orphans: dict[bytes, KeySpace] = {}  # orphan -> the space of its chain's first entry
    mixed: set[bytes] = set()  # orphans whose chain holds two spaces
    for entry in entries:  # an entry met again (an ancestor walked up to) is judged again
        proof = get(entry.parent_key)
        if proof is entry.space:  # the common case: spaces are the arena's objects
            chain[entry.key] = proof
            continue
        path = [entry]
        while proof is None:
            above = kept.get(path[-1].parent_key)
            if above is None or len(path) > limit:  # limit: a cycle, which SHA-256 rules out
                proof = path[-1].key  # an orphan: its chain is named by its key
                break
            path.append(above[1])
            proof = get(above[1].parent_key)
        for step in path:
            chain[step.key], space = proof, step.space
            if proof is space:
                continue
            if isinstance(proof, bytes):
                if orphans.setdefault(proof, space) != space:
                    mixed.add(proof)
            elif proof != space:
                causes[step.key] = "wrong_space"
    if mixed:
        causes.update((e.key, "mixed_space") for e in entries if chain[e.key] in mixed)
    return causes


class MirroredIndex(PrefixIndex):
    """A PrefixIndex mirrored into an :class:`IndexTable` in the order the durability
    rule needs: :meth:`remove` frees the slot before the page leaves the index (so
    before ``take`` hands it out); :meth:`insert_chain` writes a slot for each entry it
    indexed (a key another page holds is not), PENDING for a medium's pages. No
    Manager operation hands a page out between the two, so no writer ever holds a page
    whose slot is STORED. Give it to ``Manager(layout, index=...)``."""

    __slots__ = ("_free", "_store", "table", "unstored_pages")

    def __init__(self, table: IndexTable) -> None:
        super().__init__()
        self.table, self._store, self._free = table, table.store, table.free  # bound once
        self.unstored_pages: set[PageId] = set()  # indexed, slot FREE: the arena was full

    def insert_chain(
        self,
        parent_key: PrefixKey,
        keys: Sequence[PrefixKey],
        pages: Sequence[PageId],
        token_bytes: bytes,
        space: KeySpace = KeySpace(""),
        medium: str = "",
    ) -> list[PageStored]:
        inserted = _insert_chain(self, parent_key, keys, pages, token_bytes, space, medium)
        store, pending = self._store, medium != ""
        for entry in inserted:
            if not store(entry, pending):
                self.unstored_pages.add(entry.page)
        return inserted

    def remove(self, page: PageId) -> None:
        self._free(page)
        if self.unstored_pages:
            self.unstored_pages.discard(page)
        _remove(self, page)

    def check_integrity(self) -> None:
        """The index's invariants, and the table's (module docstring). O(pages)."""
        super().check_integrity()
        key_of, entries, unstored = self.key_by_page, self.entries, self.unstored_pages
        assert len(unstored) <= self.table.unstored, "more pages unstored than counted"
        for page, (state, key) in enumerate(self.table.slots()):
            indexed = key_of.get(PageId(page))
            if state == FREE:
                assert indexed is None or page in unstored, f"page {page} indexed, slot FREE"
                continue
            entry = entries.get(PrefixKey(key))
            assert indexed == key and page not in unstored, f"page {page}: slot, index differ"
            assert entry and (state == STORED or (state == PENDING and entry.medium)), page
