"""Conformance of anything with the Manager API, as a hypothesis state machine.

:func:`make_state_machine` drives a subject (the in-process :class:`~kvcore.Manager`,
or a :class:`~kvcore.Client` talking to a daemon) against :class:`Model`, a
small reference written for obviousness rather than speed: prefixes are keyed
by their token tuples (no hashing), pages are tracked by the ids the subject
hands out, and the eviction policy is replayed as a plain list.

After every step it checks, through the subject's public API:

* ``free + evictable + held == total`` and each count equals the model's;
* no page is both free and referenced, refcounts equal block-table references
  (the subject's own ``check_integrity()``, when it has one);
* every block table equals the model's and has ``ceil(num_tokens / page_size)`` pages;
* the set of pages an allocation takes is exactly the free pages plus the
  least recently released evictable pages, when the free ones do not suffice;
* ``lookup`` and allocation hits agree with the model; failed calls change nothing.

Usage (a fresh subject with an empty pool per example)::

    TestManager = make_state_machine(lambda layout: Manager(layout)).TestCase
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcore.errors import BadRequest, KVCoreError, OutOfPages, SequenceExists, UnknownSequence
from kvcore.layout import KVLayout
from kvcore.manager import Allocation, Extension, Stats


class ManagerAPI(Protocol):
    """What the state machine drives: the Manager's public operations."""

    def allocate(
        self, seq_id: int, tokens: Sequence[int], *, namespace: str = ...
    ) -> Allocation: ...
    def extend(self, seq_id: int, num_tokens: int) -> Extension: ...
    def commit(self, seq_id: int, tokens: Sequence[int]) -> int: ...
    def fork(self, parent_id: int, child_id: int) -> list[int]: ...
    def free(self, seq_id: int) -> None: ...
    def lookup(self, tokens: Sequence[int], *, namespace: str = ...) -> int: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def num_tokens(self, seq_id: int) -> int: ...
    def stats(self) -> Stats: ...


Factory = Callable[[KVLayout], Any]
PrefixId = tuple[str, tuple[int, ...]]  # (namespace, tokens from 0 to the end of a full page)


@dataclass
class ModelSeq:
    namespace: str
    tokens: list[int]
    pages: list[int]
    committed: int = 0  # leading pages already offered to the index


