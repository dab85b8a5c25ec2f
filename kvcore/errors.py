"""Typed errors with stable codes.

Three tiers of failure:

* an expected outcome (the pool is full: :class:`OutOfPages`, a quota:
  :class:`QuotaExceeded`) is a :class:`KVCoreError` subclass whose ``code`` is a
  stable string the wire protocol carries (spec/protocol.md): callers handle it;
* a caller's mistake (an unknown sequence, a malformed request, a sequence of
  another session) is a typed error with a code too (:class:`UnknownSequence`,
  :class:`BadRequest`, :class:`Forbidden`): the caller fixes its code;
* a broken internal invariant is an ``assert`` with a message: a bug in kvcore,
  never raised for anything a caller sends (the daemon answers ``internal``).

Every operation that raises a :class:`KVCoreError` leaves the state exactly as it
was before the call. The client side raises the very same classes, rebuilt from
the code in the error reply (:func:`error_from_code`); an op that fails inside a
batch raises its class and :class:`BatchFailed` at once (:func:`batch_failed`).
"""

from __future__ import annotations

from typing import Any, ClassVar, cast


class KVCoreError(Exception):
    """Base of every error kvcore reports to a caller; ``code`` is stable on the wire."""

    code: ClassVar[str] = "internal"


class OutOfPages(KVCoreError):
    """Not enough free or evictable pages for the request; nothing was allocated."""

    code = "out_of_pages"


class UnknownSequence(KVCoreError):
    """The sequence id names no live sequence (never allocated, or already freed)."""

    code = "unknown_sequence"


class SequenceExists(KVCoreError):
    """allocate or fork named a sequence id that is already live."""

    code = "sequence_exists"


class BadRequest(KVCoreError):
    """The request is malformed: wrong types, values out of range, too large."""

    code = "bad_request"


class UnknownOp(KVCoreError):
    """The request names an operation this daemon does not know."""

    code = "unknown_op"


class VersionMismatch(KVCoreError):
    """The peer speaks a protocol major version this daemon does not serve."""

    code = "version_mismatch"


class UnknownPool(KVCoreError):
    """attach named a pool the daemon does not serve."""

    code = "unknown_pool"


class LayoutMismatch(KVCoreError):
    """attach expected a pool layout that differs from the pool's real layout."""

    code = "layout_mismatch"


class NotAttached(KVCoreError):
    """The request carries no live session (never attached, detached, or lease expired)."""

    code = "not_attached"


class StaleEpoch(KVCoreError):
    """The request was made under an earlier daemon start; its pages mean nothing now."""

    code = "stale_epoch"


class Forbidden(KVCoreError):
    """The sequence belongs to another session, or the session's credentials do not
    allow the pool, namespace or query."""

    code = "forbidden"


class LeaseLost(KVCoreError):
    """The session's lease ran out while its process lived: its pages are fenced (not
    reused) until the client unmaps the pool and detaches, or its process exits.
    Nothing the session names is valid any more; attach again."""

    code = "lease_lost"


class QuotaExceeded(KVCoreError):
    """The operation would take the session or its namespace over a configured quota
    (pages, sequences, or sessions); nothing was allocated."""

    code = "quota_exceeded"


class UntrustedEndpoint(KVCoreError):
    """A runtime directory, socket or segment is not the daemon's user's alone (owner,
    mode, symlink): refused rather than followed (client and daemon side)."""

    code = "untrusted_endpoint"


class Unsupported(KVCoreError):
    """A backend was asked for a dtype, head dim, page size or device it does not declare."""

    code = "unsupported"


class Timeout(KVCoreError):
    """The daemon did not answer in time (client side only)."""

    code = "timeout"


class InternalError(KVCoreError):
    """The daemon failed on a request it accepted; the request changed nothing."""

    code = "internal"


class RestoreRefused(KVCoreError):
    """The daemon will not re-adopt what a dead daemon left (a manifest, segment or index
    table of another format, layout or settings, not its own, or cut short): the
    message names the object and what differs. The daemon's own decision at start,
    never sent on the wire (so not in :data:`ERRORS`); that pool starts empty instead."""


ERRORS: dict[str, type[KVCoreError]] = {
    cls.code: cls
    for cls in (
        OutOfPages,
        UnknownSequence,
        SequenceExists,
        BadRequest,
        UnknownOp,
        VersionMismatch,
        UnknownPool,
        LayoutMismatch,
        NotAttached,
        StaleEpoch,
        Forbidden,
        LeaseLost,
        QuotaExceeded,
        UntrustedEndpoint,
        Unsupported,
        Timeout,
        InternalError,
    )
}


def error_from_code(code: str, message: str) -> KVCoreError:
    """Rebuild the typed error a peer reported; an unknown code becomes InternalError."""
    cls = ERRORS.get(code)
    if cls is None:
        return InternalError(f"{code}: {message}")
    return cls(message)


class BatchFailed(KVCoreError):
    """An op of a batch failed (client side; the wire carries only the op's error).

    ``batch_index`` is the op's position, ``batch_results`` the results of the ops
    before it (they ran), ``error`` the op's typed error alone. The op changed
    nothing and no op after it ran. Raised as a class derived from both BatchFailed
    and the op's error class (:func:`batch_failed`), so ``except OutOfPages`` catches
    it as it catches one op's, and ``code`` and the message are the op's.
    """

    batch_index: int
    batch_results: list[Any]
    error: KVCoreError

    def __init__(self, error: KVCoreError, batch_index: int, batch_results: list[Any]) -> None:
        super().__init__(str(error))
        self.error = error
        self.batch_index = batch_index
        self.batch_results = batch_results

    def __reduce__(self) -> tuple[Any, ...]:
        return batch_failed, (self.error, self.batch_index, self.batch_results)


def _in_batch(cls: type[KVCoreError]) -> type[BatchFailed]:
    name = f"{cls.__name__}InBatch"
    doc = f"{cls.__name__} of an op in a batch (see BatchFailed)."
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": doc}
    return cast(type[BatchFailed], type(name, (BatchFailed, cls), namespace))


_IN_BATCH: dict[type[KVCoreError], type[BatchFailed]] = {
    cls: _in_batch(cls) for cls in ERRORS.values()
}
"""Per error class, its BatchFailed twin (both bases: either ``except`` catches it)."""


def batch_failed(error: KVCoreError, batch_index: int, batch_results: list[Any]) -> BatchFailed:
    """The error of op ``batch_index`` of a batch, as a :class:`BatchFailed` that is also
    an instance of ``error``'s class (one of :data:`ERRORS`)."""
    return _IN_BATCH[type(error)](error, batch_index, batch_results)
