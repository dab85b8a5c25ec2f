"""The reference model the Manager conformance machine (:mod:`kvcore.testing.manager`)
holds a subject to: docs/architecture.md's state machine in the plainest terms,
written for obviousness rather than speed.

* Prefixes are keyed by their token tuples, ``(key space, tokens from 0 to the
  end of a full page)``, a key space being a resolved :class:`KeySpace`: prefixes of
  different key spaces are different prefixes, so they never share a page; they are
  hashed (spec/hashing.md) only to name them in
  events and snapshots (:meth:`Model.key`, :meth:`Model.event`).
* Pages are the ids the subject hands out; the model never picks one, it checks
  that the subject's pick is one the policy allows (:meth:`Model.take`).
* The eviction policy is the plain model of the subject's policy
  (kvcore/testing/eviction_model.py, :attr:`Model.policy`); a page is free iff no
  sequence references it and the policy does not hold it. Every eviction is
  checked to take no head before a tail it released with (:meth:`Model.take`).
* Every index change is appended to :attr:`Model.events` in order; the machine
  drains the list after each step and compares it with the subject's events.

Counts are in pages unless a name says tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcore.allocator import PageId
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.prefix import (
    KeySpace,
    PageEvent,
    PageRemoved,
    PageStored,
    PrefixKey,
    encode_tokens,
    page_key,
    root_key,
)
from kvcore.testing.eviction_model import MODELS, PolicyModel

Space = KeySpace  # with its namespace resolved: a key space (spec/hashing.md)
PrefixId = tuple[Space, tuple[int, ...]]  # (key space, tokens from 0 to the end of a full page)
ModelEvent = tuple[bool, PrefixId, int]  # (stored? else removed, prefix, page)


@dataclass(slots=True)
class ModelSeq:
    """One live sequence as the model sees it; the machine's rules change every field."""

    space: Space  # fixed at allocate; a fork's child inherits it
    tokens: list[int]
    pages: list[int]
    committed: int = 0  # leading pages already offered to the index


