"""Manager: the one state machine of kvcore (docs/architecture.md, "The state machine").

It owns no memory: it decides which page of the pool holds which tokens of
which sequence, who shares a page, and which pages hold which committed
prefix. Engines (in-process, or over the wire through kvcore.service) write
and read the pages themselves.

Token ranges of one sequence, page_size = 4, 10 tokens::

    tokens     0 1 2 3 | 4 5 6 7 | 8 9 . .
    pages      [  p7   ] [  p2   ] [  p5 ]     block table = [7, 2, 5]
    committed  key0      key1                  full pages published by commit()
    a prefix hit covers at most (n - 1) // page_size pages: never the last token

The Manager does no I/O. Changes of the prefix index queue
:class:`~kvcore.prefix.PageStored` / :class:`~kvcore.prefix.PageRemoved` events
that :meth:`Manager.take_events` hands over (the daemon publishes them after
each request).

Every public method either succeeds or raises a :class:`~kvcore.errors.KVCoreError`
having changed nothing (stats counters and the event queue included). Invariants, checked by
:meth:`check_integrity` after every step of the conformance state machine:

* free + evictable + held == total pages;
* a page's refcount equals the number of block-table entries naming it;
* no page is both free and referenced; every evictable page is indexed;
* every block table has exactly ceil(num_tokens / page_size) pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcore.allocator import PageAllocator, PageId
from kvcore.errors import BadRequest, OutOfPages, SequenceExists, UnknownSequence
from kvcore.layout import KVLayout
from kvcore.prefix import (
    PageEvent,
    PageStored,
    PrefixIndex,
    PrefixKey,
    encode_tokens,
    page_key,
    root_key,
)

DEFAULT_NAMESPACE = "default"
MAX_SEQ_ID = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Allocation:
    """Result of :meth:`Manager.allocate`.

    ``pages`` is the new block table; its first ``num_cached_tokens // page_size``
    pages already hold the prompt's K/V (a prefix hit) and must not be written.
    """

    pages: list[int]
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class Extension:
    """Result of :meth:`Manager.extend`.

    Run every ``(src, dst)`` page copy of ``copies`` (backend ``copy_pages``)
    before writing: the block table had ``src`` where it now has ``dst``
    (copy-on-write of a shared last page). ``new_pages`` were appended.
    """

    new_pages: list[int]
    copies: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Result of :meth:`Manager.lookup`: what :meth:`Manager.allocate` of the same
    tokens would reuse now.

    ``num_cached_tokens`` (tokens) = hit pages x page_size; ``num_evictable_pages``
    (pages) of those hit pages are unreferenced now, so allocate would pin them out
    of the LRU. An allocate of ``n`` tokens therefore fits iff::

        pages_for(n) - hit_pages <= free + evictable - num_evictable_pages
    """

    num_cached_tokens: int
    num_evictable_pages: int


@dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of one pool; page counts in pages, hits and queries in tokens."""

    total_pages: int
    free_pages: int
    evictable_pages: int
    held_pages: int
    cached_pages: int  # pages in the prefix index, held or evictable
    num_sequences: int
    query_tokens: int  # prompt tokens of successful allocate calls
    hit_tokens: int  # of those, tokens served from the prefix cache
    evictions: int  # cached pages reclaimed for new allocations

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class _Sequence:
    namespace: str
    root: PrefixKey  # root_key(namespace)
    pages: list[PageId]  # block table; only grows, except copy-on-write of the last page
    num_tokens: int
    keys: list[PrefixKey] = field(default_factory=list)  # keys of pages[:len(keys)]


class Manager:
    """The page-pool state machine for one :class:`KVLayout`. Not thread-safe."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._pages = PageAllocator(layout.num_pages)
        self._index = PrefixIndex()
        self._seqs: dict[int, _Sequence] = {}
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0
        # The keys of the last prompt matched, so that a lookup followed by an
        # allocate of the same prompt hashes it once: (root, token bytes, keys of
        # its leading pages). Keys are a pure function of (root, bytes), so this
        # changes no result; it is compared by bytes, never by identity.
        self._memo: tuple[PrefixKey, bytes, list[PrefixKey]] | None = None

    # -- operations -------------------------------------------------------------

    def allocate(
        self, seq_id: int, tokens: Sequence[int], *, namespace: str = DEFAULT_NAMESPACE
    ) -> Allocation:
        """Start sequence ``seq_id`` holding ``tokens``: reuse the longest committed
        prefix of whole pages in ``namespace`` (never covering the last token) and
        add fresh pages for the rest. OutOfPages if they do not fit."""
        self._check_new(seq_id)
        root = self._root(namespace)
        token_bytes = encode_tokens(tokens)
        keys, hit_pages = self._match(root, token_bytes, len(tokens))
        num_new = self.layout.pages_for(len(tokens)) - len(hit_pages)
        pinned = sum(1 for page in hit_pages if self._pages.is_evictable(page))
        self._check_room(num_new, pinned)
        for page in hit_pages:
            self._pages.retain(page)
        pages = hit_pages + self._pages.take(num_new, self._evict)
        self._seqs[seq_id] = _Sequence(namespace, root, pages, len(tokens), keys)
        num_cached = len(hit_pages) * self.layout.page_size
        self._query_tokens += len(tokens)
        self._hit_tokens += num_cached
        return Allocation(list(pages), num_cached)

    def extend(self, seq_id: int, num_tokens: int) -> Extension:
        """Grow ``seq_id`` by ``num_tokens`` tokens, adding pages as needed.

        If the sequence's last page is partly filled and shared (refcount > 1),
        the sequence gets a private copy first (copy-on-write)."""
        seq = self._get(seq_id)
        if not _is_int(num_tokens) or num_tokens < 0:
            raise BadRequest(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        page_size = self.layout.page_size
        total = seq.num_tokens + num_tokens
        num_new = self.layout.pages_for(total) - len(seq.pages)
        last = seq.pages[-1] if seq.pages else None
        cow = (
            last is not None
            and num_tokens > 0
            and seq.num_tokens % page_size != 0
            and self._pages.refcount(last) > 1
        )
        self._check_room(num_new + cow)
        fresh = self._pages.take(num_new + cow, self._evict)
        copies: list[tuple[int, int]] = []
        if cow:
            assert last is not None
            dst = fresh.pop()
            seq.pages[-1] = dst
            self._pages.release(last, cached=self._index.is_indexed(last))
            copies.append((last, dst))
        seq.pages.extend(fresh)
        seq.num_tokens = total
        return Extension(list(fresh), copies)

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
        BadRequest otherwise. Pages already published are neither hashed nor
        validated again, so a client sends only what is new. A page whose key is
        already indexed (another sequence committed the same prefix first) stays
        private. BadRequest if the tokens contradict a page's published key.
        """
        seq = self._get(seq_id)
        page_size = self.layout.page_size
        first = len(seq.keys)  # pages to publish: [first, end)
        if not _is_int(start) or not 0 <= start <= first * page_size or start % page_size:
            raise BadRequest(
                f"commit start must be a multiple of {page_size} tokens in "
                f"[0, {first * page_size}] (the committed pages), got {start!r}"
            )
        if start + len(tokens) > seq.num_tokens:
            raise BadRequest(
                f"commit of tokens up to {start + len(tokens)}; sequence {seq_id} holds "
                f"{seq.num_tokens}"
            )
        end = (start + len(tokens)) // page_size
        if end <= first:
            return first
        # Only the new pages' tokens are encoded, so a commit per page stays O(page).
        token_bytes = encode_tokens(tokens[first * page_size - start : end * page_size - start])
        stride = 4 * page_size
        parent = seq.keys[-1] if seq.keys else seq.root
        new: list[tuple[PrefixKey, PrefixKey, PageId]] = []
        for i in range(first, end):
            j = i - first
            key = page_key(parent, token_bytes[j * stride : (j + 1) * stride])
            published = self._index.key_of(seq.pages[i])
            if published is not None and published != key:
                raise BadRequest(
                    f"page {seq.pages[i]} (page {i} of sequence {seq_id}) was committed "
                    "with other tokens"
                )
            new.append((key, parent, seq.pages[i]))
            parent = key
        for key, parent_key, page in new:
            self._index.insert(key, parent_key, page)
            seq.keys.append(key)
        return len(seq.keys)

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        """New sequence ``child_id`` sharing every page of ``parent_id`` (refcount +1
        each). Never allocates, so never runs out of pages. Returns the child's
        block table."""
        parent = self._get(parent_id)
        self._check_new(child_id)
        for page in parent.pages:
            self._pages.retain(page)
        self._seqs[child_id] = _Sequence(
            parent.namespace, parent.root, list(parent.pages), parent.num_tokens, list(parent.keys)
        )
        return list(parent.pages)

    def free(self, seq_id: int) -> None:
        """End ``seq_id``: each page loses a reference; a page at zero stays cached
        (evictable) if it is indexed, else returns to the free queue. Pages are
        released tail first, so a chain's tail is evicted before its head."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for page in reversed(seq.pages):
            self._pages.release(page, cached=self._index.is_indexed(page))

    def lookup(
        self, tokens: Sequence[int], *, namespace: str = DEFAULT_NAMESPACE
    ) -> PrefixHit:
        """What allocate of ``tokens`` in ``namespace`` would serve from the cache now
        (:class:`PrefixHit`). Read-only: no pins, no LRU update, no stats, no events."""
        token_bytes = encode_tokens(tokens)
        _, pages = self._match(self._root(namespace), token_bytes, len(tokens))
        evictable = sum(1 for page in pages if self._pages.is_evictable(page))
        return PrefixHit(len(pages) * self.layout.page_size, evictable)

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
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            evictions=self._evictions,
        )

    def check_integrity(self) -> None:
        """Assert every invariant of the module docstring. O(pool): for tests."""
        references: Counter[PageId] = Counter()
        for seq_id, seq in self._seqs.items():
            assert len(seq.pages) == self.layout.pages_for(seq.num_tokens), (
                f"sequence {seq_id}: {len(seq.pages)} pages for {seq.num_tokens} tokens"
            )
            assert len(seq.keys) <= seq.num_tokens // self.layout.page_size, (
                f"sequence {seq_id}: a key for a page that is not full"
            )
            references.update(seq.pages)
        indexed = [page for page in range(self.layout.num_pages) if self._index.is_indexed(PageId(page))]
        self._pages.check_integrity(references, (PageId(p) for p in indexed))
        self._index.check_integrity()

    # -- internals --------------------------------------------------------------

    def _match(
        self, root: PrefixKey, token_bytes: bytes, num_tokens: int
    ) -> tuple[list[PrefixKey], list[PageId]]:
        """Keys and pages of the longest indexed run of leading full pages, leaving
        at least the last token uncovered. Hashes one page past the match at most."""
        max_pages = max(num_tokens - 1, 0) // self.layout.page_size
        stride = 4 * self.layout.page_size
        memo = self._memo
        if memo is not None and memo[0] == root and memo[1] == token_bytes:
            known = memo[2]
        else:
            known = []
            self._memo = (root, token_bytes, known)
        keys: list[PrefixKey] = []
        pages: list[PageId] = []
        parent = root
        for i in range(max_pages):
            if i < len(known):
                key = known[i]
            else:
                key = page_key(parent, token_bytes[i * stride : (i + 1) * stride])
                known.append(key)
            page = self._index.get(key)
            if page is None:
                break
            keys.append(key)
            pages.append(page)
            parent = key
        return keys, pages

    def _check_room(self, num_pages: int, pinned_evictable: int = 0) -> None:
        available = self._pages.num_free + self._pages.num_evictable - pinned_evictable
        if num_pages > available:
            raise OutOfPages(f"need {num_pages} pages, {available} free or evictable")

    def _evict(self, page: PageId) -> None:
        self._index.remove(page)
        self._evictions += 1

    def _get(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id) if _is_int(seq_id) else None
        if seq is None:
            raise UnknownSequence(f"no live sequence {seq_id!r}")
        return seq

    def _check_new(self, seq_id: int) -> None:
        if not _is_int(seq_id) or not 0 <= seq_id <= MAX_SEQ_ID:
            raise BadRequest(f"sequence ids are ints in [0, 2**64), got {seq_id!r}")
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id} is live")

    @staticmethod
    def _root(namespace: str) -> PrefixKey:
        if not isinstance(namespace, str):
            raise BadRequest(f"namespace must be a str, got {namespace!r}")
        return root_key(namespace)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
