"""Manager: the one state machine of kvcore (docs/architecture.md, "The state machine").

It owns no memory: it decides which page of the pool holds which tokens of
which sequence, who shares a page, and which pages hold which committed
prefix. Engines (in-process, or over the wire through the daemon, kvcore.daemon)
write and read the pages themselves.

Token ranges of one sequence, page_size = 4, 10 tokens::

    tokens     0 1 2 3 | 4 5 6 7 | 8 9 . .
    pages      [  p7   ] [  p2   ] [  p5 ]     block table = [7, 2, 5]
    committed  key0      key1                  full pages published by commit()
    a prefix hit covers at most (n - 1) // page_size pages: never the last token
    (n // page_size for a caller that computes nothing: allocate(compute_last=False))

The Manager does no I/O. Changes of the prefix index queue
:class:`~kvcore.prefix.PageStored` / :class:`~kvcore.prefix.PageRemoved` events
that :meth:`Manager.take_events` hands over (the daemon publishes them after
each request).

Every public method either succeeds or raises a :class:`~kvcore.errors.KVCoreError`
having changed nothing (stats counters and the event queue included). Invariants,
checked by :meth:`check_integrity` after every step of the conformance state machine:

* free + evictable + held + withheld == total pages (withheld: :meth:`Manager.withhold_free`);
* a page's refcount equals the number of block-table entries naming it;
* no page is both free and referenced; every evictable page is indexed;
* every block table has exactly ceil(num_tokens / page_size) pages;
* the key-space memo holds the root hashing would compute now.

Matching a prompt hashes nothing: the index finds each page by its parent key and
its tokens (:attr:`~kvcore.prefix.PrefixIndex.by_content`), which name one key.
Only commit and adopt (the pages they index) and plan (the pages after a hit) hash.

Key spaces: a sequence's pages are keyed under the root of its
:class:`~kvcore.prefix.KeySpace` (namespace, model, LoRA adapter, cache salt;
spec/hashing.md), fixed when it is allocated (a fork inherits it), so commit,
extend and fork take no key-space argument. Pages of different key spaces never
share a key, hence never a page; equal key spaces share as one namespace did.

The file is one class of ~750 lines on purpose: every method keeps these
invariants over the same private state, so they read together. The result types
and the :class:`~kvcore.results.PageManager` protocol live in kvcore.results
(re-exported here).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcore.allocator import PageAllocator, PageId
from kvcore.errors import BadRequest, OutOfPages, SequenceExists, UnknownSequence
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.eviction import make_policy
from kvcore.hits import HitBook
from kvcore.layout import KVLayout
from kvcore.prefix import (
    DEFAULT_NAMESPACE,
    KeySpace,
    PageEvent,
    PageStored,
    PrefixIndex,
    PrefixKey,
    chain_keys,
    encode_tokens,
    page_key,
    page_keys,
    root_key,
)
from kvcore.results import (
    Allocation,
    Extension,
    PageManager,
    PagesAllocation,
    PrefixHit,
    PrefixPlan,
    Stats,
)

MAX_SEQ_ID = (1 << 64) - 1

__all__ = [
    "DEFAULT_NAMESPACE",
    "MAX_SEQ_ID",
    "Allocation",
    "Extension",
    "Manager",
    "PageManager",
    "PagesAllocation",
    "PrefixHit",
    "PrefixPlan",
    "Stats",
]


@dataclass(slots=True)
class _Sequence:
    space: KeySpace  # namespace resolved
    root: PrefixKey  # root_key(space)
    pages: list[PageId]  # block table; only grows, except copy-on-write of the last page
    num_tokens: int
    keys: list[PrefixKey] = field(default_factory=list)  # keys of pages[:len(keys)]


class Manager:
    """The page-pool state machine for one :class:`KVLayout`. Not thread-safe.

    Hot paths: one ``extend`` per generated token (the common case, a known
    sequence whose last page has room and is its own, returns before any page
    is touched) and one ``commit`` per filled page (hashes only the new page).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        eviction: str = DEFAULT_EVICTION,
        record_evictions: bool = False,
        index: PrefixIndex | None = None,
    ) -> None:
        """A Manager of an empty pool of ``layout``, evicting by the policy named
        ``eviction`` (kvcore.eviction; BadRequest for an unknown name). ``index``: an
        empty prefix index to use (a subclass that mirrors its changes, as the daemon's
        kvcore.daemon.index_table.MirroredIndex); None: a plain PrefixIndex."""
        self.layout = layout
        self.eviction = eviction  # the policy's name: it labels the eviction metrics
        self._page_size = layout.page_size
        self._pages = PageAllocator(layout.num_pages, make_policy(eviction, layout.num_pages))
        self._refcounts = self._pages.refcounts  # read only: the allocator writes it
        assert index is None or not len(index), "a Manager starts with an empty index"
        self._index = PrefixIndex() if index is None else index
        self._entries = self._index.entries  # read only: the index writes them
        self._key_by_page = self._index.key_by_page  # read only, likewise
        self._by_content = self._index.by_content  # read only, likewise
        self._seqs: dict[int, _Sequence] = {}
        # Queries and hits per namespace, and the busiest prefixes; a holder of lower
        # tiers adds what they brought up (kvcore.hits). Written by allocations.
        self.hits = HitBook()
        self._evictions = 0
        # (key, page) of each eviction since the last take_evicted(), if recording: what
        # a caller that keeps evicted bytes (kvcore.daemon.tiering) must copy out of the
        # page before anyone writes into it again.
        self._evicted: list[tuple[PrefixKey, PageId]] | None = [] if record_evictions else None
        # Memo of a pure function, so it cannot change a result: the last key space
        # passed (kept only if every part is a str, so the same object means the same
        # values), resolved, and its root key (see _resolve).
        default = KeySpace(DEFAULT_NAMESPACE)
        self._space_memo: tuple[KeySpace, KeySpace, PrefixKey] = (
            default,
            default,
            root_key(default),
        )

    # -- operations -------------------------------------------------------------

    def allocate(
        self,
        seq_id: int,
        tokens: Sequence[int],
        space: KeySpace = KeySpace(),
        *,
        compute_last: bool = True,
    ) -> Allocation:
        """Start sequence ``seq_id`` holding ``tokens``: reuse the longest committed
        prefix of whole pages in its key space ``space`` (a None namespace is
        ``"default"``) and add fresh pages for the rest. With
        ``compute_last`` (an engine, which needs the last token's logits) a hit never
        covers the last token; without (a store that only moves whole pages) it may
        cover every full page. The sequence keeps the key space: its commits publish
        under it, its forks inherit it. OutOfPages if the pages do not fit;
        BadRequest if a key-space field is not a str of at most 256 UTF-8 bytes."""
        self.check_new(seq_id)
        space, root = self._resolve(space)  # BadRequest for a bad key space
        token_bytes = encode_tokens(tokens)
        num_tokens = len(token_bytes) // 4
        keys, hit_pages = self._match(
            root, token_bytes, _hit_limit(num_tokens, self._page_size, compute_last)
        )
        num_new = self.layout.pages_for(num_tokens) - len(hit_pages)
        self._check_room(num_new, self._room(hit_pages))
        self._pages.retain(hit_pages)
        self._pages.hit(hit_pages)
        pages = hit_pages + self._pages.take(num_new, self._evict)
        self._seqs[seq_id] = _Sequence(space, root, pages, num_tokens, keys)
        num_cached = len(hit_pages) * self._page_size
        self.hits.record(space.namespace, num_tokens, num_cached, keys[0] if keys else None)
        return Allocation(list(pages), num_cached)

    def extend(self, seq_id: int, num_tokens: int) -> Extension:
        """Grow ``seq_id`` by ``num_tokens`` tokens, adding pages as needed.

        If the sequence's last page is partly filled and shared (refcount > 1),
        the sequence gets a private copy first (copy-on-write)."""
        # The per-token path: exact ints skip the full checks of _get and _check_count.
        seq = self._seqs.get(seq_id) if seq_id.__class__ is int else None
        if seq is None:
            seq = self._get(seq_id)
        if num_tokens.__class__ is not int or num_tokens < 0:
            _check_count("num_tokens", num_tokens)
        pages = seq.pages
        total = seq.num_tokens + num_tokens
        if total <= len(pages) * self._page_size and (
            num_tokens == 0 or self._refcounts[pages[-1]] == 1
        ):
            seq.num_tokens = total  # the tokens fit the last page, which is this sequence's own
            return Extension([], [])
        return self._grow(seq, num_tokens, self.layout.pages_for(total) - len(pages))

    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int:
        """Publish every full page of ``seq_id`` not yet published; returns how many of
        the sequence's leading full pages are committed (including pages whose key
        another sequence published first, which stay private).

        ``tokens`` are the sequence's tokens ``[start, start + len(tokens))``::

            sequence   | committed pages | written, not committed  | . .
            tokens                 [start ..................... start + len)
                       start: a page boundary at or before the first page not committed

        ``start`` (tokens) is a multiple of page_size, at most committed pages x
        page_size, and ``start + len(tokens)`` at most the sequence's num_tokens;
        BadRequest otherwise. Full pages sent again (``start`` below the committed
        pages, as a client that always sends from token 0 does) are hashed and must
        equal the keys the sequence holds (its own commits and its prefix hits), so
        a client that sends only what is new (``start`` = committed pages x
        page_size) pays nothing for them. A page whose key is already indexed
        (another sequence committed the same prefix first) stays private.
        BadRequest if the tokens contradict a page's key.
        """
        seq = self._get(seq_id)
        page_size = self._page_size
        keys = seq.keys
        first = len(keys)  # pages to publish: [first, end)
        if (
            not isinstance(start, int)
            or start.__class__ is bool
            or not 0 <= start <= first * page_size
            or start % page_size
        ):
            raise BadRequest(
                f"commit start must be a multiple of {page_size} tokens in "
                f"[0, {first * page_size}] (the committed pages), got {start!r}"
            )
        stop = start + len(tokens)
        if stop > seq.num_tokens:
            raise BadRequest(
                f"commit of tokens up to {stop}; sequence {seq_id} holds {seq.num_tokens}"
            )
        end = stop // page_size
        if start < first * page_size:
            self._check_resent(seq, seq_id, tokens, start, min(end, first))
        if end <= first:
            return first
        # Only the new pages' tokens are encoded, so a commit per page stays O(page).
        offset = first * page_size - start
        self._publish(seq, seq_id, tokens[offset : offset + (end - first) * page_size])
        return end

    def _publish(self, seq: _Sequence, seq_id: int, tokens: Sequence[int]) -> None:
        """Index the full pages of ``tokens``, the tokens of ``seq``'s first pages not
        yet published (from page ``len(seq.keys)``, a whole number of pages), and append
        their keys to ``seq.keys``. BadRequest, changing nothing, if a page is already
        indexed under another key."""
        keys = seq.keys
        first = len(keys)
        parent = keys[-1] if keys else seq.root
        token_bytes = encode_tokens(tokens)
        new = page_keys(parent, token_bytes, self._page_size)
        pages = seq.pages[first : first + len(new)]
        published = self._key_by_page
        for i in range(len(new)):
            known = published.get(pages[i])
            if known is not None and known != new[i]:
                raise BadRequest(
                    f"page {pages[i]} (page {first + i} of sequence {seq_id}) was committed "
                    "with other tokens"
                )
        self._index.insert_chain(parent, new, pages, token_bytes, seq.space)
        keys += new

    def _check_resent(
        self, seq: _Sequence, seq_id: int, tokens: Sequence[int], start: int, end: int
    ) -> None:
        """BadRequest unless the full pages ``[start // page_size, end)`` of ``tokens``
        (which begin at token ``start``) hash to the keys ``seq`` already holds."""
        page_size = self._page_size
        first = start // page_size
        if end <= first:
            return
        parent = seq.keys[first - 1] if first else seq.root
        sent = page_keys(parent, encode_tokens(tokens[: (end - first) * page_size]), page_size)
        for i, key in enumerate(sent):
            if key != seq.keys[first + i]:
                raise BadRequest(
                    f"page {first + i} of sequence {seq_id} is committed (or a prefix hit) "
                    "with other tokens than this commit sends"
                )

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        """New sequence ``child_id`` sharing every page of ``parent_id`` (refcount +1
        each) and its key space. Never allocates, so never runs out of pages. Returns
        the child's block table."""
        parent = self._get(parent_id)
        self.check_new(child_id)
        self._pages.retain(parent.pages)
        self._seqs[child_id] = _Sequence(
            parent.space, parent.root, list(parent.pages), parent.num_tokens, list(parent.keys)
        )
        return list(parent.pages)

    def free(self, seq_id: int) -> None:
        """End ``seq_id``: each page loses a reference; a page at zero stays cached
        (evictable) if it is indexed, else returns to the free queue. Pages are
        released tail first, so a chain's tail is evicted before its head."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self._pages.release(reversed(seq.pages), self._key_by_page)

    def lookup(
        self,
        tokens: Sequence[int],
        space: KeySpace = KeySpace(),
        *,
        compute_last: bool = True,
    ) -> PrefixHit:
        """What allocate of ``tokens`` in the key space ``space`` with ``compute_last``
        would serve from the cache now (:class:`PrefixHit`). Read-only: no
        pins, no LRU update, no stats, no events. A daemon pool with lower tiers first
        brings pages up from them, as allocate does (kvcore.daemon.tiering): that
        changes which pages are cached and queues their events, never any sequence
        (docs/concepts.md, "Tiers")."""
        _, root = self._resolve(space)
        token_bytes = encode_tokens(tokens)
        limit = _hit_limit(len(token_bytes) // 4, self._page_size, compute_last)
        _, pages = self._match(root, token_bytes, limit)
        refcounts = self._refcounts
        evictable = [refcounts[page] for page in pages].count(0)  # unreferenced: in the LRU
        return PrefixHit(len(pages) * self._page_size, evictable)

    # -- for a caller that keeps pages below the pool (kvcore.daemon.tiering) ---

    def check_new(self, seq_id: int) -> None:
        """Raise what allocate or fork of the new sequence ``seq_id`` raises first:
        BadRequest unless it is an int in [0, 2**64), SequenceExists if it is live."""
        if not isinstance(seq_id, int) or seq_id.__class__ is bool or not 0 <= seq_id <= MAX_SEQ_ID:
            raise BadRequest(f"sequence ids are ints in [0, 2**64), got {seq_id!r}")
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id} is live")

    def plan(
        self,
        tokens: Sequence[int],
        space: KeySpace = KeySpace(),
    ) -> PrefixPlan:
        """The keys of ``tokens``' full pages that a hit may cover, how many lead
        indexed in the key space ``space``, and the room
        beside them (:class:`PrefixPlan`). Read-only, like :meth:`lookup`; hashes
        the pages a hit may cover after those indexed now."""
        root = self._root(space)
        token_bytes = encode_tokens(tokens)
        num_tokens = len(token_bytes) // 4
        limit = _hit_limit(num_tokens, self._page_size)
        keys, hit_pages = self._match(root, token_bytes, limit)
        rest = token_bytes[: limit * 4 * self._page_size]
        keys += chain_keys(keys[-1] if keys else root, rest, self._page_size, len(keys))
        num_new = self.layout.pages_for(num_tokens) - len(hit_pages)
        return PrefixPlan(keys, len(hit_pages), self._room(hit_pages), num_new)

    def adopt(
        self,
        tokens: Sequence[int],
        num_pages: int,
        space: KeySpace = KeySpace(),
        *,
        medium: str = "",
    ) -> list[int]:
        """Index fresh pages for the ``num_pages`` full pages of ``tokens`` that follow
        the pages a :meth:`lookup` of ``tokens`` hits now, as if committed: the caller
        fills them with bytes found below the pool (a lower tier) before anyone reads
        them. Returns the pages, in chain order; fewer than ``num_pages`` when a key
        further down the chain is already indexed (the run stops before it)::

            tokens    | hit pages (pool) | adopted: num_pages | rest . . | last token
                      k0 .. k(m-1)        km .. k(m+n-1)

        The adopted pages (and the evictable hit pages) end up evictable, most
        recently used, tail least recent; no sequence holds them; adopting nothing
        changes nothing. The key space ``space`` is the lookup's; ``medium`` labels their stored events. OutOfPages if the pages do not fit beside the hit pages; BadRequest
        if the run reaches the last token (a hit never covers it).
        """
        space, root = self._resolve(space)
        token_bytes = encode_tokens(tokens)
        _check_count("num_pages", num_pages)
        max_pages = _hit_limit(len(token_bytes) // 4, self._page_size)
        keys, hit_pages = self._match(root, token_bytes, max_pages)
        if len(hit_pages) + num_pages > max_pages:
            raise BadRequest(
                f"adopt of {num_pages} pages after {len(hit_pages)} hits "
                f"covers the last token ({max_pages} pages may hit)"
            )
        stride = 4 * self._page_size
        first = len(hit_pages)
        parent = keys[-1] if keys else root
        new: list[PrefixKey] = []
        for key in chain_keys(
            parent, token_bytes[: (first + num_pages) * stride], self._page_size, first
        ):
            if key in self._entries:
                break
            new.append(key)
        if not new:
            return []
        self._check_room(len(new), self._room(hit_pages))
        self._pages.retain(hit_pages)  # so that the take below cannot evict them
        pages = self._pages.take(len(new), self._evict)
        chain_bytes = token_bytes[first * stride : (first + len(new)) * stride]
        self._index.insert_chain(parent, new, pages, chain_bytes, space, medium)
        self._pages.release(reversed(hit_pages + pages), self._key_by_page)
        return list(pages)

    def restore(self, entries: Sequence[PageStored]) -> None:
        """Index ``entries`` as cached pages, oldest first: what a restarted daemon
        found committed in its pool (kvcore.daemon.index_table). Each becomes
        evictable, held by no sequence, and its PageStored event is queued (in the
        order given); the oldest is evicted first, except that a page whose child is
        restored too stays after it (a chain's head outlives its tails, as after a
        release). Only on a Manager that has indexed nothing and holds no page;
        BadRequest, changing nothing, unless the keys and the pages are distinct, each
        page is in the pool and each entry holds one page of tokens. Each key must be
        ``page_key(parent_key, tokens)``: the caller verified it (IndexTable.scan
        does; hashing again would double a restart's time), check_integrity asserts it."""
        if len(self._index) or self._pages.num_free != self.layout.num_pages:
            raise BadRequest("restore() takes a Manager that has indexed nothing and holds no page")
        stride = 4 * self._page_size
        if (
            len({entry.key for entry in entries}) != len(entries)
            or len({entry.page for entry in entries}) != len(entries)
            or any(not 0 <= entry.page < self.layout.num_pages for entry in entries)
            or any(len(entry.tokens) != stride for entry in entries)
        ):
            raise BadRequest(
                "restore() takes distinct keys and pages of the pool, each with one page "
                f"({stride} bytes) of tokens"
            )
        insert = self._index.insert_chain
        run: list[PageStored] = []  # entries each the child of the one before: one insert
        for entry in entries:  # in the order given, so a parent's event precedes its child's
            if run and (entry.parent_key != run[-1].key or entry.space != run[0].space):
                insert(run[0].parent_key, *_chain_of(run), run[0].space)
                run = []
            run.append(entry)
        if run:
            insert(run[0].parent_key, *_chain_of(run), run[0].space)
        order = _heads_after_tails(entries)
        self._pages.restore([(entry.page, entry.key) for entry in order])

    def withhold_free(self) -> int:
        """Take every free page out of use, and evict nothing, until
        :meth:`release_withheld` (a withheld page is neither free nor evictable: stats
        count it in ``withheld_pages``): after :meth:`restore`, the pages nobody
        committed, which a process of the last daemon's time may still write, and the
        restored ones, which it may still read as the hits that daemon granted
        (kvcore.daemon.restart). Meanwhile restored pages are hits as usual, and an
        allocation that needs a page no sequence has freed since is OutOfPages.
        Returns how many pages were withheld."""
        return self._pages.withhold_free()

    def release_withheld(self) -> int:
        """Free every withheld page and allow evictions again; returns how many pages."""
        return self._pages.release_withheld()

    @property
    def records_evictions(self) -> bool:
        """True iff built with ``record_evictions`` (:meth:`take_evicted` lists them)."""
        return self._evicted is not None

    def take_evicted(self) -> list[tuple[PrefixKey, PageId]]:
        """(key, page) of every page evicted since the last call, in order (the order
        of their PageRemoved events); [] unless built with ``record_evictions``."""
        evicted = self._evicted
        if not evicted:
            return []
        self._evicted = []
        return evicted

    def take_events(self) -> list[PageEvent]:
        """The prefix index's events since the last call, oldest first (PageStored when
        a page is committed, PageRemoved when it is evicted); clears the queue."""
        return self._index.take_events()

    def prefix_snapshot(self) -> list[PageStored]:
        """Every indexed page with its key and parent key, each parent before its
        children: what a subscriber that lost events rebuilds its view from. O(index)."""
        return self._index.snapshot()

    # -- queries ----------------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).pages)

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_tokens

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def stats(self) -> Stats:
        return Stats(
            total_pages=self.layout.num_pages,
            free_pages=self._pages.num_free,
            evictable_pages=self._pages.num_evictable,
            held_pages=self._pages.num_held,
            cached_pages=len(self._index),
            num_sequences=len(self._seqs),
            query_tokens=self.hits.query_tokens,
            hit_tokens=self.hits.hit_tokens,
            evictions=self._evictions,
            withheld_pages=self._pages.num_withheld,
        )

    def check_integrity(self) -> None:
        """Assert every invariant of the module docstring. O(pool): for tests."""
        self.hits.check_integrity()
        references: Counter[PageId] = Counter()
        for seq_id, seq in self._seqs.items():
            assert len(seq.pages) == self.layout.pages_for(seq.num_tokens), (
                f"sequence {seq_id}: {len(seq.pages)} pages for {seq.num_tokens} tokens"
            )
            assert len(seq.keys) <= seq.num_tokens // self._page_size, (
                f"sequence {seq_id}: a key for a page that is not full"
            )
            assert seq.root == root_key(seq.space), f"sequence {seq_id}: wrong root"
            references.update(seq.pages)
        self._pages.check_integrity(references, self._key_by_page)
        self._index.check_integrity()  # which checks every key against its tokens
        given, space, root = self._space_memo
        assert given.resolved() == space, "the key-space memo resolves another space"
        assert root == root_key(space), "the key-space memo holds another key space's root"

    # -- internals --------------------------------------------------------------

    def _grow(self, seq: _Sequence, num_tokens: int, num_new: int) -> Extension:
        """extend beyond the fast path: new pages, copy-on-write, or both."""
        pages = seq.pages
        last = pages[-1] if pages else None
        cow = (
            last is not None
            and num_tokens > 0
            and seq.num_tokens % self._page_size != 0
            and self._refcounts[last] > 1
        )
        self._check_room(num_new + cow, self._pages.num_available)
        fresh = self._pages.take(num_new + cow, self._evict)
        copies: list[tuple[int, int]] = []
        if cow:
            assert last is not None
            dst = fresh.pop()
            pages[-1] = dst
            self._pages.release((last,), self._key_by_page)  # still held by another
            copies.append((last, dst))
        pages.extend(fresh)
        seq.num_tokens += num_tokens
        return Extension(list(fresh), copies)

    def _match(
        self, root: PrefixKey, token_bytes: bytes, max_pages: int
    ) -> tuple[list[PrefixKey], list[PageId]]:
        """Keys and pages of the longest indexed run of leading full pages, at most
        ``max_pages`` (:func:`_hit_limit`). Hashes nothing: page i is found by its
        parent key (``root`` for page 0) and its token bytes, which name one key
        (PrefixIndex.by_content), one dict look-up per page, one past the match."""
        stride = 4 * self._page_size
        get = self._by_content.get
        keys: list[PrefixKey] = []
        pages: list[PageId] = []
        parent = root
        for at in range(0, max_pages * stride, stride):
            entry = get((parent, token_bytes[at : at + stride]))
            if entry is None:
                break
            parent = entry.key
            keys.append(parent)
            pages.append(entry.page)
        return keys, pages

    def _room(self, hit_pages: list[PageId]) -> int:
        """Pages take() may hand out beside ``hit_pages``, which the caller pins first:
        free + evictable, less the evictable hit pages (free only while withholding)."""
        pages, refcounts = self._pages, self._refcounts
        if pages.withholding:
            return pages.num_free
        return pages.num_available - [refcounts[page] for page in hit_pages].count(0)

    @staticmethod
    def _check_room(num_pages: int, room: int) -> None:
        if num_pages > room:
            raise OutOfPages(f"need {num_pages} pages, {room} free or evictable")

    def _evict(self, page: PageId) -> None:
        if self._evicted is not None:
            key = self._key_by_page[page]
            self._evicted.append((key, page))
        self._index.remove(page)
        self._evictions += 1

    def _get(self, seq_id: int) -> _Sequence:
        """The live sequence ``seq_id``; UnknownSequence for anything else, a bool or a
        float equal to a live id included (they hash alike).

        Ids and counts are ints and not bools, tested as ``isinstance(x, int) and
        x.__class__ is not bool`` throughout (bool cannot be subclassed, so this is
        ``not isinstance(x, bool)``, without a second call), after the one test
        ``x.__class__ is int``, which implies it (extend, the per-token path, inlines
        that test)."""
        if seq_id.__class__ is int:  # the common case, one test
            seq = self._seqs.get(seq_id)
        else:
            is_int = isinstance(seq_id, int) and seq_id.__class__ is not bool
            seq = self._seqs.get(seq_id) if is_int else None
        if seq is None:
            raise UnknownSequence(f"no live sequence {seq_id!r}")
        return seq

    def _root(self, space: KeySpace) -> PrefixKey:
        """root_key(space), memoized (:meth:`_resolve`)."""
        return self._resolve(space)[1]

    def _resolve(self, space: KeySpace) -> tuple[KeySpace, PrefixKey]:
        """(``space`` with a None namespace resolved, its root key), memoized for the
        last key space; BadRequest unless ``space`` is a KeySpace whose parts are strs
        of at most 256 UTF-8 bytes (root_key checks them). The memo keeps a space
        only if each part is an exact str, so the same object (a KeySpace is
        immutable) has the same values and skips even the comparison."""
        memo = self._space_memo
        if space is memo[0]:
            return memo[1], memo[2]
        if space.__class__ is not KeySpace:
            raise BadRequest(f"a key space must be a KeySpace, got {space!r}")
        resolved = space.resolved()
        exact = all(part.__class__ is str for part in resolved)
        root = memo[2] if exact and resolved == memo[1] else root_key(resolved)
        if exact:
            self._space_memo = (space, resolved, root)
        return resolved, root

    # -- one-page chains: a store of whole pages (SGLang's HiCache storage) ----------

    def allocate_pages(
        self, seq_id: int, tokens: Sequence[int], space: KeySpace = KeySpace()
    ) -> PagesAllocation:
        """Start sequence ``seq_id`` holding ``len(tokens) // page_size`` one-page chains:
        page i of ``tokens`` is keyed as the first page of a prompt in the key space
        ``space`` (its parent is the root, spec/hashing.md), not as page i - 1's
        continuation. A page whose key is indexed is pinned (``hits[i]``: it holds that
        page's K/V; read it, never write it); every other page gets a fresh page to
        write and then publish with :meth:`commit_pages`. What as many one-page
        allocates with ``compute_last=False`` would do, in one sequence (one ownership,
        one quota entry, one free). ``tokens`` may be packed (kvcore.prefix.PackedTokens:
        no work per token), here and in the other ``*_pages`` methods. OutOfPages if the
        fresh pages do not fit; BadRequest unless ``tokens`` is whole pages, or for a bad
        key space."""
        self.check_new(seq_id)
        space, root = self._resolve(space)  # BadRequest for a bad key space
        token_bytes, stride = self._whole_pages(tokens, "allocate_pages")
        get = self._by_content.get  # (parent, page tokens) -> entry: no hashing
        found = [
            get((root, token_bytes[at : at + stride])) for at in range(0, len(token_bytes), stride)
        ]
        hit_pages = [entry.page for entry in found if entry is not None]
        num_new = len(found) - len(hit_pages)
        self._check_room(num_new, self._room(list(dict.fromkeys(hit_pages))))  # a page once
        self._pages.retain(hit_pages)  # pinned first, so the take below cannot evict them
        self._pages.hit(hit_pages)
        fresh = iter(self._pages.take(num_new, self._evict))
        pages = [next(fresh) if entry is None else entry.page for entry in found]
        num_tokens = len(token_bytes) // 4
        self._seqs[seq_id] = _Sequence(space, root, pages, num_tokens)
        self.hits.record(space.namespace, num_tokens, len(hit_pages) * self._page_size, None)
        return PagesAllocation(list(pages), [entry is not None for entry in found])

    def commit_pages(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Publish each of the first ``len(tokens) // page_size`` pages of ``seq_id`` as
        the one-page chain of its tokens, keyed as :meth:`allocate_pages` keys them;
        ``tokens`` are the sequence's first tokens, whole pages. A page already indexed under its key (a hit, or
        committed before) is left as it is; a page whose key another page holds stays
        private. Afterwards every page's key is indexed. Returns the pages this call
        indexed. BadRequest, changing nothing, unless ``tokens`` is whole pages and at
        most the sequence's tokens, or if a page is indexed under another key (a hit of
        other tokens, or committed with other tokens)."""
        seq = self._get(seq_id)
        token_bytes = encode_tokens(tokens)
        stride = 4 * self._page_size
        if len(token_bytes) > 4 * seq.num_tokens or len(token_bytes) % stride:
            raise BadRequest(
                f"commit_pages of sequence {seq_id} takes whole pages of "
                f"{self._page_size} tokens, at most its {seq.num_tokens}; "
                f"got {len(token_bytes) // 4}"
            )
        root, pages, published = seq.root, seq.pages, self._key_by_page
        chunks = [token_bytes[at : at + stride] for at in range(0, len(token_bytes), stride)]
        keys = [page_key(root, chunk) for chunk in chunks]
        for i, key in enumerate(keys):
            known = published.get(pages[i])
            if known is not None and known != key:
                raise BadRequest(
                    f"page {pages[i]} (page {i} of sequence {seq_id}) is indexed with other "
                    "tokens than this commit sends"
                )
        indexed = len(published)
        for page, key, chunk in zip(pages[: len(keys)], keys, chunks, strict=True):
            if page not in published:  # a key another page holds keeps it; this one stays private
                self._index.insert_chain(root, (key,), (page,), chunk, seq.space)
        return len(published) - indexed

    def lookup_pages(self, tokens: Sequence[int], space: KeySpace = KeySpace()) -> list[bool]:
        """Per one-page chain of ``tokens`` (whole pages, keyed as :meth:`allocate_pages`
        keys them), whether its key is indexed in the key space ``space`` now: what
        :meth:`allocate_pages` would find a hit. Read-only, as :meth:`lookup`: no pins,
        no LRU update, no stats, no events. BadRequest unless ``tokens`` is whole
        pages, or for a bad key space."""
        _, root = self._resolve(space)
        token_bytes, stride = self._whole_pages(tokens, "lookup_pages")
        found = self._by_content
        return [
            (root, token_bytes[at : at + stride]) in found
            for at in range(0, len(token_bytes), stride)
        ]

    def one_page_keys(
        self, tokens: Sequence[int], chains: Sequence[int], space: KeySpace = KeySpace()
    ) -> list[PrefixKey]:
        """The prefix key of each one-page chain ``chains[i]`` of ``tokens`` (an index of
        its page), as :meth:`allocate_pages` keys it: what a lower tier keeps it under
        (kvcore.daemon.tiering). BadRequest unless ``tokens`` is whole pages, or for a
        bad key space; ``chains`` are valid page indices (the caller's invariant)."""
        _, root = self._resolve(space)
        token_bytes, stride = self._whole_pages(tokens, "one_page_keys")
        return [page_key(root, token_bytes[i * stride : (i + 1) * stride]) for i in chains]

    def adopt_pages(
        self,
        tokens: Sequence[int],
        chains: Sequence[int],
        space: KeySpace = KeySpace(),
        *,
        medium: str = "",
    ) -> list[int]:
        """:meth:`adopt` for one-page chains (kvcore.daemon.tiering): index a fresh page
        for each one-page chain ``chains[i]`` of ``tokens`` (an index of its page, keyed
        as :meth:`allocate_pages` keys it), as if committed, for the caller to fill with
        bytes found below the pool before anyone reads them. Every page indexed for a
        chain of ``tokens`` stays pinned meanwhile, so neither they nor the pages adopted
        are evicted for the fresh ones. Adopts the leading chains that fit beside those
        pins; returns their pages, in order of ``chains`` (fewer when the room runs
        out). The adopted pages (and the evictable indexed ones) end up evictable, most
        recently used; ``medium`` labels their stored events. BadRequest, changing
        nothing, unless ``tokens`` is whole pages and each of ``chains`` names a chain
        of them not indexed now, its tokens unlike every other's of ``chains``."""
        space, root = self._resolve(space)
        token_bytes, stride = self._whole_pages(tokens, "adopt_pages")
        chunks = [token_bytes[at : at + stride] for at in range(0, len(token_bytes), stride)]
        get = self._by_content.get
        wanted = [chunks[i] if 0 <= i < len(chunks) else b"" for i in chains]
        if b"" in wanted or len(set(wanted)) != len(wanted) or any(get((root, c)) for c in wanted):
            raise BadRequest(
                "adopt_pages takes distinct chains of the tokens, none indexed, "
                f"got {list(chains)} of {len(chunks)}"
            )
        found = (get((root, chunk)) for chunk in chunks)
        hit_pages = list(dict.fromkeys(entry.page for entry in found if entry is not None))
        wanted = wanted[: self._room(hit_pages)]
        if not wanted:
            return []
        self._pages.retain(hit_pages)  # so that the take below cannot evict them
        pages = self._pages.take(len(wanted), self._evict)
        for page, chunk in zip(pages, wanted, strict=True):
            self._index.insert_chain(root, (page_key(root, chunk),), (page,), chunk, space, medium)
        self._pages.release(reversed(hit_pages + pages), self._key_by_page)
        return list(pages)

    def _whole_pages(self, tokens: Sequence[int], op: str) -> tuple[bytes, int]:
        """``tokens`` as u32 bytes and the bytes of one page of them; BadRequest (naming
        ``op``) unless they are whole pages or a token is not an int in [0, 2**32)."""
        token_bytes = encode_tokens(tokens)
        stride = 4 * self._page_size
        if len(token_bytes) % stride:
            raise BadRequest(
                f"{op} takes whole pages of {self._page_size} tokens, got {len(token_bytes) // 4}"
            )
        return token_bytes, stride


def _check_count(name: str, value: object) -> None:
    """BadRequest unless ``value`` is an int >= 0 and not a bool."""
    if not isinstance(value, int) or value.__class__ is bool or value < 0:
        raise BadRequest(f"{name} must be an int >= 0, got {value!r}")


def _chain_of(run: list[PageStored]) -> tuple[list[PrefixKey], list[PageId], bytes]:
    """The keys, pages and joined tokens of ``run``, a chain's consecutive entries."""
    return [e.key for e in run], [e.page for e in run], b"".join([e.tokens for e in run])


def _heads_after_tails(entries: Sequence[PageStored]) -> list[PageStored]:
    """``entries`` (oldest first) reordered so that each entry whose parent is among
    them comes before that parent: walking from the newest, each entry is placed
    just after (older than) its not yet placed ancestors. O(entries)."""
    by_key = {entry.key: entry for entry in entries}
    placed: set[PrefixKey] = set()
    newest_first: list[PageStored] = []
    for newest in reversed(entries):
        path: list[PageStored] = []
        entry: PageStored | None = newest
        while entry is not None and entry.key not in placed:
            placed.add(entry.key)
            path.append(entry)
            entry = by_key.get(entry.parent_key)
        newest_first.extend(reversed(path))  # the head-most first: the most recent
    newest_first.reverse()
    return newest_first


def _hit_limit(num_tokens: int, page_size: int, compute_last: bool = True) -> int:
    """Pages a prefix hit of ``num_tokens`` tokens may cover: every full page, less
    the last token when the caller computes it (``compute_last``)."""
    return max(num_tokens - compute_last, 0) // page_size
