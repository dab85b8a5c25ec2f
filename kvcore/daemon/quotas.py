"""Quotas: what one session, namespace, tenant or client process may hold in a pool.

The :class:`Ledger` keeps, per pool, the token count of every owned sequence
(as the Manager has it), the :class:`Holder` of each, and the sequences and
page references each holder book sums up: per session, per namespace, per
tenant (the grant's; not the operator) and per peer process (the kernel's pid
of an ipc:// peer; none for tcp://). Units: a sequence of ``n`` tokens holds
``ceil(n / page_size)`` page references; a page shared by two sequences (a
fork) counts twice, so the quotas also bound the daemon's bookkeeping memory.
The tenant and process books make re-attaching useless: a client's sessions
together hold at most what its tenant and its process may.

The ledger is checked before a Manager operation (``quota_exceeded``, nothing
changed) and updated after it succeeded. Invariant
(:meth:`Ledger.check_integrity`)::

    tokens[pool][seq] == manager.num_tokens(seq)   for every owned seq
    usage[session] == the sum over its sequences; namespace, tenant, process likewise

What each operation costs and adds is declared once, on its
:class:`~kvcore.ops.Operation` (``work``, ``grows``, ``creates``, ``ends``);
this module only reads those declarations against the books (the work bound
per request is :mod:`.work`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvcore_ipc import messages as msg

from kvcore.config import PoolConfig
from kvcore.errors import QuotaExceeded
from kvcore.layout import cdiv
from kvcore.ops import Books, Operation

PROCESS_SEQUENCES = 1 << 16
"""Default bound of the sequences one peer process holds in a pool, all its sessions
together: what one session may hold by default (``session_max_sequences``), so that
opening more sessions gives a process nothing more. A vLLM engine runs at most a few
thousand sequences at once (``max_num_seqs``, default 256 to 1,024), so 65,536 is far
above any honest engine. What the sequences cost the daemon grows with their page
references (about 17 bytes each: 65,536 forks of a 254-page sequence took 271 MiB),
which ``process_pages`` bounds when set; a sequence holds at most the pool's pages."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Quotas of one pool; 0 means none. Pages are page references (see module doc).

    ``process_*`` bound a peer process (all its sessions, on the kernel's pid:
    ipc:// peers), ``tenant_*`` a named tenant (all its sessions, every process
    and transport; the operator has no tenant book)."""

    session_pages: int = 0
    session_sequences: int = 0
    namespace_pages: int = 0
    namespace_sequences: int = 0
    tenant_pages: int = 0
    tenant_sequences: int = 0
    process_pages: int = 0
    process_sequences: int = PROCESS_SEQUENCES

    @classmethod
    def of(cls, pool: PoolConfig) -> Limits:
        """The pool's quotas; unless configured, a process may hold what one session may,
        and at least :data:`PROCESS_SEQUENCES` sequences (none if sessions are unbounded)."""
        session = pool.session_max_sequences
        process = pool.process_max_sequences
        if process is None:
            process = max(session, PROCESS_SEQUENCES) if session else 0
        return cls(
            pool.session_max_pages,
            session,
            pool.namespace_max_pages,
            pool.namespace_max_sequences,
            pool.tenant_max_pages,
            pool.tenant_max_sequences,
            pool.process_max_pages,
            process,
        )


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a sequence, fixed at attach: its session and what that session counts
    against."""

    session: int  # the session id
    namespace: str  # the session's namespace
    tenant: str = ""  # the grant's tenant; "" (the operator): no tenant book
    process: int = 0  # the kernel-reported peer pid; 0 (tcp://, unwatched): no process book


@dataclass(slots=True)
class Usage:
    pages: int = 0  # page references
    sequences: int = 0


@dataclass(slots=True)
class _PoolBook:
    page_size: int  # tokens per page
    limits: Limits
    tokens: dict[int, int] = field(default_factory=dict)  # seq -> tokens
    owner: dict[int, int] = field(default_factory=dict)  # seq -> session id
    holders: dict[int, Holder] = field(default_factory=dict)  # session id -> its holder
    sessions: dict[int, Usage] = field(default_factory=dict)
    namespaces: dict[str, Usage] = field(default_factory=dict)
    tenants: dict[str, Usage] = field(default_factory=dict)
    processes: dict[int, Usage] = field(default_factory=dict)

    def pages(self, seq: int) -> int:
        return cdiv(self.tokens[seq], self.page_size)

    def held(self, seq: int) -> int | None:
        return self.tokens.get(seq)

    def books_of(self, h: Holder) -> list[tuple[str, dict[Any, Usage], Any, int, int]]:
        """(who, book, key, max pages, max sequences) of each book ``h`` counts against."""
        lim = self.limits
        books: list[tuple[str, dict[Any, Usage], Any, int, int]] = [
            ("session", self.sessions, h.session, lim.session_pages, lim.session_sequences),
            (
                f"namespace {h.namespace!r}",
                self.namespaces,
                h.namespace,
                lim.namespace_pages,
                lim.namespace_sequences,
            ),
        ]
        if h.tenant:
            books.append(
                (
                    f"tenant {h.tenant!r}",
                    self.tenants,
                    h.tenant,
                    lim.tenant_pages,
                    lim.tenant_sequences,
                )
            )
        if h.process:
            books.append(
                (
                    f"process {h.process}",
                    self.processes,
                    h.process,
                    lim.process_pages,
                    lim.process_sequences,
                )
            )
        return books


