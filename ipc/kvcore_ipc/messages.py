"""Typed messages of the kvcore wire protocol (spec/protocol.md), one per operation.

Every message is a msgpack *map* whose keys are the field names below. A
request is an envelope around one operation body; the body's ``op`` field is the
tag of a tagged union, so a decoder typed with :data:`Request` rejects a
malformed message (wrong type, missing field, unknown ``op``, value out of
range) before any handler runs.

Units: page ids and page counts are in pages; ``tokens``, ``num_tokens`` and
``num_cached_tokens`` are in tokens; sizes and offsets are in bytes.

Each operation is declared once, as its request struct: its ``op`` tag, its
fields, its result struct (``Result``) and whether a batch may carry it
(``batchable``). The unions (:data:`Op`, :data:`BatchOp`), :data:`OP_NAMES`
and :data:`RESULTS` are derived from those declarations; kvcore/ops.py adds
what the daemon and the client do with each operation.

Schema evolution (spec/protocol.md, "Versioning"): a new field always has a
default, so an old peer's message still decodes; decoders ignore fields they do
not know, so a new peer's message decodes on an old peer; a new operation is
answered ``unknown_op`` by an old daemon. Removing or retyping a field bumps
:data:`PROTOCOL_VERSION`.

This module knows nothing about kvcore: it imports msgspec only. It is the
whole wire in one file, over ~400 lines on purpose: it is read beside
spec/protocol.md, and the unions are derived from every declaration in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, TypeVar, Union

import msgspec
from msgspec import Meta, Struct

R = TypeVar("R")

# major: peers with different majors refuse each other. 2: key spaces name a model
# (Allocate.model, Lookup.model): a v1 daemon would ignore the field and share pages
# across models, so the two refuse each other. 3: a pool has a physical order
# (PoolLayout.order): a v2 client would ignore it and read a page-major pool as layer-major.
# 4: the one-page chain ops' tokens may be packed bytes (PageTokens), which a v3 daemon
# would refuse op by op as bad requests.
PROTOCOL_VERSION = 4

U64 = Annotated[int, Meta(ge=0)]  # < 2**64; the daemon checks the upper bound
U32 = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
NonNeg = Annotated[int, Meta(ge=0)]
Token = U32
# The tokens of the one-page chain ops: a u32 array, or its little-endian u32 bytes
# (packed: 4 bytes a token), which neither side then touches token by token.
PageTokens = list[Token] | bytes
# At most 256 UTF-8 *bytes* (the daemon checks bytes; a schema can bound only characters).
Namespace = Annotated[str, Meta(max_length=256)]
# A model identity, LoRA adapter name or cache salt: "" for none, else at most 256 UTF-8
# bytes, like Namespace.
KeyPart = Annotated[str, Meta(max_length=256)]

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
    "lease_lost",
    "quota_exceeded",
    "untrusted_endpoint",
    "unsupported",
    "timeout",
    "internal",
)


class _Message(Struct, forbid_unknown_fields=False, omit_defaults=True):
    """Base: unknown fields are ignored (forward compatibility); fields equal to their
    default may be left out by the encoder, and a missing field takes its default."""


# -- shared field types ----------------------------------------------------------


class PoolLayout(_Message):
    """Geometry of a pool; one layer view is
    [num_pages, parts, page_size, num_kv_heads, head_dim], parts 2 (kind "kv": K, V)
    or 1 (kind "latent": MLA's one vector per token, num_kv_heads 1). ``order`` is the
    physical order of the axes layer, page, part, token, head (L, P, K, T, H), outermost
    first; head_dim is innermost (spec/protocol.md, "Memory").

    In an attach request ``num_pages == 0`` means "any number of pages".
    """

    num_layers: Annotated[int, Meta(ge=1)]
    num_kv_heads: Annotated[int, Meta(ge=1)]
    head_dim: Annotated[int, Meta(ge=1)]
    page_size: Annotated[int, Meta(ge=1)]  # tokens per page
    dtype: str  # "float16" | "bfloat16" | "float32" | "float8_e4m3fn" | "float8_e5m2"
    num_pages: NonNeg
    kind: str = "kv"  # "kv" | "latent"; absent = "kv" (a peer of protocol 2 before it)
    order: str = "LPKTH"  # a permutation of "LPKTH"; absent = layer-major


class HostMemory(_Message, tag="shm", tag_field="kind"):
    """A POSIX shared-memory segment holding the pool (in PoolLayout.order)."""

    name: str  # shm_open name, without the leading "/"
    size: NonNeg  # bytes of the segment
    offset: NonNeg = 0  # bytes from the segment start to the pool's first byte


class CudaMemory(_Message, tag="cuda", tag_field="kind"):
    """A CUDA allocation exported with cudaIpcGetMemHandle (through torch's storage sharing)."""

    device_uuid: str  # "GPU-xxxxxxxx-..." as nvidia-smi -L prints it
    handle: bytes  # the 64-byte cudaIpcMemHandle_t of the allocation's base
    size: NonNeg  # bytes of the pool
    offset: NonNeg  # bytes from the allocation base to the pool's first byte
    ref_counter_handle: bytes = (
        b""  # torch's shared refcount file (keeps the exporter's block alive)
    )
    ref_counter_offset: NonNeg = 0
    event_handle: bytes = b""  # cudaIpcEventHandle_t; wait on it before the first access
    event_sync_required: bool = False


Memory = HostMemory | CudaMemory


class ErrorBody(_Message):
    code: str  # one of ERROR_CODES (a peer may see codes it does not know: treat as "internal")
    message: str = ""


# -- results (the ``result`` of a reply) ----------------------------------------------


class AttachOk(_Message):
    session: int  # u64 (< 2**63 today): above 2**53, see spec/protocol.md "Encoding"
    epoch: int  # u64, as session
    version: int
    pool: str
    device: str  # "cpu" or "cuda:N" (the daemon's numbering; map CudaMemory.device_uuid)
    layout: PoolLayout  # of one shard (every shard has it)
    memory: Memory  # the region of shard ``shard``
    lease_ms: int  # the session expires this long after its last request
    max_frame_bytes: int
    max_batch: int
    events: str = ""  # PUB endpoint of the event stream, "" if off
    shard: int = 0  # the shard mapped (Attach.shard)
    shards: int = 1  # regions of the pool (pipeline stages); page p is p in each


class Empty(_Message):
    """Result of detach, heartbeat, free and check."""


class AllocateOk(_Message):
    pages: list[int]  # the new block table
    num_cached_tokens: int  # its first num_cached_tokens // page_size pages are a prefix hit
    # Where the hit's pages were when asked: runs (medium, tokens) in chain order adding
    # up to num_cached_tokens; medium "pool", or the lower tier that brought them up
    # ("host", "disk", "remote"). Empty: all in the pool.
    sources: list[tuple[str, int]] = []


class ExtendOk(_Message):
    """``new_pages`` are appended to the block table; each copy ``(src, dst)`` replaces
    the table's last page ``src`` by ``dst`` (copy-on-write; ``dst`` is not in new_pages)."""

    new_pages: list[int]
    copies: list[tuple[int, int]]  # (src, dst) page copies to run before writing


class CommitOk(_Message):
    num_committed: int  # leading full pages of the sequence committed so far (running total)


class PagesOk(_Message):
    """Result of fork (the child's block table) and block_table."""

    pages: list[int]


class LookupOk(_Message):
    num_cached_tokens: int  # whole pages, never covering the last token
    num_evictable_pages: int = 0  # of the hit's pages, how many an allocate would pin from the LRU


class NumTokensOk(_Message):
    num_tokens: int


class AllocatePagesOk(_Message):
    """``pages[i]`` holds one-page chain i; ``hits[i]``: it is indexed under chain i's
    key (read it, never write it), else fresh (write it, then ``commit_pages``)."""

    pages: list[int]  # the new block table, one page per chain
    hits: list[bool]
    # Where each hit was when asked: "pool", or the lower tier that brought it up
    # ("host", "disk", "remote"); "" for a fresh page. Empty: every hit in the pool.
    media: list[str] = []


class LookupPagesOk(_Message):
    hits: list[bool]  # per one-page chain: its key is indexed now


class CommitPagesOk(_Message):
    num_indexed: int  # pages this commit indexed (hits, and keys another page holds, excluded)


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
    event_seq_no: int = 0  # seq_no of the pool's last published event
    tiers: list[TierStats] = []  # the pool's lower tiers, top down (docs/concepts.md, "Tiers")
    shards: int = 1  # regions of ``layout`` (one per pipeline stage), pages shared
    namespaces: list[NamespaceHits] = []  # those the requester's grant sees
    busiest: list[PrefixHeat] = []  # of those namespaces, hit tokens first
    withheld_pages: int = 0  # after a restart, until the last daemon's clients let go


class NamespaceHits(_Message):
    """One namespace's prompt tokens in a pool since the daemon started: asked by
    allocations, and hit, by where the hit's pages were ("pool", "host", "disk",
    "remote"; media with none left out)."""

    namespace: str  # "(other)": the namespaces past the daemon's bound (64 a pool), together
    query_tokens: int = 0
    hit_tokens: dict[str, int] = {}


class PrefixHeat(_Message):
    """One of a pool's busiest prefixes: the hits that began with the page keyed ``key``
    (counts are upper bounds: a prefix that displaced another inherits its counts)."""

    namespace: str
    key: bytes  # the prefix's first page key (spec/hashing.md)
    hit_tokens: int = 0
    hits: int = 0  # allocations that hit it


class TierStats(_Message):
    """Counters of one lower tier of a pool; ``pages`` and ``bytes_used`` are gauges, the
    rest count since the daemon started. Pages are pool pages (one page, every layer)."""

    medium: str  # "host", "disk" or "remote"
    pages: int = 0  # entries held now (remote: pages this daemon published)
    bytes_used: int = 0
    hits: int = 0  # pages read back into the pool
    misses: int = 0  # pages asked for and not returned (corrupt ones included)
    corrupt: int = 0  # entries that failed verification
    stored: int = 0  # pages written into the tier
    evicted: int = 0  # entries pushed out to make room
    bytes_in: int = 0  # payload bytes written into the tier
    bytes_out: int = 0  # payload bytes read back out
    dropped: int = 0  # pages a full publish queue (remote) discarded
    timeouts: int = 0  # store calls abandoned at their bound, or missed while it was down
    # Requests' promotions from this tier (read, verify, copy), in seconds: a histogram,
    # promote_counts[i] over the bound before promote_bounds_s[i] and at most it (the last
    # count above every bound), and their total.
    promote_bounds_s: list[float] = []
    promote_counts: list[int] = []
    promote_s: float = 0.0


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


class SnapshotPage(_Message):
    """One indexed page: what a ``stored`` event said about it."""

    key: bytes  # 32-byte prefix key (spec/hashing.md)
    parent: bytes  # the previous page's key, or the namespace root
    page: int
    medium: str = ""  # "": committed by an engine; else the tier it was promoted from


class SnapshotOk(_Message):
    """The pool's prefix index as of event ``seq_no`` (parents listed before children)."""

    epoch: int
    seq_no: int  # events with seq_no <= this are reflected; apply later ones on top
    pages: list[SnapshotPage]


class BatchOk(_Message):
    """``results[i]`` answers ``ops[i]``; if ``error`` is set, op ``len(results)`` failed
    (and changed nothing) and the ops after it did not run."""

    results: list[Any]
    error: ErrorBody | None = None


# -- operations (request bodies) ---------------------------------------------------


class _Op(_Message, tag_field="op"):
    """An operation's request body; ``op`` (the tag) names it on the wire."""

    Result: ClassVar[type[_Message]]  # the struct of the reply's ``result``
    batchable: ClassVar[bool] = False  # may appear in Batch.ops


class Attach(_Op, tag="attach"):
    """Open a session on ``pool``; answered with AttachOk."""

    Result = AttachOk

    version: int  # PROTOCOL_VERSION of the client
    pool: str = "default"
    namespace: Namespace = "default"  # default prefix-cache namespace of the session
    layout: PoolLayout | None = None  # expected layout; None = accept any
    ephemeral: bool = False  # create a fresh private pool of ``layout`` (daemon flag needed)
    pid: NonNeg = 0  # informational
    name: Annotated[str, Meta(max_length=256)] = ""  # informational
    shard: NonNeg = 0  # the region to map (pipeline stage); bad_request if >= shards
    shards: NonNeg = 0  # expected shard count (0: any); ephemeral: the new pool's (0: 1)
    # The client maps the pool's memory (a restarted daemon withholds the pages nobody
    # committed until every process's mappings of it are its sessions': spec, "Restarts").
    maps: bool = False


class Detach(_Op, tag="detach"):
    """End the session; every sequence it owns is freed."""

    Result = Empty


class Heartbeat(_Op, tag="heartbeat"):
    """Renew the lease (every request renews it; this one does nothing else)."""

    Result = Empty


class Allocate(_Op, tag="allocate"):
    Result = AllocateOk
    batchable = True

    seq: U64
    tokens: list[Token]
    namespace: Namespace | None = None  # None: the session's namespace
    salt: KeyPart = ""  # cache salt (vLLM cache_salt) of the key space; "" for none
    lora: KeyPart = ""  # LoRA adapter name of the key space; "" for none
    compute_last: bool = True  # False: a hit may cover the last token (a store, not an engine)
    model: KeyPart = ""  # the engine's model identity of the key space; "" for none


class Extend(_Op, tag="extend"):
    Result = ExtendOk
    batchable = True

    seq: U64
    num_tokens: NonNeg  # tokens added (not the new total)


class Commit(_Op, tag="commit"):
    Result = CommitOk
    batchable = True

    seq: U64
    tokens: list[Token]  # the sequence's tokens [start, start + len(tokens))
    start: NonNeg = 0  # token offset: a multiple of page_size, <= tokens committed so far


class Fork(_Op, tag="fork"):
    Result = PagesOk
    batchable = True

    parent: U64
    child: U64


class Free(_Op, tag="free"):
    Result = Empty
    batchable = True

    seq: U64


class Lookup(_Op, tag="lookup"):
    Result = LookupOk
    batchable = True

    tokens: list[Token]
    namespace: Namespace | None = None
    salt: KeyPart = ""  # as Allocate
    lora: KeyPart = ""  # as Allocate
    compute_last: bool = True  # as Allocate
    model: KeyPart = ""  # as Allocate


class BlockTable(_Op, tag="block_table"):
    Result = PagesOk
    batchable = True

    seq: U64


class NumTokens(_Op, tag="num_tokens"):
    Result = NumTokensOk
    batchable = True

    seq: U64


class AllocatePages(_Op, tag="allocate_pages"):
    """Start ``seq`` holding ``len(tokens) // page_size`` one-page chains: page i of
    ``tokens`` is keyed as the first page of a prompt (a store of whole pages, each
    named by its own tokens: SGLang's HiCache storage)."""

    Result = AllocatePagesOk
    batchable = True

    seq: U64
    tokens: PageTokens  # whole pages, one chain each
    namespace: Namespace | None = None  # as Allocate
    salt: KeyPart = ""  # as Allocate
    lora: KeyPart = ""  # as Allocate
    model: KeyPart = ""  # as Allocate


class LookupPages(_Op, tag="lookup_pages"):
    """Per one-page chain of ``tokens`` (as AllocatePages), whether its key is indexed
    now; read-only, as Lookup."""

    Result = LookupPagesOk
    batchable = True

    tokens: PageTokens  # whole pages, one chain each
    namespace: Namespace | None = None  # as Allocate
    salt: KeyPart = ""  # as Allocate
    lora: KeyPart = ""  # as Allocate
    model: KeyPart = ""  # as Allocate


class CommitPages(_Op, tag="commit_pages"):
    """Publish the first ``len(tokens) // page_size`` pages of ``seq``, each as the
    one-page chain of its tokens."""

    Result = CommitPagesOk
    batchable = True

    seq: U64
    tokens: PageTokens  # the sequence's first tokens, whole pages


class GetStats(_Op, tag="stats"):
    """Pools, sessions and counters; allowed without a session, and limited to what the
    requester's credentials may see (spec/protocol.md, "Trust")."""

    Result = StatsOk


class Check(_Op, tag="check"):
    """Debug: run the pool's integrity checks in the daemon; ok or an ``internal`` error."""

    Result = Empty


class Snapshot(_Op, tag="snapshot"):
    """The session's pool's prefix index, to rebuild a view after an event gap."""

    Result = SnapshotOk


BATCH_OPS: tuple[type[_Op], ...] = tuple(op for op in _Op.__subclasses__() if op.batchable)

if TYPE_CHECKING:
    BatchOp = _Op
    Op = _Op
else:  # the tagged unions msgspec decodes, derived from the declarations above
    BatchOp = Union[BATCH_OPS]  # noqa: UP007


class Batch(_Op, tag="batch"):
    """Run ``ops`` in order; the first failing op stops the batch (not atomic)."""

    Result = BatchOk

    ops: list[BatchOp]


OPS: tuple[type[_Op], ...] = tuple(_Op.__subclasses__())  # every operation, in declaration order
OP_NAMES: frozenset[str] = frozenset(op.__struct_config__.tag for op in OPS)  # type: ignore[misc]
RESULTS: tuple[type[_Message], ...] = tuple(dict.fromkeys(op.Result for op in OPS))

if not TYPE_CHECKING:
    Op = Union[OPS]  # noqa: UP007


class Request(_Message):
    """The envelope. ``id`` is chosen by the client (> 0) and echoed in the reply.

    ``session`` and ``epoch`` come from AttachOk; attach and stats send 0.
    """

    id: U64
    body: Op
    session: U64 = 0
    epoch: U64 = 0


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

    key: bytes  # 32-byte prefix key (spec/hashing.md)
    parent: bytes  # the previous page's key, or the namespace root
    page: int
    tokens: list[int] = msgspec.field(default_factory=list)  # the page's page_size tokens
    namespace: str = ""  # the namespace the page was committed in
    medium: str = ""  # "": committed by an engine; else the tier it was promoted from
    lora: str = ""  # the LoRA adapter of its key space ("" none); parent of page 0: the root
    salt: str = ""  # the cache salt of its key space ("" none); of (namespace, model, lora, salt)
    model: str = ""  # the model identity of its key space ("" none): routers keep models apart


class PageRemovedEvent(_Message, tag="removed", tag_field="kind"):
    """A page left the index (evicted, or its pool closed): ``key`` no longer hits."""

    key: bytes
    page: int
    medium: str = ""  # "": its bytes were dropped; else the lower tier now holding them


Event = PageStoredEvent | PageRemovedEvent


class EventBatch(_Message):
    """The events of one request (or one batch) on one pool, in order.

    ``events[i]`` has sequence number ``first_seq_no + i``; numbers count a pool's
    events from 1 within an epoch without gaps, so a subscriber that sees a gap
    lost events and rebuilds its view from the ``snapshot`` operation.
    """

    pool: str
    epoch: int
    first_seq_no: int
    events: list[Event]


def json_schema() -> dict[str, Any]:
    """The machine-readable schema (JSON Schema) of every message; spec/protocol.schema.json."""
    types: tuple[Any, ...] = (Request, Reply, *RESULTS, EventBatch)
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
            "events": schemas[-1],
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
