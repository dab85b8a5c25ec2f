"""Typed messages of the kvcore wire protocol (spec/protocol.md), one per operation.

Every message is a msgpack *map* whose keys are the field names below. A
request is an envelope around one operation body; the body's ``op`` field is the
tag of a tagged union, so a decoder typed with :data:`Request` rejects a
malformed message (wrong type, missing field, unknown ``op``, value out of
range) before any handler runs.

Units: page ids and page counts are in pages; ``tokens``, ``num_tokens`` and
``num_cached_tokens`` are in tokens; sizes and offsets are in bytes.

Schema evolution (spec/protocol.md, "Versioning"): a new field always has a
default, so an old peer's message still decodes; decoders ignore fields they do
not know, so a new peer's message decodes on an old peer; a new operation is
answered ``unknown_op`` by an old daemon. Removing or retyping a field bumps
:data:`PROTOCOL_VERSION`.

This module knows nothing about kvcore: it imports msgspec only.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, TypeVar

import msgspec
from msgspec import Meta, Struct

R = TypeVar("R")

PROTOCOL_VERSION = 1  # major: peers with different majors refuse each other

U64 = Annotated[int, Meta(ge=0)]  # < 2**64; the daemon checks the upper bound
U32 = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
NonNeg = Annotated[int, Meta(ge=0)]
Token = U32
Namespace = Annotated[str, Meta(max_length=1024)]  # the daemon checks the 256-byte UTF-8 limit

# Stable error codes carried by ErrorBody.code (spec/protocol.md, "Errors").
ERROR_CODES: tuple[str, ...] = (
    "out_of_pages",
    "unknown_sequence",
    "sequence_exists",
    "bad_request",
    "unknown_op",
    "version_mismatch",
    "unknown_pool",
    "layout_mismatch",
    "not_attached",
    "stale_epoch",
    "forbidden",
    "unsupported",
    "timeout",
    "internal",
)


class _Message(Struct, forbid_unknown_fields=False, omit_defaults=True):
    """Base: unknown fields are ignored (forward compatibility); fields equal to their
    default may be left out by the encoder, and a missing field takes its default."""


# -- shared field types ----------------------------------------------------------


class PoolLayout(_Message):
    """Geometry of a pool; one layer view is [num_pages, 2, page_size, num_kv_heads, head_dim].

    In an attach request ``num_pages == 0`` means "any number of pages".
    """

    num_layers: Annotated[int, Meta(ge=1)]
    num_kv_heads: Annotated[int, Meta(ge=1)]
    head_dim: Annotated[int, Meta(ge=1)]
    page_size: Annotated[int, Meta(ge=1)]  # tokens per page
    dtype: str  # "float16" | "bfloat16" | "float32"
    num_pages: NonNeg


class HostMemory(_Message, tag="shm", tag_field="kind"):
    """A POSIX shared-memory segment holding the pool (layer-major, see PoolLayout)."""

    name: str  # shm_open name, without the leading "/"
    size: NonNeg  # bytes of the segment
    offset: NonNeg = 0  # bytes from the segment start to the pool's first byte


class CudaMemory(_Message, tag="cuda", tag_field="kind"):
    """A CUDA allocation exported with cudaIpcGetMemHandle (through torch's storage sharing)."""

    device_uuid: str  # "GPU-xxxxxxxx-..." as nvidia-smi -L prints it
    handle: bytes  # the 64-byte cudaIpcMemHandle_t of the allocation's base
    size: NonNeg  # bytes of the pool
    offset: NonNeg  # bytes from the allocation base to the pool's first byte
    ref_counter_handle: bytes = b""  # torch's shared refcount file (keeps the exporter's block alive)
    ref_counter_offset: NonNeg = 0
    event_handle: bytes = b""  # cudaIpcEventHandle_t; wait on it before the first access
    event_sync_required: bool = False


Memory = HostMemory | CudaMemory


class ErrorBody(_Message):
    code: str  # one of ERROR_CODES (a peer may see codes it does not know: treat as "internal")
    message: str = ""


# -- operations (request bodies) ---------------------------------------------------


class _Op(_Message, tag_field="op"):
    pass


class Attach(_Op, tag="attach"):
    """Open a session on ``pool``; answered with AttachOk."""

    version: int  # PROTOCOL_VERSION of the client
    pool: str = "default"
    namespace: Namespace = "default"  # default prefix-cache namespace of the session
    layout: PoolLayout | None = None  # expected layout; None = accept any
    ephemeral: bool = False  # create a fresh private pool of ``layout`` (daemon flag needed)
    pid: NonNeg = 0  # informational
    name: Annotated[str, Meta(max_length=256)] = ""  # informational


class Detach(_Op, tag="detach"):
    """End the session; every sequence it owns is freed."""


class Heartbeat(_Op, tag="heartbeat"):
    """Renew the lease (every request renews it; this one does nothing else)."""


class Allocate(_Op, tag="allocate"):
    seq: U64
    tokens: list[Token]
    namespace: Namespace | None = None  # None: the session's namespace


class Extend(_Op, tag="extend"):
    seq: U64
    num_tokens: NonNeg


class Commit(_Op, tag="commit"):
    seq: U64
    tokens: list[Token]  # the sequence's tokens from token 0 (at most its num_tokens)


class Fork(_Op, tag="fork"):
    parent: U64
    child: U64


class Free(_Op, tag="free"):
    seq: U64


class Lookup(_Op, tag="lookup"):
    tokens: list[Token]
    namespace: Namespace | None = None


class BlockTable(_Op, tag="block_table"):
    seq: U64


class NumTokens(_Op, tag="num_tokens"):
    seq: U64


class GetStats(_Op, tag="stats"):
    """Pools, sessions and counters; allowed without a session."""


class Check(_Op, tag="check"):
    """Debug: run the pool's integrity check in the daemon; ok or an ``internal`` error."""


BatchOp = Allocate | Extend | Commit | Fork | Free | Lookup | BlockTable | NumTokens


class Batch(_Op, tag="batch"):
    """Run ``ops`` in order; the first failing op stops the batch (not atomic)."""

    ops: list[BatchOp]


Op = (
    Attach | Detach | Heartbeat | Allocate | Extend | Commit | Fork | Free | Lookup
    | BlockTable | NumTokens | GetStats | Check | Batch
)  # fmt: skip

OP_NAMES: frozenset[str] = frozenset(
    cls.__struct_config__.tag  # type: ignore[misc]
    for cls in (
        Attach, Detach, Heartbeat, Allocate, Extend, Commit, Fork, Free, Lookup,
        BlockTable, NumTokens, GetStats, Check, Batch,
    )
)  # fmt: skip


class Request(_Message):
    """The envelope. ``id`` is chosen by the client (> 0) and echoed in the reply.

    ``session`` and ``epoch`` come from AttachOk; attach and stats send 0.
    """

    id: U64
    body: Op
    session: U64 = 0
    epoch: U64 = 0


# -- results (the ``result`` of a reply) ----------------------------------------------


class AttachOk(_Message):
    session: int
    epoch: int
    version: int
    pool: str
    device: str  # "cpu" or "cuda:N" (the daemon's numbering; map CudaMemory.device_uuid)
    layout: PoolLayout
    memory: Memory
    lease_ms: int  # the session expires this long after its last request
    max_frame_bytes: int
    max_batch: int
    events: str = ""  # PUB endpoint of the event stream, "" if off


class Empty(_Message):
    """Result of detach, heartbeat, free and check."""


class AllocateOk(_Message):
    pages: list[int]  # the new block table
    num_cached_tokens: int  # its first num_cached_tokens // page_size pages are a prefix hit


class ExtendOk(_Message):
    new_pages: list[int]
    copies: list[tuple[int, int]]  # (src, dst) page copies to run before writing


class CommitOk(_Message):
    num_committed: int  # pages of the sequence now published


class PagesOk(_Message):
    """Result of fork (the child's block table) and block_table."""

    pages: list[int]


class LookupOk(_Message):
    num_cached_tokens: int


class NumTokensOk(_Message):
    num_tokens: int


class PoolStats(_Message):
    name: str
    device: str
    layout: PoolLayout
    total_pages: int
    free_pages: int
    evictable_pages: int
    held_pages: int
    cached_pages: int
    num_sequences: int
    query_tokens: int
    hit_tokens: int
    evictions: int
    num_sessions: int
    ephemeral: bool = False


class SessionStats(_Message):
    pool: str
    namespace: str
    pid: int
    name: str
    num_sequences: int
    idle_ms: int


class ServerCounters(_Message):
    epoch: int
    version: int
    uptime_s: float
    requests: int
    errors: int
    dropped_frames: int
    expired_sessions: int


class StatsOk(_Message):
    pools: list[PoolStats]
    sessions: list[SessionStats]
    counters: ServerCounters


class BatchOk(_Message):
    """``results[i]`` answers ``ops[i]``; if ``error`` is set, op ``len(results)`` failed
    (and changed nothing) and the ops after it did not run."""

    results: list[Any]
    error: ErrorBody | None = None


RESULTS: tuple[type[Struct], ...] = (
    AttachOk, Empty, AllocateOk, ExtendOk, CommitOk, PagesOk, LookupOk, NumTokensOk,
    StatsOk, BatchOk,
)  # fmt: skip


class Reply(_Message):
    """The daemon's answer; exactly one of ``result`` and ``error`` is set.

    ``id`` echoes the request's id, or is 0 when the request could not be decoded
    far enough to read it (a client with one request in flight owns that reply).
    """

    id: int
    result: Any = None
    error: ErrorBody | None = None


class TypedReply(_Message, Generic[R]):
    """Reply as a client decodes it, typed by the result it expects (one decode pass)."""

    id: int
    result: R | None = None
    error: ErrorBody | None = None


# -- events (the PUB stream) ---------------------------------------------------------


class PageStoredEvent(_Message, tag="stored", tag_field="kind"):
    """A page was committed: prefix lookups with ``key`` now hit ``page``."""

    pool: str
    epoch: int
    seq_no: int  # per pool, from 1, no gaps: a gap means the subscriber lost events
    key: bytes  # 32-byte prefix key (spec/hashing.md)
    parent: bytes  # the previous page's key, or the namespace root
    page: int


class PageRemovedEvent(_Message, tag="removed", tag_field="kind"):
    """A page was evicted: ``key`` no longer hits."""

    pool: str
    epoch: int
    seq_no: int
    key: bytes
    page: int


Event = PageStoredEvent | PageRemovedEvent


def json_schema() -> dict[str, Any]:
    """The machine-readable schema (JSON Schema) of every message; spec/protocol.schema.json."""
    types: tuple[Any, ...] = (Request, Reply, *RESULTS, Event)
    schemas, components = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"kvcore wire protocol v{PROTOCOL_VERSION} (msgpack maps; bytes are msgpack bin)",
        "protocol_version": PROTOCOL_VERSION,
        "error_codes": list(ERROR_CODES),
        "messages": {
            "request": schemas[0],
            "reply": schemas[1],
            "results": {t.__name__: s for t, s in zip(RESULTS, schemas[2:-1], strict=True)},
            "event": schemas[-1],
        },
        "$defs": components,
    }


class TypedBatchOk(_Message, Generic[R]):
    """BatchOk as a client decodes it when every op has the same result type (one pass)."""

    results: list[R]
    error: ErrorBody | None = None


class RawBatchOk(_Message):
    """BatchOk as a client decodes it: each result stays raw until its op's type is known."""

    results: list[msgspec.Raw]
    error: ErrorBody | None = None


if __name__ == "__main__":  # python -m kvcore_ipc.messages > spec/protocol.schema.json
    import json

    print(json.dumps(json_schema(), indent=2, sort_keys=True))
