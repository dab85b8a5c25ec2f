"""The baseline of ``kvcore bench ops``: the least a paged cache with a prefix cache
does for the Manager's calls, so that ``manager_over_minimal`` (kvcore/bench/ops.py)
prices only what the Manager does beyond it.

:class:`MinimalCache` answers the calls the capacity simulator makes
(:class:`~kvcore.bench.simulate.PageCache`) with the Manager's policy and the
Manager's answers, page for page, and nothing else: no namespaces, no validation
of input, no integrity checks, no events, no statistics beyond what the
scheduler reads. ``kvcore bench ops`` drives both in lockstep and stops when
their answers differ, so a change to the Manager's policy must be made here too.
Counts are in pages unless a name says tokens.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.errors import OutOfPages, SequenceExists
from kvcore.layout import KVLayout
from kvcore.results import Allocation, PrefixHit, Stats


@dataclass(slots=True)
class _MinimalSeq:
    """One live sequence of the baseline; MinimalCache's calls change every field."""

    pages: list[int]
    num_tokens: int
    keys: list[int]  # chained hashes of the committed leading pages


class MinimalCache:
    """The least a paged allocator with a chained-hash LRU prefix cache does for
    these calls, with the Manager's policy: free pages first, then the least
    recently released cached page; pages released tail first; a hit never covers
    the last token; copy-on-write of a shared last page; the first commit of a key
    wins. A page's key is Python's ``hash((parent key, page tokens))``: fast and not
    cryptographic, so the ratio also charges the Manager for SHA-256 keys
    (spec/hashing.md)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.free_pages: deque[int] = deque(range(layout.num_pages))
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced pages
        self.refs = [0] * layout.num_pages
        self.page_of: dict[int, int] = {}
        self.key_of: dict[int, int] = {}
        self.seqs: dict[int, _MinimalSeq] = {}

    def _take(self, num: int) -> list[int]:
        pages = []
        for _ in range(num):
            if self.free_pages:
                page = self.free_pages.popleft()
            else:
                page, _ = self.lru.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
            self.refs[page] = 1
            pages.append(page)
        return pages

    def _match(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        size = self.page_size
        keys: list[int] = []
        pages: list[int] = []
        parent = 0
        for i in range((len(tokens) - 1) // size):
            key = hash((parent, tuple(tokens[i * size : (i + 1) * size])))
            page = self.page_of.get(key)
            if page is None:
                break
            keys.append(key)
            pages.append(page)
            parent = key
        return keys, pages

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        _, pages = self._match(tokens)
        return PrefixHit(len(pages) * self.page_size, sum(1 for p in pages if not self.refs[p]))

    def allocate(self, seq_id: int, tokens: Sequence[int]) -> Allocation:
        if seq_id in self.seqs:
            raise SequenceExists(f"sequence {seq_id} is live")
        keys, hit = self._match(tokens)
        need = self.layout.pages_for(len(tokens)) - len(hit)
        pinned = sum(1 for p in hit if not self.refs[p])
        if need > len(self.free_pages) + len(self.lru) - pinned:
            raise OutOfPages(f"need {need} pages")
        for page in hit:
            if not self.refs[page]:
                del self.lru[page]
            self.refs[page] += 1
        pages = hit + self._take(need)
        self.seqs[seq_id] = _MinimalSeq(pages, len(tokens), keys)
        return Allocation(list(pages), len(hit) * self.page_size)

    def extend(self, seq_id: int, num_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
        seq = self.seqs[seq_id]
        total = seq.num_tokens + num_tokens
        need = self.layout.pages_for(total) - len(seq.pages)
        cow = num_tokens > 0 and seq.num_tokens % self.page_size and self.refs[seq.pages[-1]] > 1
        if need + bool(cow) > len(self.free_pages) + len(self.lru):
            raise OutOfPages(f"need {need + bool(cow)} pages")
        new = self._take(need + bool(cow)) if need or cow else []
        copies = []
        if cow:
            src, dst = seq.pages[-1], new.pop()
            self.refs[src] -= 1  # still held by another sequence
            seq.pages[-1] = dst
            copies.append((src, dst))
        seq.pages += new
        seq.num_tokens = total
        return new, copies

    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = 0) -> int:
        seq, size = self.seqs[seq_id], self.page_size
        first, end = len(seq.keys), (start + len(tokens)) // size
        if end > first:
            parent = seq.keys[-1] if seq.keys else 0
            offsets = range(first * size - start, end * size - start, size)  # into tokens
            for at, page in zip(offsets, seq.pages[first:end], strict=True):
                key = hash((parent, tuple(tokens[at : at + size])))
                if key not in self.page_of and page not in self.key_of:
                    self.page_of[key] = page
                    self.key_of[page] = key
                seq.keys.append(key)
                parent = key
        return len(seq.keys)

    def free(self, seq_id: int) -> None:
        for page in reversed(self.seqs.pop(seq_id).pages):
            self.refs[page] -= 1
            if not self.refs[page]:
                if page in self.key_of:
                    self.lru[page] = None
                else:
                    self.free_pages.append(page)

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        parent = self.seqs[parent_id]
        for page in parent.pages:
            self.refs[page] += 1
        self.seqs[child_id] = _MinimalSeq(list(parent.pages), parent.num_tokens, list(parent.keys))
        return list(parent.pages)

    def stats(self) -> Stats:
        free, lru = len(self.free_pages), len(self.lru)
        total = self.layout.num_pages
        return Stats(
            total, free, lru, total - free - lru, len(self.page_of), len(self.seqs), 0, 0, 0
        )
