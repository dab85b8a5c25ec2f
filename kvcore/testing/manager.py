"""Conformance of anything with the Manager API, as a hypothesis state machine.

:class:`ManagerConformance` drives a subject (the in-process :class:`~kvcore.Manager`,
or a :class:`~kvcore.Client` talking to a daemon) against
:class:`~kvcore.testing.manager_model.Model`, a small reference written for
obviousness rather than speed (kvcore/testing/manager_model.py).

After every step it checks, through the subject's public API:

* ``free + evictable + held == total`` and each count equals the model's;
* no page is both free and referenced, refcounts equal block-table references
  (the subject's own ``check_integrity()``, when it has one);
* every block table equals the model's and has ``ceil(num_tokens / page_size)`` pages;
* the set of pages an allocation takes is exactly the free pages plus the
  least recently released evictable pages, when the free ones do not suffice;
* ``lookup`` and allocation hits agree with the model, and so does the number of
  a hit's pages that are evictable (``PrefixHit.num_evictable_pages``); calls name
  a key space (namespace, model, LoRA adapter, cache salt), so a different model, salt or
  adapter never hits and an equal one does;
* ``commit`` with a ``start`` offset publishes what the model does, and a bad
  ``start`` is a BadRequest; failed calls change nothing;
* when the subject has ``take_events`` (the in-process Manager), the events of
  each step are exactly the model's index changes in order: PageStored when the
  model indexes a page, PageRemoved when it evicts one; failed calls queue none;
* when it has ``adopt`` (the in-process Manager), pages adopted after a prompt's
  hits are the model's fresh pages, indexed as committed and left evictable; when
  it records evictions, ``take_evicted`` lists the step's removed pages in order;
* when it has ``prefix_snapshot``, the snapshot is the model's index, each
  parent before its children.

``check_integrity``, ``take_events`` and ``prefix_snapshot`` are optional, so
:class:`ManagerAPI` lists only what every subject has: a :class:`~kvcore.Client`
has no ``take_events`` (the daemon takes and publishes the events), and its
``check_integrity`` runs the daemon's ``check`` operation (every pool and session).

Usage (a fresh subject with an empty pool per example): subclass and say how
the subject is built, or hand :func:`make_state_machine` a function that builds it::

    class ManagerMachine(ManagerConformance):
        def make_subject(self, layout: KVLayout) -> Manager:
            return Manager(layout)

    TestManager = ManagerMachine.TestCase
    TestManager = make_state_machine(lambda layout: Manager(layout)).TestCase  # the same

The file runs past ~400 lines on purpose: it is one state machine, one rule per
Manager operation (valid and invalid calls) and one invariant per check above,
each read as its statement next to the model's answer; splitting it would split
the machine's rules from its invariants. The reference it compares with lives in
kvcore/testing/manager_model.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcore.errors import BadRequest, KVCoreError, OutOfPages, SequenceExists, UnknownSequence
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.layout import KVLayout
from kvcore.manager import Allocation, Extension, PrefixHit, Stats
from kvcore.prefix import KeySpace, PageRemoved, PageStored, PrefixKey
from kvcore.testing.manager_model import Model, ModelEvent, ModelSeq, PrefixId, Space

__all__ = [
    "NAMESPACES",
    "SEQ_IDS",
    "SPACES",
    "TOKENS",
    "Factory",
    "ManagerAPI",
    "ManagerConformance",
    "Model",
    "ModelEvent",
    "ModelSeq",
    "PrefixId",
    "Space",
    "make_state_machine",
]


class ManagerAPI(Protocol):
    """What the state machine drives: the Manager's public operations."""

    def allocate(
        self,
        seq_id: int,
        tokens: Sequence[int],
        space: KeySpace = ...,
        *,
        compute_last: bool = ...,
    ) -> Allocation: ...
    def extend(self, seq_id: int, num_tokens: int) -> Extension: ...
    def commit(self, seq_id: int, tokens: Sequence[int], *, start: int = ...) -> int: ...
    def fork(self, parent_id: int, child_id: int) -> list[int]: ...
    def free(self, seq_id: int) -> None: ...
    def lookup(
        self,
        tokens: Sequence[int],
        space: KeySpace = ...,
        *,
        compute_last: bool = ...,
    ) -> PrefixHit: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def num_tokens(self, seq_id: int) -> int: ...
    def stats(self) -> Stats: ...


