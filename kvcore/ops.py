"""The operation table: each Manager operation of the protocol, declared once.

An :class:`Operation` ties together

* the request struct (kvcore_ipc.messages; it declares the ``op`` tag, the
  fields, the result struct and whether a batch may carry it),
* the :class:`~kvcore.manager.Manager` method it runs (whose signature and
  docstring are the operation's API, in-process and over the wire),
* how the call's arguments become a request (``encode``, client side), how the
  daemon runs the request on a Manager and answers (``serve``), and how the
  answer becomes the Manager's result type again (``decode``, client side),
* the ownership rule: which request fields name sequences the session must own
  (``owns``), create (``creates``, the session claims it) or end (``ends``: the
  session releases it, its pages go back, so the client first waits for the
  kernels that may still read them),
* what the request costs and adds, read from the daemon's books of the pool
  (:class:`Books`) as they are when it runs: ``work``, the tokens of work it
  is (bounded per request by ``max_request_tokens``; a batch is priced op by
  op, so a fork of a child forked earlier in the batch costs the child's
  pages), and ``grows``, the sequence whose token count it sets and that
  count, from which the quota ledger derives the page references and
  sequences it adds (so a quota may refuse it) and books them after it ran.

Everything else is derived from :data:`OPERATIONS`: the daemon's dispatch
(kvcore/daemon/handler.py), its work bound (kvcore/daemon/work.py) and quotas
(kvcore/daemon/quotas.py), the methods of :class:`~kvcore.client.Client` and
:class:`~kvcore.client.Batch` (an Operation is a typed descriptor: as a class
attribute of a client it is the bound method, with the Manager method's
signature and docstring), and tests hold the table, the Manager's behaviour,
the schema and spec/protocol.md to each other (tests/test_ops_table.py). Session-level operations (attach, detach,
heartbeat, stats, check, batch) touch no Manager and live in the handler.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from kvcore_ipc import messages as msg
from msgspec import Struct
from msgspec.structs import astuple

from kvcore.layout import cdiv
from kvcore.manager import (
    Allocation,
    Extension,
    Manager,
    PageManager,
    PagesAllocation,
    PrefixHit,
)
from kvcore.prefix import KeySpace, PackedTokens, count_tokens

P = ParamSpec("P")
T = TypeVar("T")


class Books(Protocol):
    """What the daemon's ledger knows of one pool, as ``work`` and ``grows`` read it."""

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        ...

    def held(self, seq: int) -> int | None:
        """Tokens ``seq`` holds; None if it is not on the books (no owned sequence)."""
        ...


class Caller(Protocol):
    """What an Operation binds to as a method: something that runs a request."""

    def run_op(self, op: Operation[Any, T], request: msg.BatchOp) -> T: ...


@dataclass(frozen=True, eq=False)
class Operation(Generic[P, T]):
    """One protocol operation over a Manager method; see the module docstring.

    ``serve(manager, request, namespace)`` gets the session's namespace (the
    default of per-call namespaces) and returns the wire result struct.

    ``work(request, books)`` is the request's cost in tokens: those it carries,
    adds or copies, read from the books just before it runs; 0 for none. ``grows(request, books)`` is ``(seq, tokens)``:
    the sequence whose token count the op sets and that count after it ran (the
    created sequence for ``creates``, else a sequence it owns); None if it sets
    none, or if that sequence is not on the books (the Manager refuses the op
    then). Both are declared by every operation (no defaults): an op that
    carries tokens or grows a sequence cannot skip the work bound or quotas.
    """

    method: Callable[Concatenate[Manager, P], T]
    request: type[msg.BatchOp]
    encode: Callable[P, msg.BatchOp]
    serve: Callable[[PageManager, Any, str], Struct]
    decode: Callable[[Any], T]
    owns: tuple[str, ...] = ()  # request fields naming sequences the session must own
    creates: str | None = None  # request field naming the sequence the op creates
    ends: str | None = None  # request field naming the sequence the op ends (pages go back)
    work: Callable[[Any, Books], int] = field(kw_only=True)  # tokens of work (see above)
    grows: Callable[[Any, Books], tuple[int, int] | None] = field(kw_only=True)  # (seq, tokens)
    signature: inspect.Signature = field(init=False)

    def __post_init__(self) -> None:
        """The remote signature: the Manager method's, with the defaults of ``encode``
        (a key space's None namespace means the session's namespace over the wire)."""
        sig = inspect.signature(self.method)
        remote = inspect.signature(self.encode).parameters
        params = [
            p.replace(default=remote[p.name].default) if p.name in remote else p
            for p in list(sig.parameters.values())[1:]  # without self
        ]
        object.__setattr__(self, "signature", sig.replace(parameters=params))

    @property
    def name(self) -> str:
        """The wire name (the request's ``op`` tag) and the method name."""
        tag: str = self.request.__struct_config__.tag  # type: ignore[assignment]
        return tag

    @property
    def result(self) -> type[Struct]:
        """The wire result struct (declared by the request)."""
        return self.request.Result

    @overload
    def __get__(self, obj: None, owner: type) -> Operation[P, T]: ...
    @overload
    def __get__(self, obj: Caller, owner: type) -> Callable[P, T]: ...
    def __get__(self, obj: Caller | None, owner: type) -> Operation[P, T] | Callable[P, T]:
        if obj is None:
            return self

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return obj.run_op(self, self.encode(*args, **kwargs))

        _describe(call, self)
        return _bind(obj, owner, self, call)


