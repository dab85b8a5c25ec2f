"""Page bookkeeping: refcounts, the free queue and the evictable pages' policy.

Every page of a pool is in exactly one of four states::

    state       refcount  indexed (prefix.py)  kept in
    free        0         no                   _free       FIFO queue
    evictable   0         yes                  _evictable  the eviction policy's order
    held        > 0       either               (block tables of live sequences)
    withheld    0         no                   _withheld   (after a restart, until released)

    free + evictable + held + withheld == num_pages       (the conservation law)

:meth:`take` serves free pages first and evicts evictable pages, in the order of
the pool's eviction policy (kvcore.eviction), only when the free queue is empty, and
never while pages are withheld: after a restart a process of the last daemon's time
may still write the pages nobody committed and read the cached ones (its hits), so
until :meth:`release_withheld` no page of either kind is handed to a writer.
Every operation is O(1) per page; nothing scans the pool (``check_integrity``
does, and is for tests).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    from kvcore.eviction import EvictionPolicy

PageId = NewType("PageId", int)


class PageAllocator:
    """Refcounts and the two queues of unreferenced pages of one pool.

    ``refcounts[page]`` is public for reading on hot paths (the Manager's
    copy-on-write test); only this class writes it.
    """

    __slots__ = (
        "_evictable",
        "_free",
        "_withheld",
        "num_held",
        "num_pages",
        "refcounts",
        "withholding",
    )

    def __init__(self, num_pages: int, evictable: EvictionPolicy[PageId]) -> None:
        self.num_pages = num_pages
        self.num_held = 0  # pages with refcount > 0
        self.refcounts = [0] * num_pages
        self._free: deque[PageId] = deque(PageId(p) for p in range(num_pages))
        self._evictable = evictable  # empty; only this class adds to it or takes from it
        self._withheld: list[PageId] = []  # out of use until release_withheld()
        self.withholding = False  # between withhold_free() and release_withheld(): no eviction

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_withheld(self) -> int:
        return len(self._withheld)

    def withhold_free(self) -> int:
        """Take every free page out of use (neither free nor evictable, refcount 0), and
        evict nothing, until :meth:`release_withheld`: after a restart, the pages nobody
        committed, which a process of the last daemon's time may still write, and the
        cached ones, which it may still read as its hits (kvcore.daemon.restart).
        Returns how many pages were withheld."""
        self._withheld.extend(self._free)
        self._free.clear()
        self.withholding = True
        return len(self._withheld)

    def release_withheld(self) -> int:
        """Free every withheld page (after the free ones) and allow evictions again;
        returns how many pages were freed."""
        self.withholding = False
        released, self._withheld = self._withheld, []
        self._free.extend(released)
        return len(released)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages :meth:`take` can hand out now: free + evictable (free only while
        withholding)."""
        return len(self._free) + (0 if self.withholding else len(self._evictable))

    def take(self, num: int, evict: Callable[[PageId], None]) -> list[PageId]:
        """``num`` pages at refcount 1: free pages first (FIFO), then evictions.

        ``evict(page)`` is called for each evicted page, in the policy's order (to
        drop it from the index). The caller has checked
        ``num <= num_available``.
        """
        free, refcounts = self._free, self.refcounts
        if num <= len(free):
            pages = [free.popleft() for _ in range(num)]
        else:
            assert num <= self.num_available, "take() beyond capacity (or evicting while withheld)"
            pages = list(free)
            free.clear()
            for page in self._evictable.evict(num - len(pages)):
                evict(page)
                pages.append(page)
        for page in pages:
            refcounts[page] = 1
        self.num_held += num
        return pages

    def retain(self, pages: Iterable[PageId]) -> None:
        """One more reference each; an evictable page becomes held."""
        refcounts, evictable = self.refcounts, self._evictable
        for page in pages:
            count = refcounts[page]
            if count == 0:
                assert page in evictable, f"retain() of free page {page}"
                evictable.remove(page)
                self.num_held += 1
            refcounts[page] = count + 1

    def release(self, pages: Iterable[PageId], cached: Mapping[PageId, bytes]) -> None:
        """One reference less each, in order (a chain's pages: tail first); a page at
        zero becomes evictable if ``cached`` (the index: page -> prefix key) has it, else
        free. The policy learns whether the pages that became evictable run unbroken
        to the end of ``pages`` (the chain's head)."""
        refcounts, free, key_of = self.refcounts, self._free, cached.get
        released: list[tuple[PageId, bytes]] = []
        whole = True  # no page after the first released one stays held or goes free
        for page in pages:
            count = refcounts[page]
            assert count > 0, f"release() of unreferenced page {page}"
            refcounts[page] = count - 1
            if count == 1:
                self.num_held -= 1
                key = key_of(page)
                if key is not None:
                    released.append((page, key))
                    continue
                free.append(page)
            if released:
                whole = False
        if released:
            self._evictable.add(released, whole)

    def restore(self, cached: Sequence[tuple[PageId, bytes]]) -> None:
        """Make the free pages of ``cached`` (page, prefix key; indexed by the caller)
        evictable, in order: the first is evicted first, the last is the most recent,
        as one release of a chain's pages (tail first) leaves them. For re-adopting a
        pool's cached pages after a restart (Manager.restore). O(free pages)."""
        restored = {page for page, _ in cached}
        assert len(restored) == len(cached), "a page restored twice"
        kept = deque(page for page in self._free if page not in restored)
        assert len(kept) + len(restored) == len(self._free), "restore() of a page not free"
        self._free = kept
        if cached:
            self._evictable.add(cached, False)

    def hit(self, pages: list[PageId]) -> None:
        """Tell the eviction policy that a request was served ``pages`` (indexed)."""
        if pages:
            self._evictable.hit(pages)

    def check_integrity(self, references: Mapping[PageId, int], indexed: Iterable[PageId]) -> None:
        """Assert the conservation law and that refcounts equal ``references``.

        ``references`` counts, per page, the block-table entries naming it;
        ``indexed`` is every page the prefix index holds.
        """
        free, evictable, indexed_set = set(self._free), set(self._evictable), set(indexed)
        withheld = set(self._withheld)
        assert len(free) == len(self._free), "a page is twice in the free queue"
        assert len(withheld) == len(self._withheld), "a page is withheld twice"
        assert not free & evictable, f"pages both free and evictable: {free & evictable}"
        assert not withheld & (free | evictable), "a withheld page is free or evictable"
        held = {p for p in range(self.num_pages) if self.refcounts[p] > 0}
        assert len(held) == self.num_held, f"num_held {self.num_held} != {len(held)}"
        assert len(free) + len(evictable) + len(held) + len(withheld) == self.num_pages, (
            f"free {len(free)} + evictable {len(evictable)} + held {len(held)} "
            f"+ withheld {len(withheld)} != total {self.num_pages}"
        )
        assert not held & (free | evictable | withheld), "a referenced page is not in use"
        assert not (free | withheld) & indexed_set, "free or withheld pages still indexed"
        assert evictable <= indexed_set, f"evictable pages not indexed: {evictable - indexed_set}"
        for page in range(self.num_pages):
            expected = references.get(PageId(page), 0)
            assert self.refcounts[page] == expected, (
                f"page {page}: refcount {self.refcounts[page]} != {expected} block-table entries"
            )