@dataclass
class Model:
    """Reference semantics of ARCHITECTURE.md's state machine, in the plainest terms."""

    page_size: int
    num_pages: int
    seqs: dict[int, ModelSeq] = field(default_factory=dict)
    index: dict[PrefixId, int] = field(default_factory=dict)  # first committer wins
    lru: list[int] = field(default_factory=list)  # evictable pages, least recent first

    def refcounts(self) -> Counter[int]:
        return Counter(page for seq in self.seqs.values() for page in seq.pages)

    def free_pages(self) -> set[int]:
        return set(range(self.num_pages)) - set(self.refcounts()) - set(self.lru)

    def indexed_pages(self) -> set[int]:
        return set(self.index.values())

    def prefix_id(self, namespace: str, tokens: Sequence[int], num_pages: int) -> PrefixId:
        return (namespace, tuple(tokens[: num_pages * self.page_size]))

    def hit_pages(self, namespace: str, tokens: Sequence[int]) -> list[int]:
        pages: list[int] = []
        for i in range(max(len(tokens) - 1, 0) // self.page_size):
            page = self.index.get(self.prefix_id(namespace, tokens, i + 1))
            if page is None:
                break
            pages.append(page)
        return pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def fits(self, num_pages: int, pinned: Sequence[int] = ()) -> bool:
        pinned_evictable = sum(1 for page in pinned if page in self.lru)
        return num_pages <= len(self.free_pages()) + len(self.lru) - pinned_evictable

    def take(self, got: Sequence[int]) -> None:
        """Check that the subject took exactly what the policy allows; apply evictions."""
        free = self.free_pages()
        assert len(set(got)) == len(got), f"a page handed out twice: {got}"
        if len(got) <= len(free):
            assert set(got) <= free, f"took {got}, but free pages were {sorted(free)}"
            return
        evicted = self.lru[: len(got) - len(free)]
        assert set(got) == free | set(evicted), (
            f"took {sorted(got)}; policy says free {sorted(free)} + LRU head {evicted}"
        )
        self.lru = self.lru[len(evicted) :]
        self.index = {k: p for k, p in self.index.items() if p not in evicted}

    def release(self, pages: Sequence[int]) -> None:
        counts = self.refcounts()
        indexed = self.indexed_pages()
        for page in reversed(pages):
            counts[page] -= 1
            if counts[page] == 0 and page in indexed:
                self.lru.append(page)


SEQ_IDS = st.integers(min_value=0, max_value=3)
NAMESPACES = st.sampled_from(["default", "tenant-b"])
# A tiny vocabulary makes shared prefixes (and so hits) common.
TOKENS = st.lists(st.integers(min_value=0, max_value=2), max_size=14)


def make_state_machine(factory: Factory) -> type[RuleBasedStateMachine]:
    """A state machine class holding the subject ``factory(layout)`` to the model."""

    class ManagerConformance(RuleBasedStateMachine):
        subject: Any
        model: Model

        @initialize(page_size=st.integers(1, 4), num_pages=st.integers(1, 8))
        def start(self, page_size: int, num_pages: int) -> None:
            layout = KVLayout(
                num_layers=1, num_kv_heads=1, head_dim=8, page_size=page_size,
                dtype="float16", num_pages=num_pages,
            )  # fmt: skip
            self.subject = factory(layout)
            self.model = Model(page_size, num_pages)

        def teardown(self) -> None:
            close = getattr(getattr(self, "subject", None), "close", None)
            if close is not None:
                close()

        def expect_error(self, error: type[KVCoreError], call: Callable[[], object]) -> None:
            try:
                call()
            except error:
                return
            raise AssertionError(f"expected {error.__name__}")

        # -- operations ------------------------------------------------------------

        @rule(seq_id=SEQ_IDS, tokens=TOKENS, namespace=NAMESPACES)
        def allocate(self, seq_id: int, tokens: list[int], namespace: str) -> None:
            m = self.model
            call = partial(self.subject.allocate, seq_id, tokens, namespace=namespace)
            if seq_id in m.seqs:
                return self.expect_error(SequenceExists, call)
            hits = m.hit_pages(namespace, tokens)
            num_new = m.pages_for(len(tokens)) - len(hits)
            if not m.fits(num_new, hits):
                return self.expect_error(OutOfPages, call)
            result = call()
            assert result.num_cached_tokens == len(hits) * m.page_size, (
                f"hit {result.num_cached_tokens} tokens, model says {len(hits) * m.page_size}"
            )
            assert result.pages[: len(hits)] == hits, f"hit pages {result.pages} != {hits}"
            # The hit pages are pinned (held, off the LRU) before the new pages are taken.
            m.lru = [page for page in m.lru if page not in hits]
            m.seqs[seq_id] = ModelSeq(namespace, list(tokens), list(hits), len(hits))
            m.take(result.pages[len(hits) :])
            m.seqs[seq_id].pages = list(result.pages)

        @rule(seq_id=SEQ_IDS, new_tokens=TOKENS)
        def extend(self, seq_id: int, new_tokens: list[int]) -> None:
            m = self.model
            call = partial(self.subject.extend, seq_id, len(new_tokens))
            seq = m.seqs.get(seq_id)
            if seq is None:
                return self.expect_error(UnknownSequence, call)
            total = len(seq.tokens) + len(new_tokens)
            num_new = m.pages_for(total) - len(seq.pages)
            cow = (
                bool(new_tokens)
                and len(seq.tokens) % m.page_size != 0
                and m.refcounts()[seq.pages[-1]] > 1
            )
            if not m.fits(num_new + cow):
                return self.expect_error(OutOfPages, call)
            result = call()
            assert len(result.new_pages) == num_new, f"{result.new_pages} for {num_new} new pages"
            assert len(result.copies) == cow, f"copies {result.copies}, copy-on-write {cow}"
            taken = list(result.new_pages)
            if cow:
                src, dst = result.copies[0]
                assert src == seq.pages[-1], f"copied from {src}, last page is {seq.pages[-1]}"
                taken.append(dst)
            m.take(taken)
            if cow:
                seq.pages[-1] = result.copies[0][1]
            seq.pages.extend(result.new_pages)
            seq.tokens.extend(new_tokens)

        @rule(seq_id=SEQ_IDS, cut=st.integers(0, 20))
        def commit(self, seq_id: int, cut: int) -> None:
            m = self.model
            seq = m.seqs.get(seq_id)
            if seq is None:
                return self.expect_error(UnknownSequence, partial(self.subject.commit, seq_id, []))
            tokens = seq.tokens[: min(cut, len(seq.tokens))]
            published = self.subject.commit(seq_id, tokens)
            indexed = m.indexed_pages()
            for i in range(seq.committed, len(tokens) // m.page_size):
                key = m.prefix_id(seq.namespace, tokens, i + 1)
                if key not in m.index and seq.pages[i] not in indexed:
                    m.index[key] = seq.pages[i]
                    indexed.add(seq.pages[i])
            seq.committed = max(seq.committed, len(tokens) // m.page_size)
            assert published == seq.committed, f"commit says {published}, model {seq.committed}"

        @rule(seq_id=SEQ_IDS)
        def commit_too_many(self, seq_id: int) -> None:
            seq = self.model.seqs.get(seq_id)
            if seq is not None:
                tokens = [*seq.tokens, 0]
                self.expect_error(BadRequest, partial(self.subject.commit, seq_id, tokens))

        @rule(parent_id=SEQ_IDS, child_id=SEQ_IDS)
        def fork(self, parent_id: int, child_id: int) -> None:
            m = self.model
            call = partial(self.subject.fork, parent_id, child_id)
            parent = m.seqs.get(parent_id)
            if parent is None:
                return self.expect_error(UnknownSequence, call)
            if child_id in m.seqs:
                return self.expect_error(SequenceExists, call)
            assert call() == parent.pages
            m.seqs[child_id] = ModelSeq(
                parent.namespace, list(parent.tokens), list(parent.pages), parent.committed
            )

        @rule(seq_id=SEQ_IDS)
        def free(self, seq_id: int) -> None:
            m = self.model
            seq = m.seqs.get(seq_id)
            if seq is None:
                return self.expect_error(UnknownSequence, partial(self.subject.free, seq_id))
            self.subject.free(seq_id)
            m.release(seq.pages)
            del m.seqs[seq_id]

        @rule(seq_id=SEQ_IDS)
        def finish(self, seq_id: int) -> None:
            """What an engine does when a request ends: publish every full page, then free."""
            if seq_id in self.model.seqs:
                self.commit(seq_id, len(self.model.seqs[seq_id].tokens))
            self.free(seq_id)

        @rule(tokens=TOKENS, namespace=NAMESPACES)
        def lookup(self, tokens: list[int], namespace: str) -> None:
            expected = len(self.model.hit_pages(namespace, tokens)) * self.model.page_size
            got = self.subject.lookup(tokens, namespace=namespace)
            assert got == expected, f"lookup {got} tokens, model says {expected}"

        @precondition(lambda self: bool(self.model.seqs))
        @rule(data=st.data())
        def lookup_live_prompt(self, data: st.DataObject) -> None:
            """Look up a live sequence's own tokens: the hits the model expects most."""
            seq_id = data.draw(st.sampled_from(sorted(self.model.seqs)))
            seq = self.model.seqs[seq_id]
            self.lookup(seq.tokens, seq.namespace)

        @rule(seq_id=SEQ_IDS, bad=st.sampled_from(["token", "extend", "namespace"]))
        def bad_input(self, seq_id: int, bad: str) -> None:
            if bad == "token":
                call = partial(self.subject.allocate, 100 + seq_id, [1, -1])
            elif bad == "extend":
                if seq_id not in self.model.seqs:
                    return
                call = partial(self.subject.extend, seq_id, -1)
            else:
                call = partial(self.subject.lookup, [1], namespace="x" * 1000)
            self.expect_error(BadRequest, call)

        # -- invariants ------------------------------------------------------------

        @invariant()
        def agrees_with_model(self) -> None:
            if not hasattr(self, "model"):
                return
            m = self.model
            check = getattr(self.subject, "check_integrity", None)
            if check is not None:
                check()
            stats = self.subject.stats()
            held = set(m.refcounts())
            assert stats.total_pages == m.num_pages
            assert stats.free_pages + stats.evictable_pages + stats.held_pages == m.num_pages, stats
            assert stats.held_pages == len(held), f"{stats} but {len(held)} pages referenced"
            assert stats.evictable_pages == len(m.lru), f"{stats} but model LRU {m.lru}"
            assert stats.free_pages == len(m.free_pages()), stats
            assert stats.cached_pages == len(m.index), f"{stats} but model index {len(m.index)}"
            assert stats.num_sequences == len(m.seqs)
            for seq_id, seq in m.seqs.items():
                table = self.subject.block_table(seq_id)
                assert table == seq.pages, f"seq {seq_id}: table {table} != model {seq.pages}"
                assert len(table) == m.pages_for(len(seq.tokens))
                assert self.subject.num_tokens(seq_id) == len(seq.tokens)

    return ManagerConformance