class Queuer(Protocol):
    def queue_op(self, op: Operation[Any, Any], request: msg.BatchOp) -> None: ...


@dataclass(frozen=True, eq=False)
class Queued(Generic[P]):
    """An Operation as a method that queues it instead of running it: as a class
    attribute of a Batch, ``batch.allocate(...)`` queues an allocate (run() returns
    its result)."""

    op: Operation[P, Any]

    @overload
    def __get__(self, obj: None, owner: type) -> Queued[P]: ...
    @overload
    def __get__(self, obj: Queuer, owner: type) -> Callable[P, None]: ...
    def __get__(self, obj: Queuer | None, owner: type) -> Queued[P] | Callable[P, None]:
        if obj is None:
            return self
        op = self.op

        def queue(*args: P.args, **kwargs: P.kwargs) -> None:
            obj.queue_op(op, op.encode(*args, **kwargs))

        _describe(queue, op, queued=True)
        return _bind(obj, owner, self, queue)


def _bind(obj: object, owner: type, descriptor: object, method: Callable[P, T]) -> Callable[P, T]:
    """``method`` (``descriptor`` bound to ``obj``), kept as ``obj``'s own attribute when
    ``obj`` has a ``__dict__`` and ``owner`` serves the descriptor under the method's
    name: the descriptor (a non-data one) then runs once per object and operation, not on
    every call (a round trip pays a dict lookup, not a closure)."""
    attributes = getattr(obj, "__dict__", None)
    if attributes is not None and getattr(owner, method.__name__, None) is descriptor:
        attributes[method.__name__] = method
    return method


def _describe(function: Callable[..., Any], op: Operation[Any, Any], queued: bool = False) -> None:
    """Give a bound operation the name, signature and docstring of its Manager method
    (runs on every attribute access: the docstring is built once per op)."""
    function.__name__ = function.__qualname__ = op.name
    function.__doc__ = _doc(op, queued)
    function.__signature__ = op.signature  # type: ignore[attr-defined]


@functools.cache
def _doc(op: Operation[Any, Any], queued: bool) -> str:
    doc = inspect.getdoc(op.method) or ""
    if queued:
        doc = f"Queue ``{op.name}``; Batch.run() returns its result in order.\n\n{doc}"
    return f"{doc}\n\nWire: ``{op.name}`` -> {op.result.__name__} (spec/protocol.md)."


def _tokens(tokens: Sequence[int]) -> list[int]:
    return tokens if isinstance(tokens, list) else list(tokens)


def _page_tokens(tokens: Sequence[int]) -> list[int] | bytes:
    """The wire's form of a one-page chain op's tokens: packed ones stay packed."""
    return bytes(tokens) if isinstance(tokens, PackedTokens) else _tokens(tokens)


def _unwire(tokens: list[int] | bytes) -> Sequence[int]:
    """A one-page chain op's tokens as the wire carried them: packed bytes as
    :class:`PackedTokens` (the Manager checks them: 4 bytes a token)."""
    return PackedTokens(tokens) if isinstance(tokens, bytes) else tokens


def _space(
    request: msg.Allocate | msg.Lookup | msg.AllocatePages | msg.LookupPages,
    session_namespace: str,
) -> KeySpace:
    """The request's key space; a None namespace is the session's (fixed at attach)."""
    namespace = session_namespace if request.namespace is None else request.namespace
    return KeySpace(namespace, request.model, request.lora, request.salt)


# -- encode: a call's arguments -> the request (client side) ----------------------------
# A key space's namespace None means the session's namespace (fixed at attach); the
# model, adapter and salt ("" for none) complete it (spec/hashing.md) and are not
# granted: they split a namespace, never reach outside it.


