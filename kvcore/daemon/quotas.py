"""Quotas and bounded work: what one session or namespace may hold, what one request may cost.

The :class:`Ledger` keeps, per pool, the token count of every owned sequence
(as the Manager has it) and, per session and per namespace, the sequences and
page references they hold. Units: a sequence of ``n`` tokens holds
``ceil(n / page_size)`` page references; a page shared by two sequences
(a fork) counts twice, so the quota also bounds the daemon's bookkeeping
memory. The ledger is checked before a Manager operation (``quota_exceeded``,
nothing changed) and updated after it succeeded. Invariant
(:meth:`Ledger.check_integrity`)::

    tokens[pool][seq] == manager.num_tokens(seq)   for every owned seq
    usage[session] == the sum over its sequences, usage[namespace] likewise

:func:`request_work` bounds one request's work (``max_request_tokens``): the
tokens it carries, plus those a fork copies and an extend adds, summed over a
batch; a heavier request is ``bad_request`` before anything runs.

What each operation costs and adds is declared once, on its
:class:`~kvcore.ops.Operation` (``work``, ``grows``, ``creates``, ``ends``);
this module only reads those declarations against the books.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvcore_ipc import messages as msg

from kvcore.config import PoolConfig
from kvcore.errors import BadRequest, QuotaExceeded
from kvcore.layout import cdiv
from kvcore.ops import Books, Operation


@dataclass(frozen=True, slots=True)
class Limits:
    """Quotas of one pool; 0 means none. Pages are page references (see module doc)."""

    session_pages: int = 0
    session_sequences: int = 0
    namespace_pages: int = 0
    namespace_sequences: int = 0

    @classmethod
    def of(cls, pool: PoolConfig) -> Limits:
        return cls(
            pool.session_max_pages,
            pool.session_max_sequences,
            pool.namespace_max_pages,
            pool.namespace_max_sequences,
        )


@dataclass(slots=True)
class Usage:
    pages: int = 0  # page references
    sequences: int = 0


@dataclass(slots=True)
class _PoolBook:
    page_size: int  # tokens per page
    limits: Limits
    tokens: dict[int, int] = field(default_factory=dict)  # seq -> tokens
    holder: dict[int, tuple[int, str]] = field(default_factory=dict)  # seq -> (session, namespace)
    sessions: dict[int, Usage] = field(default_factory=dict)
    namespaces: dict[str, Usage] = field(default_factory=dict)

    def pages(self, seq: int) -> int:
        return cdiv(self.tokens[seq], self.page_size)

    def held(self, seq: int) -> int | None:
        return self.tokens.get(seq)


class Ledger:
    """Per-pool books of what sessions and namespaces hold (see module doc)."""

    __slots__ = ("_books",)

    def __init__(self) -> None:
        self._books: dict[str, _PoolBook] = {}

    def open_pool(self, pool: str, page_size: int, limits: Limits) -> None:
        self._books[pool] = _PoolBook(page_size, limits)

    def close_pool(self, pool: str) -> None:
        book = self._books.pop(pool, None)
        assert book is None or not book.tokens, f"pool {pool!r} closed with sequences on its books"

    def pages(self, pool: str, seq: int) -> int:
        """Page references held by ``seq`` (0 if it is not on the books)."""
        book = self._books[pool]
        return book.pages(seq) if seq in book.tokens else 0

    def books(self, pool: str) -> Books:
        """The books of ``pool``, as an operation's ``work`` and ``grows`` read them."""
        return self._books[pool]

    def check(
        self, pool: str, session: int, namespace: str, op: Operation[Any, Any], body: msg.BatchOp
    ) -> None:
        """QuotaExceeded if ``body`` would take the session or namespace over a quota: the
        page references of the sequence ``op.grows`` (all of them if the op creates it,
        else those it adds) and, if the op creates one, a sequence."""
        book = self._books[pool]
        lim = book.limits
        creates = op.creates is not None
        if not (lim.session_pages or lim.namespace_pages) and not (
            creates and (lim.session_sequences or lim.namespace_sequences)
        ):
            return  # the hot path: nothing this op may add is limited
        grown = op.grows(body, book)
        if grown is None:
            return
        seq, tokens = grown
        pages = cdiv(tokens, book.page_size) - (0 if creates else book.pages(seq))
        self._room(book, session, namespace, pages, int(creates))

    def _room(self, book: _PoolBook, session: int, namespace: str, pages: int, seqs: int) -> None:
        lim = book.limits
        for who, usage, max_pages, max_seqs in (
            ("session", book.sessions.get(session), lim.session_pages, lim.session_sequences),
            (
                f"namespace {namespace!r}",
                book.namespaces.get(namespace),
                lim.namespace_pages,
                lim.namespace_sequences,
            ),
        ):
            held = usage or Usage()
            if max_pages and held.pages + pages > max_pages:
                raise QuotaExceeded(
                    f"the {who} holds {held.pages} page references; "
                    f"{pages} more exceed its quota of {max_pages}"
                )
            if max_seqs and held.sequences + seqs > max_seqs:
                raise QuotaExceeded(
                    f"the {who} holds {held.sequences} sequences; its quota is {max_seqs}"
                )

    def apply(
        self, pool: str, session: int, namespace: str, op: Operation[Any, Any], body: msg.BatchOp
    ) -> None:
        """Book the effect of ``body``, which the Manager just carried out: the token count
        ``op.grows`` sets (a created sequence is the session's), the sequence ``op.ends``
        drops."""
        book = self._books[pool]
        grown = op.grows(body, book)
        if grown is not None:
            seq, tokens = grown
            if op.creates is None:
                self._resize(book, seq, tokens)
            else:
                self._add(book, seq, tokens, (session, namespace))
        if op.ends is not None:
            self.drop(pool, getattr(body, op.ends))

    def drop(self, pool: str, seq: int) -> None:
        """``seq`` was freed (by its owner, or reaped)."""
        book = self._books[pool]
        session, namespace = book.holder.pop(seq)
        pages = book.pages(seq)
        del book.tokens[seq]
        for usage in (book.sessions[session], book.namespaces[namespace]):
            usage.pages -= pages
            usage.sequences -= 1
        if not book.sessions[session].sequences:
            del book.sessions[session]
        if not book.namespaces[namespace].sequences:
            del book.namespaces[namespace]

    def _add(self, book: _PoolBook, seq: int, tokens: int, holder: tuple[int, str]) -> None:
        assert seq not in book.tokens, f"seq {seq} created twice"
        book.tokens[seq] = tokens
        book.holder[seq] = holder
        pages = book.pages(seq)
        for usage in (
            book.sessions.setdefault(holder[0], Usage()),
            book.namespaces.setdefault(holder[1], Usage()),
        ):
            usage.pages += pages
            usage.sequences += 1

    def _resize(self, book: _PoolBook, seq: int, tokens: int) -> None:
        old = book.pages(seq)
        book.tokens[seq] = tokens
        grown = book.pages(seq) - old
        if grown:
            session, namespace = book.holder[seq]
            book.sessions[session].pages += grown
            book.namespaces[namespace].pages += grown

    def usage(self, pool: str, session: int) -> Usage:
        return self._books[pool].sessions.get(session) or Usage()

    def check_integrity(self, pool: str, num_tokens: Callable[[int], int]) -> None:
        """Assert the books of ``pool`` match the Manager (``num_tokens(seq)``) and sum up."""
        book = self._books[pool]
        assert book.tokens.keys() == book.holder.keys(), "tokens and holders disagree"
        sessions: dict[int, Usage] = {}
        namespaces: dict[str, Usage] = {}
        for seq, tokens in book.tokens.items():
            assert num_tokens(seq) == tokens, f"seq {seq}: {tokens} tokens booked"
            session, namespace = book.holder[seq]
            for usage in (
                sessions.setdefault(session, Usage()),
                namespaces.setdefault(namespace, Usage()),
            ):
                usage.pages += book.pages(seq)
                usage.sequences += 1
        assert sessions == book.sessions, "session usage does not add up"
        assert namespaces == book.namespaces, "namespace usage does not add up"

    def booked(self, pool: str) -> Iterable[int]:
        return self._books[pool].tokens.keys()


def request_work(
    ops: Iterable[tuple[Operation[Any, Any], msg.BatchOp]], books: Books, limit: int
) -> None:
    """BadRequest if ``ops`` (one request: each op with its table entry) would cost more
    than ``limit`` tokens of work (each op's ``work``, summed)."""
    work = 0
    for op, body in ops:  # a loop, not sum(): this runs for every op of every batch
        work += op.work(body, books)
    if work > limit:
        raise BadRequest(
            f"this request is {work} tokens of work, more than {limit} "
            f"(max_request_tokens): split it"
        )
