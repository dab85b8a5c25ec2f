"""Typed errors with stable codes.

Three tiers of failure:

* an expected outcome (the pool is full) and a caller's mistake (an unknown
  sequence, a malformed request) are a :class:`KVCoreError` subclass whose
  ``code`` is a stable string the wire protocol carries (spec/protocol.md);
* a broken internal invariant is an ``assert`` with a message.

Every operation that raises a :class:`KVCoreError` leaves the state exactly as it
was before the call. The client side raises the very same classes, rebuilt from
the code in the error reply (:func:`error_from_code`).
"""

from __future__ import annotations

from typing import ClassVar


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