def _parts(space: KeySpace) -> KeySpace:
    if space.__class__ is not KeySpace:  # a str would unpack into four parts
        raise TypeError(f"a key space must be a kvcore.KeySpace, got {space!r}")
    return space


def _allocate(
    seq_id: int,
    tokens: Sequence[int],
    space: KeySpace = KeySpace(),
    *,
    compute_last: bool = True,
) -> msg.Allocate:
    ns, model, lora, salt = _parts(space)
    return msg.Allocate(seq_id, _tokens(tokens), ns, salt, lora, compute_last, model)


def _commit(seq_id: int, tokens: Sequence[int], *, start: int = 0) -> msg.Commit:
    return msg.Commit(seq_id, _tokens(tokens), start)


def _lookup(
    tokens: Sequence[int],
    space: KeySpace = KeySpace(),
    *,
    compute_last: bool = True,
) -> msg.Lookup:
    ns, model, lora, salt = _parts(space)
    return msg.Lookup(_tokens(tokens), ns, salt, lora, compute_last, model)


def _allocate_pages(
    seq_id: int, tokens: Sequence[int], space: KeySpace = KeySpace()
) -> msg.AllocatePages:
    ns, model, lora, salt = _parts(space)
    return msg.AllocatePages(seq_id, _page_tokens(tokens), ns, salt, lora, model)


def _lookup_pages(tokens: Sequence[int], space: KeySpace = KeySpace()) -> msg.LookupPages:
    ns, model, lora, salt = _parts(space)
    return msg.LookupPages(_page_tokens(tokens), ns, salt, lora, model)


def _commit_pages(seq_id: int, tokens: Sequence[int]) -> msg.CommitPages:
    return msg.CommitPages(seq_id, _page_tokens(tokens))


# -- work and growth, read from the books (units: tokens) -------------------------------


def carried(request: msg.BatchOp) -> int:
    """The tokens ``request`` carries in its frame (its token lists): known before anything
    runs, and never more than its op's ``work`` (tests/test_ops_table.py), so a request
    that carries more than ``max_request_tokens`` is refused whole, before any work."""
    return sum(
        len(v) if isinstance(v, list) else len(v) // 4
        for v in astuple(request)
        if isinstance(v, list | bytes)
    )


def _no_work(request: Any, books: Books) -> int:
    return 0


def _grows_none(request: Any, books: Books) -> None:
    return None  # the op sets no sequence's token count


def _copied(request: msg.Fork, books: Books) -> int:
    """A fork copies the parent's block table: its pages, priced as full pages of tokens."""
    held = books.held(request.parent) or 0
    return cdiv(held, books.page_size) * books.page_size


def _forked(request: msg.Fork, books: Books) -> tuple[int, int] | None:
    held = books.held(request.parent)
    return None if held is None else (request.child, held)


def _extended(request: msg.Extend, books: Books) -> tuple[int, int] | None:
    held = books.held(request.seq)
    return None if held is None else (request.seq, held + request.num_tokens)


# -- the table ------------------------------------------------------------------------