@dataclass(slots=True)
class Model:
    """Reference semantics of docs/architecture.md's state machine, in the plainest terms."""

    page_size: int
    num_pages: int
    eviction: str = DEFAULT_EVICTION  # the subject's policy: kvcore.eviction's name
    seqs: dict[int, ModelSeq] = field(default_factory=dict)
    index: dict[PrefixId, int] = field(default_factory=dict)  # first committer wins
    events: list[ModelEvent] = field(default_factory=list)  # index changes not yet checked
    policy: PolicyModel[int] = field(init=False)  # the evictable pages, in the policy's order
    released_at: dict[int, int] = field(default_factory=dict)  # page -> its last release
    releases: int = 0  # releases so far (the clock of released_at)

    def __post_init__(self) -> None:
        self.policy = MODELS[self.eviction](self.num_pages)

    def refcounts(self) -> Counter[int]:
        return Counter(page for seq in self.seqs.values() for page in seq.pages)

    def free_pages(self) -> set[int]:
        return set(range(self.num_pages)) - set(self.refcounts()) - set(self.policy.evictable())

    def indexed_pages(self) -> set[int]:
        return set(self.index.values())

    def prefix_id(self, space: Space, tokens: Sequence[int], num_pages: int) -> PrefixId:
        return (space, tuple(tokens[: num_pages * self.page_size]))

    def hit_pages(
        self, space: Space, tokens: Sequence[int], compute_last: bool = True
    ) -> list[int]:
        """The indexed pages a hit of ``tokens`` covers: never the last token when the
        caller computes it (``compute_last``), else every full page may hit."""
        pages: list[int] = []
        for i in range(max(len(tokens) - compute_last, 0) // self.page_size):
            page = self.index.get(self.prefix_id(space, tokens, i + 1))
            if page is None:
                break
            pages.append(page)
        return pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def fits(self, num_pages: int, pinned: Sequence[int] = ()) -> bool:
        evictable = self.policy.evictable()
        pinned_evictable = sum(1 for page in pinned if page in evictable)
        return num_pages <= len(self.free_pages()) + len(evictable) - pinned_evictable

    def take(self, got: Sequence[int]) -> None:
        """Check that the subject took exactly what the policy allows; apply evictions,
        each checked to leave no tail it released with (or before) cached and evictable."""
        free = self.free_pages()
        assert len(set(got)) == len(got), f"a page handed out twice: {got}"
        if len(got) <= len(free):
            assert set(got) <= free, f"took {got}, but free pages were {sorted(free)}"
            return
        evicted = [self.policy.evict() for _ in range(len(got) - len(free))]
        assert set(got) == free | set(evicted), (
            f"took {sorted(got)}; the {self.eviction} policy says free {sorted(free)} "
            f"+ evicted {evicted}"
        )
        prefix_of = {p: k for k, p in self.index.items()}
        for page in evicted:  # in the policy's order, as they are taken
            self.check_tails_first(prefix_of[page], page)
            self.events.append((False, prefix_of[page], page))
            del self.index[prefix_of[page]]

    def check_tails_first(self, prefix: PrefixId, page: int) -> None:
        """A page is evicted only after every evictable child page (its prefix and one
        page more) released with it or before it: a chain's tail goes before its head."""
        space, tokens = prefix
        evictable = set(self.policy.evictable())
        for (child_space, child_tokens), child in self.index.items():
            if (
                child_space == space
                and len(child_tokens) == len(tokens) + self.page_size
                and child_tokens[: len(tokens)] == tokens
                and child in evictable
            ):
                assert self.released_at[child] > self.released_at[page], (
                    f"evicted head page {page} before its tail {child}, released no later"
                )

    def publish(self, seq: ModelSeq, start: int, tokens: Sequence[int]) -> None:
        """Index the full pages of ``tokens`` (the sequence's from ``start``) not yet
        offered; a prefix or page already indexed stays as it is (first commit wins)."""
        indexed = self.indexed_pages()
        upto = seq.tokens[: start + len(tokens)]
        for i in range(seq.committed, len(upto) // self.page_size):
            prefix = self.prefix_id(seq.space, upto, i + 1)
            if prefix not in self.index and seq.pages[i] not in indexed:
                self.index[prefix] = seq.pages[i]
                indexed.add(seq.pages[i])
                self.events.append((True, prefix, seq.pages[i]))
        seq.committed = max(seq.committed, len(upto) // self.page_size)

    def key(self, prefix: PrefixId) -> PrefixKey:
        """The prefix key of spec/hashing.md for a prefix (the root for no tokens)."""
        space, tokens = prefix
        key = root_key(space)
        for i in range(len(tokens) // self.page_size):
            page = tokens[i * self.page_size : (i + 1) * self.page_size]
            key = page_key(key, encode_tokens(page))
        return key

    def event(self, event: ModelEvent) -> PageEvent:
        stored, (space, tokens), page = event
        if stored:
            parent = (space, tokens[: len(tokens) - self.page_size])
            page_tokens = b"".join(t.to_bytes(4, "little") for t in tokens[-self.page_size :])
            return PageStored(
                self.key((space, tokens)),
                self.key(parent),
                PageId(page),
                page_tokens,
                space,
            )
        return PageRemoved(self.key((space, tokens)), PageId(page))

    def release(self, pages: Sequence[int]) -> None:
        """One reference less on each of ``pages`` (a block table: released tail first)."""
        counts = self.refcounts()
        for page in pages:
            counts[page] -= 1
        self.release_pages(list(reversed(pages)), counts)

    def release_pages(self, order: Sequence[int], counts: Counter[int]) -> None:
        """Pages of ``order`` (tail first) at zero ``counts`` become evictable if indexed,
        in one release, as the allocator tells the policy: ``whole`` unless a page after
        the first released one stays held or goes free."""
        prefix_of = {page: prefix for prefix, page in self.index.items()}
        released: list[tuple[int, PrefixId]] = []
        whole = True
        for page in order:
            if counts[page] == 0 and page in prefix_of:
                released.append((page, prefix_of[page]))
            elif released:
                whole = False
        self.releases += 1
        for page, _ in released:
            self.released_at[page] = self.releases
        if released:
            self.policy.release(released, whole)
