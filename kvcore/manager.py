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

* free + evictable + held == total pages;
* a page's refcount equals the number of block-table entries naming it;
* no page is both free and referenced; every evictable page is indexed;
* every block table has exactly ceil(num_tokens / page_size) pages;
* the memos (the last key space's root, the last prompt's page keys) hold what
  hashing would compute now.

Key spaces: a sequence's pages are keyed under the root of its
:class:`~kvcore.prefix.KeySpace` (namespace, model, LoRA adapter, cache salt;
spec/hashing.md), fixed when it is allocated (a fork inherits it), so commit,
extend and fork take no key-space argument. Pages of different key spaces never
share a key, hence never a page; equal key spaces share as one namespace did.

The file is one class over ~400 lines on purpose: every method keeps these
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

    def __init__(self, layout: KVLayout, *, record_evictions: bool = False) -> None:
        self.layout = layout
        self._page_size = layout.page_size
        self._pages = PageAllocator(layout.num_pages)
        self._refcounts = self._pages.refcounts  # read only: the allocator writes it
        self._index = PrefixIndex()
        self._entries = self._index.entries  # read only: the index writes them
        self._key_by_page = self._index.key_by_page  # read only, likewise
        self._seqs: dict[int, _Sequence] = {}
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0
        # (key, page) of each eviction since the last take_evicted(), if recording: what
        # a caller that keeps evicted bytes (kvcore.daemon.tiering) must copy out of the
        # page before anyone writes into it again.
        self._evicted: list[tuple[PrefixKey, PageId]] | None = [] if record_evictions else None
        # Memos of pure functions, so neither can change a result: the root key of
        # the last key space; and the keys of the last prompt matched (root, token
        # bytes, keys of its first pages, at most the pages a hit may cover),
        # compared by bytes, never by identity (see _match).
        default = KeySpace(DEFAULT_NAMESPACE)
        self._root_memo: tuple[KeySpace, PrefixKey] = (default, root_key(default))
        self._match_memo: tuple[PrefixKey, bytes, list[PrefixKey]] | None = None

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
        root = self._root(space)  # BadRequest for a bad key space
        space = space.resolved()
        token_bytes = encode_tokens(tokens)
        num_tokens = len(token_bytes) // 4
        keys, hit_pages = self._match(
            root, token_bytes, _hit_limit(num_tokens, self._page_size, compute_last)
        )
        num_new = self.layout.pages_for(num_tokens) - len(hit_pages)
        self._check_room(num_new, self._room(hit_pages))
        self._pages.retain(hit_pages)
        pages = hit_pages + self._pages.take(num_new, self._evict)
        self._seqs[seq_id] = _Sequence(space, root, pages, num_tokens, keys)
        num_cached = len(hit_pages) * self._page_size
        self._query_tokens += num_tokens
        self._hit_tokens += num_cached
        return Allocation(list(pages), num_cached)

    def extend(self, seq_id: int, num_tokens: int) -> Extension:
        """Grow ``seq_id`` by ``num_tokens`` tokens, adding pages as needed.

        If the sequence's last page is partly filled and shared (refcount > 1),
        the sequence gets a private copy first (copy-on-write)."""
        seq = self._get(seq_id)
        if not isinstance(num_tokens, int) or num_tokens.__class__ is bool or num_tokens < 0:
            raise BadRequest(f"num_tokens must be an int >= 0, got {num_tokens!r}")
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
        root = self._root(space)
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
        every page a hit may cover."""
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
        root = self._root(space)
        token_bytes = encode_tokens(tokens)
        if not isinstance(num_pages, int) or num_pages.__class__ is bool or num_pages < 0:
            raise BadRequest(f"num_pages must be an int >= 0, got {num_pages!r}")
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
        self._index.insert_chain(parent, new, pages, chain_bytes, space.resolved(), medium)
        self._pages.release(reversed(hit_pages + pages), self._key_by_page)
        return list(pages)

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
            assert len(seq.keys) <= seq.num_tokens // self._page_size, (
                f"sequence {seq_id}: a key for a page that is not full"
            )
            assert seq.root == root_key(seq.space), f"sequence {seq_id}: wrong root"
            references.update(seq.pages)
        self._pages.check_integrity(references, self._key_by_page)
        self._index.check_integrity()
        if self._match_memo is not None:
            root, token_bytes, keys = self._match_memo
            stride = 4 * self._page_size
            assert keys == list(
                chain_keys(root, token_bytes[: len(keys) * stride], self._page_size)
            ), "the match memo holds keys of other tokens"
        space, root = self._root_memo
        assert root == root_key(space), "the root memo holds another key space's root"

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
        ``max_pages`` (:func:`_hit_limit`). Hashes one page past the match at most,
        and none of the leading pages whose bytes equal the last call's (same root):
        a lookup then an allocate of one prompt hash it once, and prompts that share
        a system prefix reuse its keys."""
        page_size = self._page_size
        stride = 4 * page_size
        memo = self._match_memo
        if memo is not None and memo[0] == root and memo[1] == token_bytes:
            known = memo[2]  # keys of this prompt's first pages, at most one past a match
        else:
            known = []
            if memo is not None and memo[0] == root:  # keep the keys of equal leading pages
                last, keys = memo[1], memo[2]
                same = min(len(keys), max_pages)
                if token_bytes[: same * stride] != last[: same * stride]:
                    same = 0
                    while (
                        token_bytes[same * stride : (same + 1) * stride]
                        == (last[same * stride : (same + 1) * stride])
                    ):
                        same += 1
                known = keys[:same]
            self._match_memo = (root, token_bytes, known)
        get = self._entries.get
        pages: list[PageId] = []
        for key in known[:max_pages]:
            entry = get(key)
            if entry is None:
                return known[: len(pages)], pages
            pages.append(entry.page)
        parent = known[-1] if known else root
        for i in range(len(known), max_pages):
            key = page_key(parent, token_bytes[i * stride : (i + 1) * stride])
            known.append(key)
            entry = get(key)
            if entry is None:
                break
            pages.append(entry.page)
            parent = key
        return known[: len(pages)], pages

    def _room(self, hit_pages: list[PageId]) -> int:
        """Pages take() may hand out beside ``hit_pages``, which the caller pins first:
        free + evictable, less the evictable hit pages."""
        refcounts = self._refcounts
        return self._pages.num_available - [refcounts[page] for page in hit_pages].count(0)

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
        ``not isinstance(x, bool)``, without a second call on the per-token path)."""
        is_int = isinstance(seq_id, int) and seq_id.__class__ is not bool
        seq = self._seqs.get(seq_id) if is_int else None
        if seq is None:
            raise UnknownSequence(f"no live sequence {seq_id!r}")
        return seq

    def _root(self, space: KeySpace) -> PrefixKey:
        """root_key(space), memoized for the last key space; BadRequest (from
        root_key) unless each part is a str of at most 256 UTF-8 bytes."""
        if space.__class__ is not KeySpace:
            raise BadRequest(f"a key space must be a KeySpace, got {space!r}")
        space = space.resolved()
        memo = self._root_memo
        if space != memo[0] or any(v.__class__ is not str for v in space):
            root = root_key(space)  # raises for a part that is not a str
            memo = self._root_memo = (space, root)
        return memo[1]


def _hit_limit(num_tokens: int, page_size: int, compute_last: bool = True) -> int:
    """Pages a prefix hit of ``num_tokens`` tokens may cover: every full page, less
    the last token when the caller computes it (``compute_last``)."""
    return max(num_tokens - compute_last, 0) // page_size
