"""The durable index table (kvcore.daemon.index_table): its header, crashes at every
store of a Manager's operations, and torn or garbage bytes.

The crash machine plays the engine and a lower tier over a ``bytearray`` pool: it
writes a nonce into every page it is handed (fresh, evicted-and-reused, adopted) and
the page's key (its marker) before committing it or, for an adopted page, before
``placed``. After each store the table makes (a torn multi-byte store too) and after
each operation it copies the table's and the pool's real bytes (a crash image) and
checks what a restart would restore from them: only pages indexed at that instant,
each holding its key's marker, none handed to a writer since it was indexed.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcore import KVLayout, Manager
from kvcore.allocator import PageId
from kvcore.daemon.index_table import (
    FREE,
    HEADER_BYTES,
    STORED,
    TAIL_AT,
    Header,
    IndexTable,
    MirroredIndex,
    slot_bytes,
)
from kvcore.errors import BadRequest, OutOfPages, RestoreRefused
from kvcore.prefix import (
    KeySpace,
    PageStored,
    PrefixKey,
    chain_keys,
    encode_tokens,
    page_key,
    root_key,
)

DIGEST = b"settings-digest"
MARK = 32  # bytes of each page's marker region in the test's pool
SPACES = [KeySpace("default"), KeySpace("default", model="m"), KeySpace("t", salt="sé")]


class RecordingTable(IndexTable):
    """An IndexTable that calls ``on_store`` after each store it makes (a multi-byte
    store twice: after its first half too, as a torn store leaves it)."""

    __slots__ = ("on_store",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.on_store = lambda: None

    def _store(self, at: int, data: bytes) -> None:
        if len(data) > 1:
            super()._store(at, data[: len(data) // 2])
            self.on_store()
        super()._store(at, data)
        self.on_store()

    def _store_fields(
        self, at: int, ref: int, seq: int, key: bytes, parent: bytes, tokens: bytes
    ) -> None:
        packed = self._fields.pack(ref, seq, key, parent, tokens)
        super()._store(at + 4, packed[: len(packed) // 2])  # torn
        self.on_store()
        super()._store_fields(at, ref, seq, key, parent, tokens)
        self.on_store()

    def _store_byte(self, at: int, value: int) -> None:
        super()._store_byte(at, value)
        self.on_store()


def new_table(
    num_pages: int, page_size: int, arena: int = 4096, cls: type[IndexTable] = IndexTable
) -> tuple[bytearray, IndexTable]:
    buf = bytearray(IndexTable.size_for(num_pages, page_size, arena))
    table = cls.create(
        buf, num_pages=num_pages, page_size=page_size, settings_digest=DIGEST, arena_bytes=arena
    )
    return buf, table


def reopen(image: bytes | bytearray, num_pages: int, page_size: int) -> IndexTable:
    """The table a restart would find in (a copy of) ``image``."""
    return IndexTable.open(
        bytearray(image), num_pages=num_pages, page_size=page_size, settings_digest=DIGEST
    )


def without_medium(entry: PageStored) -> PageStored:
    return PageStored(entry.key, entry.parent_key, entry.page, entry.tokens, entry.space)


# -- (a) the header -------------------------------------------------------------------


def test_header_round_trip_and_clean_flag() -> None:
    buf, table = new_table(5, 3, arena=100)
    assert Header.unpack(memoryview(buf)) == Header(5, 3, 100, DIGEST)
    assert len(buf) == HEADER_BYTES + 5 * slot_bytes(3) + 100 and slot_bytes(3) == 96
    assert not table.was_clean
    table.mark_clean()
    table.close()
    again = IndexTable.open(buf, num_pages=5, page_size=3, settings_digest=DIGEST)
    assert again.was_clean and again.opened.entries == [] and not again.opened.dropped
    assert not IndexTable.open(buf, num_pages=5, page_size=3, settings_digest=DIGEST).was_clean


def other(value: object) -> object:
    """A value of the same size (so that it packs into the same field) unlike ``value``."""
    if isinstance(value, bytes):
        flipped = bytes([value[0] ^ 1]) + value[1:]
        return {b"little": b"big", b"big": b"little"}.get(value, flipped)
    assert isinstance(value, int)
    return value + 8


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Header)])
def test_each_header_field_refused(name: str) -> None:
    buf, table = new_table(4, 2, arena=64)
    table.close()
    found = Header.unpack(memoryview(buf))
    changed = dataclasses.replace(found, **{name: other(getattr(found, name))})
    changed.pack_into(memoryview(buf))
    if name == "arena_bytes":  # the header's own: the buffer is too short for it then
        with pytest.raises(RestoreRefused, match="truncated"):
            reopen(buf, 4, 2)
        return
    with pytest.raises(RestoreRefused, match=name):
        reopen(buf, 4, 2)


@given(
    made=st.tuples(st.integers(1, 9), st.integers(1, 5), st.binary(max_size=64)),
    asked=st.tuples(st.integers(1, 9), st.integers(1, 5), st.binary(max_size=64)),
)
def test_open_refuses_other_settings_naming_each(
    made: tuple[int, int, bytes], asked: tuple[int, int, bytes]
) -> None:
    buf = bytearray(IndexTable.size_for(made[0], made[1], 64))
    IndexTable.create(
        buf, num_pages=made[0], page_size=made[1], settings_digest=made[2], arena_bytes=64
    ).close()
    names = ("num_pages", "page_size", "settings_digest")
    differ = [name for name, a, b in zip(names, made, asked, strict=True) if a != b]
    opening = dict(zip(names, asked, strict=True))
    if not differ:
        assert IndexTable.open(buf, **opening).opened.entries == []  # type: ignore[arg-type]
        return
    with pytest.raises(RestoreRefused) as refused:
        IndexTable.open(buf, **opening)  # type: ignore[arg-type]
    for name in differ:
        assert name in str(refused.value)


def test_create_refuses_a_short_or_read_only_buffer() -> None:
    size = IndexTable.size_for(4, 2, 64)
    with pytest.raises(BadRequest):
        IndexTable.create(bytearray(size - 1), num_pages=4, page_size=2, settings_digest=b"")
    with pytest.raises(BadRequest):
        IndexTable.create(bytes(size), num_pages=4, page_size=2, settings_digest=b"")  # type: ignore[arg-type]
    with pytest.raises(BadRequest):
        IndexTable.create(bytearray(size), num_pages=4, page_size=2, settings_digest=bytes(65))


# -- (b) crash images of a Manager's operations ------------------------------------------


@dataclasses.dataclass
class Seq:
    space: KeySpace
    tokens: list[int]
    written: int = 0  # leading full pages holding their marker (hits, or written here)
    one_page: bool = False  # allocate_pages's: each page its own chain
    hits: list[bool] = dataclasses.field(default_factory=list)


class CrashMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.integers(1, 3),
        num_pages=st.integers(2, 8),
        arena=st.sampled_from([0, 40, 4096, 4096]),  # 40: a record or two fit
        eviction=st.sampled_from(["lru", "adaptive-slru"]),
    )
    def start(self, page_size: int, num_pages: int, arena: int, eviction: str) -> None:
        self.ps, self.n = page_size, num_pages
        self.layout = KVLayout(1, 1, 1, page_size, "float16", num_pages)
        self.buf, table = new_table(num_pages, page_size, arena, RecordingTable)
        assert isinstance(table, RecordingTable)
        self.table = table
        self.index = MirroredIndex(table)
        self.m = Manager(self.layout, eviction=eviction, index=self.index)
        self.pool = bytearray(num_pages * MARK)
        self.epoch = [0] * num_pages  # times each page was handed to a writer
        self.indexed_epoch: dict[tuple[bytes, int], int] = {}  # (key, page) -> epoch then
        self.seqs: dict[int, Seq] = {}
        self.history: list[tuple[KeySpace, list[int], bool]] = []  # committed or adopted
        self.images: list[tuple[bytes, bytes]] = []
        self.nonces = 0
        table.on_store = self.crash_point

    # -- the engine's and the tier's writes --------------------------------------------

    def hand_out(self, pages: list[int]) -> None:
        """Pages a writer got: it may write anything now (a nonce, never a key)."""
        for page in pages:
            self.epoch[page] += 1
            self.nonces += 1
            self.pool[page * MARK : (page + 1) * MARK] = b"nonce" + self.nonces.to_bytes(27)

    def write_marker(self, page: int, key: bytes) -> None:
        self.pool[page * MARK : (page + 1) * MARK] = key

    def after_op(self) -> None:
        for event in self.m.take_events():
            if isinstance(event, PageStored):
                self.indexed_epoch[event.key, event.page] = self.epoch[event.page]
            else:  # a pair indexed again later is recorded anew
                del self.indexed_epoch[event.key, event.page]
        self.crash_point()

    # -- crash images -------------------------------------------------------------------

    def crash_point(self) -> None:
        image, pool = bytes(self.buf), bytes(self.pool)
        found = reopen(image, self.n, self.ps).opened
        assert set(found.dropped) <= {"pending"}, found.dropped
        for entry in found.entries:
            page, key = entry.page, entry.key
            assert pool[page * MARK : (page + 1) * MARK] == key, f"page {page}: not its bytes"
            live = self.index.entries.get(key)
            assert live is not None and without_medium(live) == entry, f"{entry} not indexed"
            # Not recorded yet: indexed during the operation running now.
            since = self.indexed_epoch.get((key, page), self.epoch[page])
            assert self.epoch[page] == since, f"page {page} was handed out after its commit"
        self.images.append((image, pool))

    # -- operations ----------------------------------------------------------------------

    @rule(
        seq_id=st.integers(0, 4),
        tokens=st.lists(st.integers(0, 2), max_size=12),
        s=st.integers(0, 2),
    )
    def allocate(self, seq_id: int, tokens: list[int], s: int) -> None:
        if seq_id in self.seqs:
            return
        try:
            got = self.m.allocate(seq_id, tokens, SPACES[s])
        except OutOfPages:
            return
        hits = got.num_cached_tokens // self.ps
        self.hand_out(got.pages[hits:])
        self.seqs[seq_id] = Seq(SPACES[s], list(tokens), written=hits)
        self.after_op()

    def live(self, data: st.DataObject, one_page: bool) -> tuple[int, Seq]:
        """A live sequence of the kind asked, drawn."""
        ids = sorted(i for i, seq in self.seqs.items() if seq.one_page == one_page)
        seq_id = data.draw(st.sampled_from(ids), label="seq_id")
        return seq_id, self.seqs[seq_id]

    def has_live(self, one_page: bool) -> bool:
        return any(seq.one_page == one_page for seq in self.seqs.values())

    @precondition(lambda self: self.has_live(False))
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), max_size=6))
    def extend(self, data: st.DataObject, tokens: list[int]) -> None:
        seq_id, seq = self.live(data, False)
        try:
            grown = self.m.extend(seq_id, len(tokens))
        except OutOfPages:
            return
        seq.tokens += tokens
        self.hand_out(grown.new_pages + [dst for _, dst in grown.copies])
        self.after_op()

    @precondition(lambda self: self.has_live(False))
    @rule(data=st.data(), cut=st.integers(0, 18))
    def commit(self, data: st.DataObject, cut: int) -> None:
        seq_id, seq = self.live(data, False)
        tokens = seq.tokens[:cut]
        keys = list(chain_keys(root_key(seq.space), encode_tokens(tokens), self.ps))
        table = self.m.block_table(seq_id)
        for i in range(seq.written, len(keys)):  # the engine computed these pages
            self.write_marker(table[i], keys[i])
        seq.written = max(seq.written, len(keys))
        self.m.commit(seq_id, tokens)
        self.history.append((seq.space, tokens, False))
        self.after_op()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)), label="seq_id")
        del self.seqs[seq_id]
        self.m.free(seq_id)
        self.after_op()

    @rule(
        seq_id=st.integers(5, 7),
        tokens=st.lists(st.integers(0, 2), max_size=9),
        s=st.integers(0, 2),
    )
    def allocate_pages(self, seq_id: int, tokens: list[int], s: int) -> None:
        tokens = tokens[: len(tokens) // self.ps * self.ps]
        if seq_id in self.seqs:
            return
        try:
            got = self.m.allocate_pages(seq_id, tokens, SPACES[s])
        except OutOfPages:
            return
        self.hand_out([page for page, hit in zip(got.pages, got.hits, strict=True) if not hit])
        self.seqs[seq_id] = Seq(SPACES[s], tokens, one_page=True, hits=got.hits)
        self.after_op()

    @precondition(lambda self: self.has_live(True))
    @rule(data=st.data())
    def commit_pages(self, data: st.DataObject) -> None:
        seq_id, seq = self.live(data, True)
        root, pages = root_key(seq.space), self.m.block_table(seq_id)
        token_bytes, stride = encode_tokens(seq.tokens), 4 * self.ps
        for i, hit in enumerate(seq.hits):
            if not hit:
                self.write_marker(
                    pages[i], page_key(root, token_bytes[i * stride : (i + 1) * stride])
                )
        self.m.commit_pages(seq_id, seq.tokens)
        self.history.append((seq.space, seq.tokens, True))
        self.after_op()

    def place(self, pages: list[int], keys: list[PrefixKey]) -> None:
        """The tier's copy into adopted pages: begun (a nonce), done (markers), placed."""
        self.hand_out(pages)
        self.after_op()  # pending: a crash now restores none of them
        for page, key in zip(pages, keys, strict=False):
            self.write_marker(page, key)
        self.crash_point()
        self.table.placed([PageId(page) for page in pages])

    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), max_size=9), s=st.integers(0, 2))
    def adopt_pages(self, data: st.DataObject, tokens: list[int], s: int) -> None:
        tokens = tokens[: len(tokens) // self.ps * self.ps]
        space, stride = SPACES[s], 4 * self.ps
        token_bytes = encode_tokens(tokens)
        chunks = [token_bytes[at : at + stride] for at in range(0, len(token_bytes), stride)]
        indexed = self.m.lookup_pages(tokens, space)
        firsts = {chunk: i for i, chunk in reversed(list(enumerate(chunks))) if not indexed[i]}
        if not firsts:
            return
        chains = data.draw(st.lists(st.sampled_from(sorted(firsts.values())), unique=True))
        pages = self.m.adopt_pages(tokens, chains, space, medium="host")
        root = root_key(space)
        self.place(pages, [page_key(root, chunks[i]) for i in chains])
        self.history.append((space, tokens, True))
        self.after_op()

    @rule(
        tokens=st.lists(st.integers(0, 2), max_size=12), num=st.integers(1, 3), s=st.integers(0, 2)
    )
    def adopt(self, tokens: list[int], num: int, s: int) -> None:
        space = SPACES[s]
        first = self.m.lookup(tokens, space).num_cached_tokens // self.ps
        try:
            pages = self.m.adopt(tokens, num, space, medium="disk")
        except (BadRequest, OutOfPages):
            return
        keys = list(chain_keys(root_key(space), encode_tokens(tokens), self.ps))
        self.place(pages, keys[first : first + len(pages)])
        self.history.append((space, tokens, False))
        self.after_op()

    # -- restarts --------------------------------------------------------------------

    @precondition(lambda self: self.images)
    @rule(data=st.data())
    def restart_from_an_image(self, data: st.DataObject) -> None:
        back = data.draw(st.integers(0, len(self.images) - 1), label="images back")
        image, _ = self.images[-1 - back]
        table = reopen(image, self.n, self.ps)
        entries = table.opened.entries
        fresh = Manager(self.layout, index=MirroredIndex(table))
        fresh.restore(entries)
        fresh.check_integrity()
        assert {e.key: e for e in fresh.prefix_snapshot()} == {e.key: e for e in entries}
        restored, stride = {entry.key for entry in entries}, 4 * self.ps
        for space, tokens, one_page in self.history:  # lookups hit exactly what was restored
            root, token_bytes = root_key(space), encode_tokens(tokens)
            if one_page:
                chunks = [
                    token_bytes[at : at + stride] for at in range(0, len(token_bytes), stride)
                ]
                expected = [page_key(root, chunk) in restored for chunk in chunks]
                assert fresh.lookup_pages(tokens, space) == expected
                continue
            run = 0
            for key in chain_keys(root, token_bytes, self.ps):
                if key not in restored:
                    break
                run += 1
            assert (
                fresh.lookup(tokens, space, compute_last=False).num_cached_tokens == run * self.ps
            )
        # Every restored page is evictable, and evicting it frees its slot.
        fresh.allocate(0, list(range(10, 10 + self.n * self.ps)))
        fresh.check_integrity()
        assert all(state == FREE for state, _ in table.slots())

    @invariant()
    def table_mirrors_index(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()  # MirroredIndex's: slot STORED iff indexed (or unstored)
        found = reopen(self.buf, self.n, self.ps).opened
        live = {
            (key, page)
            for page, key in self.index.key_by_page.items()
            if page not in self.index.unstored_pages
        }
        assert {(entry.key, entry.page) for entry in found.entries} == live
        assert not found.dropped  # adopted pages are placed by the end of each rule


CrashMachine.TestCase.settings = settings(
    settings.default, max_examples=max(settings.default.max_examples, 200), stateful_step_count=40
)
TestCrashImages = CrashMachine.TestCase


def test_restore_keeps_heads_after_tails() -> None:
    """A chain stored head first restores with its head the most recent."""
    _, table = new_table(4, 1)
    m = Manager(KVLayout(1, 1, 1, 1, "float16", 4), eviction="lru", index=MirroredIndex(table))
    m.allocate(1, [1, 2, 3])
    m.commit(1, [1, 2, 3])
    m.free(1)
    entries = table.scan().entries
    assert [e.page for e in entries] == [0, 1, 2]  # seq order: head first
    fresh = Manager(KVLayout(1, 1, 1, 1, "float16", 4), eviction="lru")
    fresh.restore(entries)
    fresh.allocate(2, [9, 9])  # one free page, then one eviction: the tail
    assert fresh.lookup([1, 2, 3, 0]).num_cached_tokens == 2
    with pytest.raises(BadRequest):
        fresh.restore(entries)  # not a fresh Manager
    with pytest.raises(BadRequest):
        Manager(KVLayout(1, 1, 1, 1, "float16", 4)).restore([entries[0], entries[0]])


# -- (c) torn and garbage bytes ----------------------------------------------------------


def committed_table() -> tuple[bytearray, list[PageStored]]:
    """A table of 6 pages of 2 tokens, 5 of them committed in two key spaces."""
    buf, table = new_table(6, 2, arena=256)
    m = Manager(KVLayout(1, 1, 1, 2, "float16", 6), index=MirroredIndex(table))
    m.allocate(1, [1, 2, 3, 4, 5, 6], SPACES[1])
    m.commit(1, [1, 2, 3, 4, 5, 6])
    m.allocate(2, [1, 2, 7, 8], SPACES[2])
    m.commit(2, [1, 2, 7, 8])
    m.free(1)
    entries = table.scan().entries
    assert len(entries) == 5
    table.close()
    return buf, entries


GOOD_BUF, GOOD = committed_table()


@given(
    page=st.integers(0, 5),
    at=st.integers(0, slot_bytes(2) - 1),
    garbage=st.binary(min_size=1, max_size=slot_bytes(2)),
)
@example(page=3, at=4, garbage=b"\x00")  # space_ref 0: another valid record
def test_garbage_in_a_slot_is_dropped_never_restored_wrong(
    page: int, at: int, garbage: bytes
) -> None:
    buf = bytearray(GOOD_BUF)
    start = HEADER_BYTES + page * slot_bytes(2) + at
    end = min(start + len(garbage), HEADER_BYTES + (page + 1) * slot_bytes(2))
    buf[start:end] = garbage[: end - start]
    table = IndexTable.open(buf, num_pages=6, page_size=2, settings_digest=DIGEST)
    found = table.opened
    assert set(found.entries) <= set(GOOD)
    assert {e.page for e in GOOD} - {e.page for e in found.entries} <= {page}
    m = Manager(KVLayout(1, 1, 1, 2, "float16", 6), index=MirroredIndex(table))
    m.restore(found.entries)
    m.allocate(1, [5, 6, 7, 8])  # stores and evicts after garbage (a huge seq, say)
    m.commit(1, [5, 6, 7, 8])
    m.check_integrity()
    table.close()
    again = reopen(buf, 6, 2).opened
    assert not again.dropped  # the dropped slots were set FREE
    assert {(e.key, e.page) for e in again.entries} == {
        (e.key, e.page) for e in m.prefix_snapshot()
    }


@given(src=st.integers(0, 5), dst=st.integers(0, 5))
def test_a_slot_copied_over_another_restores_neither(src: int, dst: int) -> None:
    buf = bytearray(GOOD_BUF)
    stride = slot_bytes(2)
    slot = GOOD_BUF[HEADER_BYTES + src * stride : HEADER_BYTES + (src + 1) * stride]
    buf[HEADER_BYTES + dst * stride : HEADER_BYTES + (dst + 1) * stride] = slot
    found = reopen(buf, 6, 2).opened
    assert set(found.entries) <= set(GOOD)
    copied = slot[0] == STORED and src != dst
    assert not copied or not {src, dst} & {e.page for e in found.entries}


def orphans_table() -> tuple[bytearray, list[PageStored], list[list[int]]]:
    """A table of 12 pages of 1 token, 10 of them STORED: a chain in each of three key
    spaces, two from their roots, one an orphan chain of three pages (the pages of
    its head went first: evicted while sequence 2 held the pages below them); the
    entries, and the pages of each chain, head first. One record per space."""
    buf, table = new_table(12, 1, arena=256)
    m = Manager(KVLayout(1, 1, 1, 1, "float16", 12), eviction="lru", index=MirroredIndex(table))
    m.allocate(1, [1, 2], SPACES[1])
    m.allocate(2, [1, 2, 3, 4, 5], SPACES[1])  # computes [1, 2] too, before 1 commits it
    m.commit(1, [1, 2])  # pages 0, 1
    m.commit(2, [1, 2, 3, 4, 5])  # 2's pages for [1, 2] stay private; 4, 5, 6 indexed
    m.free(1)
    m.allocate(3, [7, 8, 9, 7, 8, 9, 7], SPACES[2])  # 5 free pages, then evicts 1, 0
    m.commit(3, [7, 8, 9, 7, 8])  # its last 2 pages go free
    m.free(2)  # its private pages 2, 3 go free
    m.free(3)
    m.allocate(4, [9, 9], SPACES[0])
    m.commit(4, [9, 9])
    m.check_integrity()
    entries = table.scan().entries
    table.close()
    by_page = {entry.page: entry for entry in entries}
    assert sorted(by_page) == list(range(2, 12))  # 0, 1 are free
    chains = [[4, 5, 6], [7, 8, 9, 10, 11], [3, 2]]  # the pages of each, head first
    keys = {entry.key for entry in entries}
    orphan_parent = list(chain_keys(root_key(SPACES[1]), encode_tokens([1, 2]), 1))[-1]
    assert by_page[4].parent_key == orphan_parent and orphan_parent not in keys
    for pages, space in zip(chains, SPACES[1:] + SPACES[:1], strict=True):
        assert pages[0] == 4 or by_page[pages[0]].parent_key == root_key(space)
        assert [by_page[page].space for page in pages] == [space] * len(pages)
        assert [by_page[a].key for a in pages[:-1]] == [by_page[b].parent_key for b in pages[1:]]
    return buf, entries, chains


ORPHANS_BUF, ORPHANS, CHAINS = orphans_table()


def record_refs(buf: bytes | bytearray, num_pages: int, page_size: int) -> list[int]:
    """The offset of each key-space record in ``buf``'s arena, before the tail."""
    arena = HEADER_BYTES + num_pages * slot_bytes(page_size)
    (tail,) = struct.unpack_from("<Q", buf, TAIL_AT)
    refs, at = [], 0
    while at < tail:
        refs.append(at)
        at += 6 + struct.unpack_from("<IH", buf, arena + at)[1]
    return refs


def test_an_orphan_chain_is_restored_and_hits_once_its_head_is_back() -> None:
    table = reopen(ORPHANS_BUF, 12, 1)
    assert table.opened.entries == ORPHANS and not table.opened.dropped
    m = Manager(KVLayout(1, 1, 1, 1, "float16", 12), index=MirroredIndex(table))
    m.restore(table.opened.entries)
    m.check_integrity()
    assert m.lookup([1, 2, 3, 4, 5, 6], SPACES[1]).num_cached_tokens == 0  # no head
    m.allocate(1, [1, 2], SPACES[1])  # the free pages 0, 1
    m.commit(1, [1, 2])
    m.free(1)
    assert m.lookup([1, 2, 3, 4, 5, 6], SPACES[1]).num_cached_tokens == 5
    m.check_integrity()


@given(page=st.integers(0, 11), to=st.integers(0, 2), seqs=st.permutations(range(1, 11)))
@example(page=4, to=1, seqs=list(range(1, 11)))  # an orphan: the chain below it says SPACES[1]
@example(page=6, to=1, seqs=list(range(1, 11)))  # the last of an orphan chain
@example(page=7, to=0, seqs=list(range(10, 0, -1)))  # a head; every child before its parent
def test_a_space_ref_rewritten_never_restores_a_page_under_another_space(
    page: int, to: int, seqs: list[int]
) -> None:
    """Any slot's space_ref rewritten to another valid record: the page is dropped, or
    restored under its own space; in a chain from a root only it is dropped, in an
    orphan's chain all of it (which of its slots is wrong, nothing tells). The slots'
    seqs in any order (a child's before its parent's, say) change nothing but the
    restore order."""
    buf = bytearray(ORPHANS_BUF)
    for slot, seq in zip(range(2, 12), seqs, strict=True):  # pages 2-11 hold the entries
        struct.pack_into("<Q", buf, HEADER_BYTES + slot * slot_bytes(1) + 8, seq)
    refs = record_refs(buf, 12, 1)
    assert len(refs) == 3
    at = HEADER_BYTES + page * slot_bytes(1) + 4
    (was,) = struct.unpack_from("<I", buf, at)
    struct.pack_into("<I", buf, at, refs[to])
    found = reopen(buf, 12, 1).opened
    assert [seqs[entry.page - 2] for entry in found.entries] == sorted(
        seqs[entry.page - 2] for entry in found.entries
    )
    assert set(found.entries) <= set(ORPHANS)
    chain = next((pages for pages in CHAINS if page in pages), [])
    if refs[to] == was or not chain:  # the same record, or a FREE slot
        assert set(found.entries) == set(ORPHANS) and not found.dropped
        return
    lost = {entry.page for entry in ORPHANS} - {entry.page for entry in found.entries}
    if chain[0] == 4:  # the orphan chain
        assert lost == set(chain) and found.dropped == {"mixed_space": len(chain)}
    else:  # its children still come back: their space is proven from the root
        assert lost == {page} and found.dropped == {"wrong_space": 1}


def test_a_record_of_a_space_no_root_takes_drops_its_pages() -> None:
    buf, table = new_table(2, 1, arena=512)
    huge = KeySpace("x" * 300)  # root_key refuses parts over 256 bytes
    for page, space in enumerate((huge, SPACES[0])):
        root, tokens = root_key(SPACES[0]), encode_tokens([page])
        table.store(PageStored(page_key(root, tokens), root, PageId(page), tokens, space))
    found = reopen(buf, 2, 1).opened
    assert [e.page for e in found.entries] == [1] and found.dropped == {"bad_space": 1}


@given(at=st.integers(0, 255), garbage=st.binary(min_size=1, max_size=64))
def test_garbage_in_the_arena_drops_its_pages(at: int, garbage: bytes) -> None:
    buf = bytearray(GOOD_BUF)
    arena = HEADER_BYTES + 6 * slot_bytes(2)
    end = min(arena + at + len(garbage), arena + 256)
    buf[arena + at : end] = garbage[: end - arena - at]
    assert set(reopen(buf, 6, 2).opened.entries) <= set(GOOD)


@given(tail=st.integers(0, 2**64 - 1))
def test_any_arena_tail_drops_or_keeps_pages_whole(tail: int) -> None:
    buf = bytearray(GOOD_BUF)
    struct.pack_into("<Q", buf, 248, tail)
    assert set(reopen(buf, 6, 2).opened.entries) <= set(GOOD)


@given(size=st.integers(0, len(GOOD_BUF) - 1))
def test_a_truncated_table_is_refused(size: int) -> None:
    with pytest.raises(RestoreRefused, match=r"truncated|magic"):
        reopen(GOOD_BUF[:size], 6, 2)


@given(garbage=st.binary(min_size=6 * slot_bytes(2), max_size=6 * slot_bytes(2)))
def test_garbage_slots_restore_nothing(garbage: bytes) -> None:
    buf = bytearray(GOOD_BUF)
    buf[HEADER_BYTES : HEADER_BYTES + len(garbage)] = garbage
    assert reopen(buf, 6, 2).opened.entries == []


@given(at=st.integers(0, 255), garbage=st.binary(min_size=1, max_size=256))
def test_a_garbage_header_is_refused_unless_its_fields_are_intact(at: int, garbage: bytes) -> None:
    buf = bytearray(GOOD_BUF)
    buf[at : at + len(garbage)] = garbage
    del buf[len(GOOD_BUF) :]
    if Header.unpack(memoryview(buf)) == Header.unpack(memoryview(GOOD_BUF)):
        assert set(reopen(buf, 6, 2).opened.entries) <= set(GOOD)  # tail or clean flag
        return
    with pytest.raises(RestoreRefused):
        reopen(buf, 6, 2)


def test_byte_order_is_the_hosts() -> None:
    assert Header.unpack(memoryview(GOOD_BUF)).byte_order == sys.byteorder.encode()