Factory = Callable[[KVLayout], Any]
SEQ_IDS = st.integers(min_value=0, max_value=3)
# Mostly engines (a hit leaves the last token); sometimes a store (a hit may cover it).
COMPUTE_LAST = st.sampled_from([True, True, True, False])
NAMESPACES = st.sampled_from(["default", "tenant-b"])
# Key spaces: a model, a salt, an adapter, two models with one adapter, and one salt in
# another namespace, beside the plain namespaces; so equal tokens meet under other
# identities.
SPACES = st.sampled_from(
    [
        KeySpace("default"),
        KeySpace("tenant-b"),
        KeySpace("default", model="model-a"),
        KeySpace("default", model="model-b"),
        KeySpace("default", salt="salt-1"),
        KeySpace("default", lora="adapter-a"),
        KeySpace("default", model="model-a", lora="adapter-a"),
        KeySpace("default", model="model-b", lora="adapter-a", salt="salt-1"),
        KeySpace("tenant-b", salt="salt-1"),
    ]
)
# A tiny vocabulary makes shared prefixes (and so hits) common.
TOKENS = st.lists(st.integers(min_value=0, max_value=2), max_size=14)


class ManagerConformance(RuleBasedStateMachine):
    """The module docstring's rules and invariants, for the subject :meth:`make_subject`
    builds: a fresh one per example (closed at teardown when it has ``close``)."""

    subject: Any  # the system under test; set by start, never replaced
    model: Model  # the reference; the rules change it in step with the subject

    def make_subject(self, layout: KVLayout) -> Any:
        """A fresh system under test with an empty pool of ``layout``."""
        raise NotImplementedError(f"{type(self).__name__} must override make_subject")

    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(1, 8))
    def start(self, page_size: int, num_pages: int) -> None:
        # one layer, one kv head of 8 elements: the books do not depend on the geometry
        self.subject = self.make_subject(KVLayout(1, 1, 8, page_size, "float16", num_pages))
        eviction = getattr(self.subject, "eviction", DEFAULT_EVICTION)  # a Client: the default
        self.model = Model(page_size, num_pages, eviction)

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

    @rule(seq_id=SEQ_IDS, tokens=TOKENS, space=SPACES, compute_last=COMPUTE_LAST)
    def allocate(
        self, seq_id: int, tokens: list[int], space: Space, compute_last: bool = True
    ) -> None:
        m = self.model
        args = _space_args(space, compute_last)
        call = partial(self.subject.allocate, seq_id, tokens, **args)
        if seq_id in m.seqs:
            return self.expect_error(SequenceExists, call)
        hits = m.hit_pages(space, tokens, compute_last)
        num_new = m.pages_for(len(tokens)) - len(hits)
        if not m.fits(num_new, hits):
            return self.expect_error(OutOfPages, call)
        result = call()
        assert result.num_cached_tokens == len(hits) * m.page_size, (
            f"hit {result.num_cached_tokens} tokens, model says {len(hits) * m.page_size}"
        )
        assert result.pages[: len(hits)] == hits, f"hit pages {result.pages} != {hits}"
        # The hit pages are pinned (held, off the policy) before the new pages are taken.
        m.policy.pin(hits)
        m.policy.hit(hits)
        m.seqs[seq_id] = ModelSeq(space, list(tokens), list(hits), len(hits))
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
        """commit as old clients call it: the tokens from the first one, no start."""
        m = self.model
        seq = m.seqs.get(seq_id)
        if seq is None:
            return self.expect_error(UnknownSequence, partial(self.subject.commit, seq_id, []))
        tokens = seq.tokens[: min(cut, len(seq.tokens))]
        published = self.subject.commit(seq_id, tokens)
        m.publish(seq, 0, tokens)
        assert published == seq.committed, f"commit says {published}, model {seq.committed}"

    @precondition(lambda self: bool(self.model.seqs))
    @rule(data=st.data(), cut=st.integers(0, 20))
    def commit_from(self, data: st.DataObject, cut: int) -> None:
        """commit of only the tokens from a page boundary at or before the first
        page not yet committed (what a client that remembers its commits sends)."""
        m = self.model
        seq_id = data.draw(st.sampled_from(sorted(m.seqs)), label="seq_id")
        seq = m.seqs[seq_id]
        start = data.draw(st.integers(0, seq.committed), label="start_pages") * m.page_size
        tokens = seq.tokens[start : max(start, min(cut, len(seq.tokens)))]
        published = self.subject.commit(seq_id, tokens, start=start)
        m.publish(seq, start, tokens)
        assert published == seq.committed, f"commit says {published}, model {seq.committed}"

    @rule(seq_id=SEQ_IDS, bad=st.sampled_from(["unaligned", "beyond", "negative", "long"]))
    def commit_bad_start(self, seq_id: int, bad: str) -> None:
        """A start that is not a page boundary, lies past the committed pages, is
        negative, or makes the tokens run past the sequence: BadRequest."""
        m = self.model
        seq = m.seqs.get(seq_id)
        if seq is None:
            return
        committed = seq.committed * m.page_size
        if bad == "unaligned":
            if m.page_size == 1:
                return
            start = committed - m.page_size + 1 if committed else 1
        else:
            start = {
                "beyond": committed + m.page_size,
                "negative": -m.page_size,
                "long": committed,
            }[bad]
        tokens = [*seq.tokens[max(start, 0) :], 0] if bad == "long" else []
        self.expect_error(BadRequest, partial(self.subject.commit, seq_id, tokens, start=start))

    @precondition(lambda self: any(s.committed for s in self.model.seqs.values()))
    @rule(data=st.data())
    def commit_forged(self, data: st.DataObject) -> None:
        """A commit that re-sends a committed (or prefix-hit) page with other tokens:
        BadRequest, nothing changes."""
        m = self.model
        seq_id = data.draw(st.sampled_from(sorted(i for i, s in m.seqs.items() if s.committed)))
        seq = m.seqs[seq_id]
        page = data.draw(st.integers(0, seq.committed - 1), label="forged_page")
        tokens = list(seq.tokens[: seq.committed * m.page_size])
        tokens[page * m.page_size] += 1  # tokens are < 3: still a valid token id
        self.expect_error(BadRequest, partial(self.subject.commit, seq_id, tokens))

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
            parent.space, list(parent.tokens), list(parent.pages), parent.committed
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

    @rule(tokens=TOKENS, space=SPACES, compute_last=COMPUTE_LAST)
    def lookup(self, tokens: list[int], space: Space, compute_last: bool = True) -> None:
        m = self.model
        hits = m.hit_pages(space, tokens, compute_last)
        got = self.subject.lookup(tokens, **_space_args(space, compute_last))
        evictable = m.policy.evictable()
        expected = PrefixHit(len(hits) * m.page_size, sum(1 for p in hits if p in evictable))
        assert got == expected, f"lookup {got}, model says {expected}"

    @precondition(lambda self: bool(self.model.seqs))
    @rule(data=st.data(), space=SPACES)
    def lookup_live_prompt_elsewhere(self, data: st.DataObject, space: Space) -> None:
        """Look up a live sequence's own tokens in a key space drawn anew: a hit only
        where the model indexed them in that space (equal identity shares, other not)."""
        seq_id = data.draw(st.sampled_from(sorted(self.model.seqs)))
        self.lookup(self.model.seqs[seq_id].tokens, space)

    @precondition(lambda self: bool(self.model.seqs))
    @rule(data=st.data())
    def lookup_live_prompt(self, data: st.DataObject) -> None:
        """Look up a live sequence's own tokens: the hits the model expects most."""
        seq_id = data.draw(st.sampled_from(sorted(self.model.seqs)))
        seq = self.model.seqs[seq_id]
        self.lookup(seq.tokens, seq.space)

    @rule(tokens=TOKENS, space=SPACES, num_pages=st.integers(0, 4))
    def adopt(self, tokens: list[int], space: Space, num_pages: int) -> None:
        """Pages found below the pool (a lower tier) indexed after the pool's hits,
        as if committed, and left evictable (subjects with ``adopt`` only)."""
        m = self.model
        adopt = getattr(self.subject, "adopt", None)
        if adopt is None:
            return
        call = partial(adopt, tokens, num_pages, **_space_args(space))
        hits = m.hit_pages(space, tokens)
        if len(hits) + num_pages > max(len(tokens) - 1, 0) // m.page_size:
            return self.expect_error(BadRequest, call)
        prefixes = []  # the run stops before a prefix already indexed
        for i in range(len(hits), len(hits) + num_pages):
            prefix = m.prefix_id(space, tokens, i + 1)
            if prefix in m.index:
                break
            prefixes.append(prefix)
        if prefixes and not m.fits(len(prefixes), hits):
            return self.expect_error(OutOfPages, call)
        got = call()
        assert len(got) == len(prefixes), f"adopted {got}, model says {len(prefixes)} pages"
        if not got:
            return
        m.policy.pin(hits)
        m.seqs[-1] = ModelSeq(space, [], list(hits))  # the hits, pinned while it takes
        m.take(got)
        del m.seqs[-1]
        for prefix, page in zip(prefixes, got, strict=True):
            m.index[prefix] = page
            m.events.append((True, prefix, page))
        m.release_pages(list(reversed(hits + got)), m.refcounts())

    @rule(
        seq_id=SEQ_IDS,
        bad=st.sampled_from(["token", "extend", "namespace", "salt", "lora", "model"]),
    )
    def bad_input(self, seq_id: int, bad: str) -> None:
        if bad == "token":
            call = partial(self.subject.allocate, 100 + seq_id, [1, -1])
        elif bad == "extend":
            if seq_id not in self.model.seqs:
                return
            call = partial(self.subject.extend, seq_id, -1)
        elif bad == "namespace":
            call = partial(self.subject.lookup, [1], KeySpace("x" * 1000))
        elif bad == "salt":  # 86 characters, 258 bytes of UTF-8: over the 256-byte bound
            call = partial(self.subject.allocate, 100 + seq_id, [1], KeySpace(salt="\u20ac" * 86))
        elif bad == "model":
            call = partial(self.subject.allocate, 100 + seq_id, [1], KeySpace(model="m" * 257))
        else:
            call = partial(self.subject.lookup, [1], KeySpace(lora="x" * 257))
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
        evictable = m.policy.evictable()
        assert stats.evictable_pages == len(evictable), f"{stats} but model's {evictable}"
        assert stats.free_pages == len(m.free_pages()), stats
        assert stats.cached_pages == len(m.index), f"{stats} but model index {len(m.index)}"
        assert stats.num_sequences == len(m.seqs)
        for seq_id, seq in m.seqs.items():
            table = self.subject.block_table(seq_id)
            assert table == seq.pages, f"seq {seq_id}: table {table} != model {seq.pages}"
            assert len(table) == m.pages_for(len(seq.tokens))
            assert self.subject.num_tokens(seq_id) == len(seq.tokens)

    @invariant()
    def events_agree_with_model(self) -> None:
        """The step's events are the model's index changes; the snapshot is its index."""
        if not hasattr(self, "model"):
            return
        m = self.model
        expected = [m.event(event) for event in m.events]
        m.events.clear()
        take_events = getattr(self.subject, "take_events", None)
        if take_events is not None:
            got = take_events()
            assert got == expected, f"events {got}, model says {expected}"
        if getattr(self.subject, "records_evictions", False):
            evicted = [(e.key, e.page) for e in expected if isinstance(e, PageRemoved)]
            assert self.subject.take_evicted() == evicted, "evictions differ from events"
        snapshot = getattr(self.subject, "prefix_snapshot", None)
        if snapshot is None:
            return
        entries: list[PageStored] = snapshot()
        model = {m.event((True, prefix, page)) for prefix, page in m.index.items()}
        assert len(entries) == len(model) and set(entries) == model, (
            f"snapshot {entries}, model index {model}"
        )
        seen: set[PrefixKey] = set()
        keys = {entry.key for entry in entries}
        for entry in entries:
            assert entry.parent_key not in keys or entry.parent_key in seen, (
                f"snapshot lists {entry.key.hex()} before its parent"
            )
            seen.add(entry.key)


def _space_args(space: Space, compute_last: bool = True) -> dict[str, Any]:
    """The key-space argument of a call in ``space`` (and ``compute_last`` when it is
    not the default, so the default path is driven as callers drive it)."""
    args: dict[str, Any] = {"space": space}
    if not compute_last:
        args["compute_last"] = False
    return args


def make_state_machine(factory: Factory) -> type[ManagerConformance]:
    """A :class:`ManagerConformance` whose subject is ``factory(layout)``: the entry
    point for a suite that builds its subject with a plain function."""

    class FactoryConformance(ManagerConformance):
        def make_subject(self, layout: KVLayout) -> Any:
            return factory(layout)

    return FactoryConformance