allocate = Operation(
    Manager.allocate,
    msg.Allocate,
    _allocate,
    serve=lambda m, r, ns: msg.AllocateOk(
        *_allocation(m.allocate(r.seq, r.tokens, _space(r, ns), compute_last=r.compute_last))
    ),
    decode=lambda r: Allocation(r.pages, r.num_cached_tokens, r.sources),
    creates="seq",
    work=lambda r, b: len(r.tokens),
    grows=lambda r, b: (r.seq, len(r.tokens)),
)
extend = Operation(
    Manager.extend,
    msg.Extend,
    msg.Extend,
    serve=lambda m, r, ns: msg.ExtendOk(*_extension(m.extend(r.seq, r.num_tokens))),
    decode=lambda r: Extension(r.new_pages, r.copies),
    owns=("seq",),
    work=lambda r, b: r.num_tokens,
    grows=_extended,
)
commit = Operation(
    Manager.commit,
    msg.Commit,
    _commit,
    serve=lambda m, r, ns: msg.CommitOk(m.commit(r.seq, r.tokens, start=r.start)),
    decode=lambda r: r.num_committed,
    owns=("seq",),
    work=lambda r, b: len(r.tokens),
    grows=_grows_none,
)
fork = Operation(
    Manager.fork,
    msg.Fork,
    msg.Fork,
    serve=lambda m, r, ns: msg.PagesOk(m.fork(r.parent, r.child)),
    decode=lambda r: r.pages,
    owns=("parent",),
    creates="child",
    work=_copied,
    grows=_forked,
)
free = Operation(
    Manager.free,
    msg.Free,
    msg.Free,
    serve=lambda m, r, ns: _free(m, r.seq),
    decode=lambda r: None,
    owns=("seq",),
    ends="seq",
    work=_no_work,
    grows=_grows_none,
)
lookup = Operation(
    Manager.lookup,
    msg.Lookup,
    _lookup,
    serve=lambda m, r, ns: msg.LookupOk(
        *_hit(m.lookup(r.tokens, _space(r, ns), compute_last=r.compute_last))
    ),
    decode=lambda r: PrefixHit(r.num_cached_tokens, r.num_evictable_pages),
    work=lambda r, b: len(r.tokens),
    grows=_grows_none,
)
block_table = Operation(
    Manager.block_table,
    msg.BlockTable,
    msg.BlockTable,
    serve=lambda m, r, ns: msg.PagesOk(m.block_table(r.seq)),
    decode=lambda r: r.pages,
    owns=("seq",),
    work=_no_work,
    grows=_grows_none,
)
num_tokens = Operation(
    Manager.num_tokens,
    msg.NumTokens,
    msg.NumTokens,
    serve=lambda m, r, ns: msg.NumTokensOk(m.num_tokens(r.seq)),
    decode=lambda r: r.num_tokens,
    owns=("seq",),
    work=_no_work,
    grows=_grows_none,
)
allocate_pages = Operation(
    Manager.allocate_pages,
    msg.AllocatePages,
    _allocate_pages,
    serve=lambda m, r, ns: msg.AllocatePagesOk(
        *_pages_allocation(m.allocate_pages(r.seq, _unwire(r.tokens), _space(r, ns)))
    ),
    decode=lambda r: PagesAllocation(r.pages, r.hits, r.media),
    creates="seq",
    work=lambda r, b: count_tokens(_unwire(r.tokens)),
    grows=lambda r, b: (r.seq, count_tokens(_unwire(r.tokens))),
)
lookup_pages = Operation(
    Manager.lookup_pages,
    msg.LookupPages,
    _lookup_pages,
    serve=lambda m, r, ns: msg.LookupPagesOk(m.lookup_pages(_unwire(r.tokens), _space(r, ns))),
    decode=lambda r: r.hits,
    work=lambda r, b: count_tokens(_unwire(r.tokens)),
    grows=_grows_none,
)
commit_pages = Operation(
    Manager.commit_pages,
    msg.CommitPages,
    _commit_pages,
    serve=lambda m, r, ns: msg.CommitPagesOk(m.commit_pages(r.seq, _unwire(r.tokens))),
    decode=lambda r: r.num_indexed,
    owns=("seq",),
    work=lambda r, b: count_tokens(_unwire(r.tokens)),
    grows=_grows_none,
)


def _pages_allocation(a: PagesAllocation) -> tuple[list[int], list[bool], list[str]]:
    return a.pages, a.hits, a.media


def _allocation(a: Allocation) -> tuple[list[int], int, list[tuple[str, int]]]:
    return a.pages, a.num_cached_tokens, a.sources


def _extension(e: Extension) -> tuple[list[int], list[tuple[int, int]]]:
    return e.new_pages, e.copies


def _free(manager: PageManager, seq_id: int) -> msg.Empty:
    manager.free(seq_id)
    return msg.Empty()


def _hit(h: PrefixHit) -> tuple[int, int]:
    return h.num_cached_tokens, h.num_evictable_pages


OPERATIONS: dict[type[msg.BatchOp], Operation[Any, Any]] = {
    op.request: op
    for op in (
        allocate,
        extend,
        commit,
        fork,
        free,
        lookup,
        block_table,
        num_tokens,
        allocate_pages,
        lookup_pages,
        commit_pages,
    )
}
"""Every Manager operation by request type; exactly the batchable ops of the protocol."""


def operation_of(request: msg.BatchOp) -> Operation[Any, Any]:
    """The table entry of a (decoded, so batchable) Manager request."""
    return OPERATIONS[type(request)]


SESSION_OPS: frozenset[str] = frozenset(
    {"attach", "detach", "heartbeat", "stats", "check", "snapshot", "batch"}
)
"""Operations on the session or the daemon, served by the handler itself."""

assert set(OPERATIONS) == set(msg.BATCH_OPS), "the table and the batchable ops differ"
assert {op.name for op in OPERATIONS.values()} | SESSION_OPS == msg.OP_NAMES, (
    "an operation of kvcore_ipc.messages is neither in the table nor served by the session"
)
