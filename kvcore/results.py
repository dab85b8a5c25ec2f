"""What a page pool's operations return, and what serves them.

The result types of :class:`~kvcore.manager.Manager`'s operations and the
:class:`PageManager` protocol the operation table (kvcore.ops) and the daemon
call: the Manager, or a wrapper that holds one (kvcore.daemon.tiering). Plain
data, no state machine: a module that only reads results (the client, the
benches, the tests' model) needs nothing else. kvcore.manager re-exports them
all, so ``from kvcore.manager import Allocation`` keeps working. The results of the
per-step operations (allocate, extend, lookup) are msgspec Structs: built in C, a
fraction of a dataclass's Python ``__init__`` on the Manager's hottest path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kvcore.hits import HitBook
from kvcore.layout import KVLayout
from kvcore.prefix import KeySpace, PageEvent, PageStored, PrefixKey


class Allocation(msgspec.Struct):
    """Result of :meth:`Manager.allocate`.

    ``pages`` is the new block table; its first ``num_cached_tokens // page_size``
    pages already hold the prompt's K/V (a prefix hit) and must not be written.
    ``sources`` says where the hit's pages were when asked, as runs ``(medium,
    tokens)`` in chain order that add up to ``num_cached_tokens``: "pool", or the
    lower tier that brought them up ("host", "disk", "remote"; kvcore.hits.MEDIA).
    Empty: every hit token was in the pool (a pool without tiers never fills it).
    """

    pages: list[int]
    num_cached_tokens: int
    sources: list[tuple[str, int]] = []


class Extension(msgspec.Struct):
    """Result of :meth:`Manager.extend`.

    Run every ``(src, dst)`` page copy of ``copies`` (backend ``copy_pages``)
    before writing: the block table had ``src`` where it now has ``dst``
    (copy-on-write of a shared last page). ``new_pages`` were appended.
    """

    new_pages: list[int]
    copies: list[tuple[int, int]]


class PrefixHit(msgspec.Struct):
    """Result of :meth:`Manager.lookup`: what :meth:`Manager.allocate` of the same
    tokens would reuse now.

    ``num_cached_tokens`` (tokens) = hit pages x page_size; ``num_evictable_pages``
    (pages) of those hit pages are unreferenced now, so allocate would pin them out
    of the LRU. An allocate of ``n`` tokens therefore fits iff::

        pages_for(n) - hit_pages <= free + evictable - num_evictable_pages
    """

    num_cached_tokens: int
    num_evictable_pages: int


@dataclass(slots=True)
class PrefixPlan:
    """Result of :meth:`Manager.plan`: what the pool holds of a prompt's prefix chain
    now, for a caller that keeps pages below the pool (kvcore.daemon.tiering)::

        keys   k0 .. k(h-1) | kh .. k(m-1)        m = (num_tokens - 1) // page_size
               hit: indexed   the rest: kh is not   (a hit never covers the last token)

    ``num_hit`` (pages) = h, the leading pages allocate would pin; ``room``
    (pages) = free + evictable pages less the evictable hit pages: what allocate
    or :meth:`Manager.adopt` may take beside the hit; ``num_new`` (pages) = the
    fresh pages allocate of these tokens would take (it fits iff num_new <= room).
    """

    keys: list[PrefixKey]
    num_hit: int
    room: int
    num_new: int


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
    withheld_pages: int = 0  # after a restart, pages nobody committed, out of use until released

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class PagesAllocation:
    """Result of :meth:`Manager.allocate_pages`: ``pages[i]`` holds one-page chain i;
    ``hits[i]``: that page is indexed under chain i's key (its K/V is there: read it,
    never write it), else it is fresh (write it, then :meth:`Manager.commit_pages`).
    ``media``: where each hit was when asked, "pool" or the lower tier that brought it
    up ("host", "disk", "remote"; kvcore.daemon.tiering), "" for a fresh page; empty
    when every hit was in the pool."""

    pages: list[int]
    hits: list[bool]
    media: list[str] = field(default_factory=list)


class PageManager(Protocol):
    """What serves one pool's operations, with :class:`~kvcore.manager.Manager`'s
    signatures and promises: the Manager, or a wrapper that holds one
    (kvcore.daemon.tiering's TieredManager). The operation table (kvcore.ops) and
    the daemon call only these."""

    layout: KVLayout

    @property
    def eviction(self) -> str:
        """The name of the pool's eviction policy (kvcore.eviction): labels its metrics."""
        ...

    @property
    def hits(self) -> HitBook:
        """The pool's hits per namespace and medium, and its busiest prefixes."""
        ...

    def allocate(
        self,
        seq_id: int,
        tokens: Sequence[int],
        space: KeySpace = KeySpace(),
        *,
        compute_last: bool = True,
    ) -> Allocation: ...
    def extend(self, seq_id: int, num_tokens: int) -> Extension: ...
    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int: ...
    def fork(self, parent_id: int, child_id: int) -> list[int]: ...
    def free(self, seq_id: int) -> None: ...
    def lookup(
        self,
        tokens: Sequence[int],
        space: KeySpace = KeySpace(),
        *,
        compute_last: bool = True,
    ) -> PrefixHit: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def num_tokens(self, seq_id: int) -> int: ...
    def __contains__(self, seq_id: object) -> bool: ...
    def stats(self) -> Stats: ...
    def take_events(self) -> list[PageEvent]: ...
    def prefix_snapshot(self) -> list[PageStored]: ...
    def check_integrity(self) -> None: ...
    def allocate_pages(
        self, seq_id: int, tokens: Sequence[int], space: KeySpace = KeySpace()
    ) -> PagesAllocation: ...
    def commit_pages(self, seq_id: int, tokens: Sequence[int]) -> int: ...
    def lookup_pages(self, tokens: Sequence[int], space: KeySpace = KeySpace()) -> list[bool]: ...