class Ledger:
    """Per-pool books of what sessions, namespaces, tenants and processes hold (see
    module doc)."""

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

    def check(self, pool: str, holder: Holder, op: Operation[Any, Any], body: msg.BatchOp) -> None:
        """QuotaExceeded if ``body`` would take a book of ``holder`` (its session,
        namespace, tenant, process) over a quota: the page references of the sequence
        ``op.grows`` (all of them if the op creates it, else those it adds) and, if the
        op creates one, a sequence."""
        book = self._books[pool]
        lim = book.limits
        creates = op.creates is not None
        if not (
            lim.session_pages or lim.namespace_pages or lim.tenant_pages or lim.process_pages
        ) and not (
            creates
            and (
                lim.session_sequences
                or lim.namespace_sequences
                or lim.tenant_sequences
                or lim.process_sequences
            )
        ):
            return  # the hot path: nothing this op may add is limited
        grown = op.grows(body, book)
        if grown is None:
            return
        seq, tokens = grown
        pages = cdiv(tokens, book.page_size) - (0 if creates else book.pages(seq))
        seqs = int(creates)
        for who, usages, key, max_pages, max_seqs in book.books_of(holder):
            held = usages.get(key) or Usage()
            if max_pages and held.pages + pages > max_pages:
                raise QuotaExceeded(
                    f"the {who} holds {held.pages} page references of pool {pool!r}; "
                    f"{pages} more exceed its quota of {max_pages}"
                )
            if max_seqs and held.sequences + seqs > max_seqs:
                raise QuotaExceeded(
                    f"the {who} holds {held.sequences} sequences of pool {pool!r}; "
                    f"its quota is {max_seqs}"
                )

    def apply(self, pool: str, holder: Holder, op: Operation[Any, Any], body: msg.BatchOp) -> None:
        """Book the effect of ``body``, which the Manager just carried out: the token count
        ``op.grows`` sets (a created sequence is ``holder``'s), the sequence ``op.ends``
        drops."""
        book = self._books[pool]
        grown = op.grows(body, book)
        if grown is not None:
            seq, tokens = grown
            if op.creates is None:
                self._resize(book, seq, tokens)
            else:
                self._add(book, seq, tokens, holder)
        if op.ends is not None:
            self.drop(pool, getattr(body, op.ends))

    def drop(self, pool: str, seq: int) -> None:
        """``seq`` was freed (by its owner, or reaped)."""
        book = self._books[pool]
        holder = book.holders[book.owner.pop(seq)]
        pages = book.pages(seq)
        del book.tokens[seq]
        for _, usages, key, _, _ in book.books_of(holder):
            usage = usages[key]
            usage.pages -= pages
            usage.sequences -= 1
            if not usage.sequences:
                del usages[key]
        if holder.session not in book.sessions:
            del book.holders[holder.session]

    def _add(self, book: _PoolBook, seq: int, tokens: int, holder: Holder) -> None:
        assert seq not in book.tokens, f"seq {seq} created twice"
        assert book.holders.get(holder.session, holder) == holder, "a session changed holder"
        book.tokens[seq] = tokens
        book.owner[seq] = holder.session
        book.holders[holder.session] = holder
        pages = book.pages(seq)
        for _, usages, key, _, _ in book.books_of(holder):
            usage = usages.setdefault(key, Usage())
            usage.pages += pages
            usage.sequences += 1

    def _resize(self, book: _PoolBook, seq: int, tokens: int) -> None:
        old = book.pages(seq)
        book.tokens[seq] = tokens
        grown = book.pages(seq) - old
        if grown:
            for _, usages, key, _, _ in book.books_of(book.holders[book.owner[seq]]):
                usages[key].pages += grown

    def usage(self, pool: str, session: int) -> Usage:
        return self._books[pool].sessions.get(session) or Usage()

    def held_by(self, pool: str, *, tenant: str = "", process: int = 0) -> Usage:
        """What ``tenant`` or ``process`` holds in ``pool`` (stats, tests)."""
        book = self._books[pool]
        usage = book.tenants.get(tenant) if tenant else book.processes.get(process)
        return usage or Usage()

    def check_integrity(self, pool: str, num_tokens: Callable[[int], int]) -> None:
        """Assert the books of ``pool`` match the Manager (``num_tokens(seq)``) and sum up."""
        book = self._books[pool]
        assert book.tokens.keys() == book.owner.keys(), "tokens and owners disagree"
        assert set(book.owner.values()) == book.holders.keys() == book.sessions.keys(), (
            "holders are not exactly the sessions with sequences"
        )
        fresh = _PoolBook(book.page_size, book.limits)
        for seq, tokens in book.tokens.items():
            assert num_tokens(seq) == tokens, f"seq {seq}: {tokens} tokens booked"
            fresh.tokens[seq] = tokens
            for _, usages, key, _, _ in fresh.books_of(book.holders[book.owner[seq]]):
                usage = usages.setdefault(key, Usage())
                usage.pages += book.pages(seq)
                usage.sequences += 1
        assert fresh.sessions == book.sessions, "session usage does not add up"
        assert fresh.namespaces == book.namespaces, "namespace usage does not add up"
        assert fresh.tenants == book.tenants, "tenant usage does not add up"
        assert fresh.processes == book.processes, "process usage does not add up"

    def booked(self, pool: str) -> Iterable[int]:
        return self._books[pool].tokens.keys()
