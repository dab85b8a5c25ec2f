"""Client: the engine side of the daemon; the Manager's operations over the wire.

``Client.connect()`` attaches a session to a pool of a running ``kvcore serve``
and maps the pool's memory zero-copy: ``client.kv_caches[layer]`` is a tensor
of ``KVLayout.layer_shape`` over the daemon's shared memory (torch is imported
only to build those views). Operations have the Manager's names, arguments and
results (Allocation, Extension, Stats) and raise the same typed errors,
rebuilt from the error code of the reply.

A background thread heartbeats on its own socket every third of the lease, so
an idle but live engine keeps its sequences; a dead one loses them when the
lease runs out. After a daemon restart every call raises StaleEpoch (the new
daemon's answer; the stopping daemon's to a request it read but did not serve;
or, for a request the stopped daemon took with it, the channel finding another
listener on the endpoint at its next probe, 100 ms into the wait), and the first one (or the heartbeat's) fences a host
mapping (see below): the restarted daemon may have re-adopted the pool's
segment, whose pages nobody committed are then another session's to write. :meth:`Client.reconnect` attaches again (old
sequences are gone; the pool holds what the daemon re-adopted, or nothing). A
Client is not thread-safe: one engine thread drives it.

A client that was silent for longer than the lease (stopped, paused) while
alive finds its session fenced: the daemon keeps its pages (nobody else gets
them) for at most ``fence_timeout_s`` and answers ``lease_lost``. Whichever
thread learns it first (the heartbeat, at the latest a moment after the process
resumes) marks the client lost; every later call raises
:class:`~kvcore.errors.LeaseLost` until :meth:`Client.reconnect`. What ends the
fence (the acknowledgement, a ``detach``: the daemon frees the pages at once)
depends on who may still write them:

* a host mapping is fenced at once (replaced by private scratch pages, so no
  kernel still holding ``kv_caches`` can write the daemon's pages), then
  acknowledged;
* a CUDA mapping cannot be fenced: acknowledged once unmapped, at
  :meth:`Client.reconnect` or :meth:`Client.close`;
* a map-less client writes nothing itself, but the page numbers it handed out
  may still be in use by another process's mapping (the vLLM connector's
  scheduler plans copies that its workers run through their own sessions):
  acknowledged only at :meth:`Client.reconnect` or :meth:`Client.close`, so its
  pages stay fenced until its owner says nothing built on them can run any more
  (or ``fence_timeout_s`` passes).

Trust (docs/security.md): before it connects to an ipc:// endpoint the client
checks that the socket and its directory belong to itself, root or a uid of
``trusted_uids``, and that the pool's segment belongs to the socket's owner;
otherwise :class:`~kvcore.errors.UntrustedEndpoint`, saying why.

The file runs past ~400 lines on purpose: the session's life above (attach, map,
heartbeat, fence, reconnect) is one state kept by :class:`Client`, its
:class:`Batch` and its heartbeat thread together; the operations themselves are
declared in kvcore.ops.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from kvcore_ipc import messages as msg
from kvcore_ipc.channel import ChannelTimeout, DealerChannel, NoListener, Replaced
from kvcore_ipc.codec import ClientCodec
from kvcore_ipc.memory import CudaRegion, HostRegion

from kvcore import ops
from kvcore.errors import (
    BadRequest,
    InternalError,
    KVCoreError,
    LeaseLost,
    NotAttached,
    StaleEpoch,
    Timeout,
    UnknownPool,
    UntrustedEndpoint,
    batch_failed,
    error_from_code,
)
from kvcore.layout import KVLayout
from kvcore.ops import Operation, Queued
from kvcore.paths import check_socket_path, default_endpoint
from kvcore.prefix import DEFAULT_NAMESPACE
from kvcore.results import Stats

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class Client:
    """One session on one pool of a daemon. Use :meth:`connect`; close (or ``with``) to detach."""

    def __init__(
        self,
        endpoint: str,
        pool: str,
        namespace: str,
        *,
        layout: KVLayout | None = None,
        timeout_s: float = 10.0,
        map_memory: bool = True,
        heartbeat: bool = True,
        ephemeral: bool = False,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
        trusted_uids: tuple[int, ...] = (),
        name: str = "",
        shard: int = 0,
        shards: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.pool = pool
        self.namespace = namespace
        self.session = 0
        self.epoch = 0
        self.kv_caches: list[torch.Tensor] = []
        self._expected = layout
        self._timeout_s = timeout_s
        self._map_memory = map_memory
        self._ephemeral = ephemeral
        self._curve = curve_server_key
        self._keypair = curve_keypair
        self._name = name
        self.shard = shard  # the region mapped (a pipeline stage); kept by reconnect
        self.shards = 1  # the pool's regions, from AttachOk
        self._expected_shards = shards
        self._codec = ClientCodec()
        self._next_id = 0
        self._closed = False
        self._lost = False  # the lease was lost: every call raises LeaseLost (see module doc)
        self._acked = False  # the loss was acknowledged (the daemon freed the pages)
        self._lose_lock = threading.Lock()
        self._fenced = False  # the host mapping shows scratch pages (fenced) until remapped
        self._region: HostRegion | CudaRegion | None = None
        self._owners = _check_endpoint(endpoint, {os.getuid(), 0, *trusted_uids})
        self._channel = self.open_channel()
        self._beat: _Heartbeat | None = None
        if map_memory:
            import torch  # noqa: F401  (seconds on a cold start: before the lease starts)
        self._attach()
        if heartbeat:
            self._beat = _Heartbeat(self)

    @classmethod
    def connect(
        cls,
        endpoint: str | None = None,
        pool: str = "default",
        namespace: str = DEFAULT_NAMESPACE,
        **options: Any,
    ) -> Client:
        """Attach to ``pool`` of the daemon at ``endpoint`` (None: the default daemon).

        Options: ``layout`` (the expected KVLayout: LayoutMismatch if the pool's differs;
        its num_pages is ignored, except for ephemeral pools), ``timeout_s``,
        ``map_memory``, ``heartbeat``, ``ephemeral`` (a fresh private pool of
        ``layout``; the daemon must allow it), ``curve_server_key`` and
        ``curve_keypair`` (tcp://: the daemon's public key, this client's key pair
        as ``kvcore keys`` writes it), ``trusted_uids`` (ipc://: uids besides this
        one and root whose daemon socket to trust), ``name``, ``shard`` (the region of
        a sharded pool to map: a pipeline stage; BadRequest if the pool has no
        such shard) and ``shards`` (the shard count expected, LayoutMismatch if the
        pool's differs; 0: any; for an ephemeral pool, its count).
        """
        return cls(endpoint or default_endpoint(), pool, namespace, **options)

    def open_channel(self) -> DealerChannel:
        """A new channel to the daemon with this client's keys (one per thread)."""
        return DealerChannel(
            self.endpoint,
            timeout_s=self._timeout_s,
            curve_server_key=self._curve,
            curve_keypair=self._keypair,
        )

    # -- session ------------------------------------------------------------------

    def _attach(self) -> None:
        expected = None
        if self._expected is not None:  # the page count is the daemon's choice, unless ephemeral
            fields = self._expected.to_dict()
            expected = msg.PoolLayout(
                **{**fields, "num_pages": fields["num_pages"] * self._ephemeral}
            )
        body = msg.Attach(
            version=msg.PROTOCOL_VERSION,
            pool=self.pool,
            namespace=self.namespace,
            layout=expected,
            ephemeral=self._ephemeral,
            pid=os.getpid(),
            name=self._name,
            shard=self.shard,
            shards=self._expected_shards,
            maps=self._map_memory,
        )
        self._channel.relearn()  # an attach is for whichever daemon listens now
        ok = self._call(body, msg.AttachOk)
        self.session, self.epoch = ok.session, ok.epoch
        self.shards = ok.shards
        self.attach_info = ok
        self.layout = KVLayout(**msgspec.structs.asdict(ok.layout))
        self.lease_s = ok.lease_ms / 1000
        self._unmap()
        if self._map_memory:
            try:
                self._map(ok.memory)
            except KVCoreError:
                self._undo_attach()
                raise

    def _map(self, memory: msg.HostMemory | msg.CudaMemory) -> None:
        """Map the pool's memory as the daemon described it. Every failure is a
        KVCoreError, so that a caller's "daemon gone" rule sees it (an integration's
        reconnect never raises into its engine): a segment owned by an untrusted uid is
        :class:`~kvcore.errors.UntrustedEndpoint`; any other (the segment gone, too
        small, a CUDA handle that does not open: the daemon that described it exited or
        restarted between attach and map) is :class:`~kvcore.errors.StaleEpoch`, what
        the client was told about this epoch's memory being no longer true."""
        try:
            if isinstance(memory, msg.HostMemory):
                self._region = HostRegion.attach(memory, self._owners)
            else:
                self._region = CudaRegion.attach(memory)
            self.kv_caches = self.layout.layer_views(self._region.as_tensor())
        except PermissionError as exc:
            raise UntrustedEndpoint(f"{exc}: refusing to map it") from None
        except (OSError, ValueError, RuntimeError) as exc:
            raise StaleEpoch(
                f"cannot map pool {self.pool!r} of epoch {self.epoch:x} "
                f"({type(exc).__name__}: {exc}): the daemon exited or restarted since it "
                f"attached this session, or this process cannot map its memory"
            ) from None

    def _undo_attach(self) -> None:
        """The pool of the session just attached could not be mapped: detach that session
        (best effort: nothing keeps it alive, not even the heartbeat) and stay unattached
        (``session`` and ``epoch`` 0, so no caller takes the epoch for a mapped one);
        :meth:`reconnect` tries again."""
        with contextlib.suppress(KVCoreError):
            self._call(msg.Detach(), msg.Empty, timeout_s=min(self._timeout_s, 2.0))
        self._unmap()
        self.session = self.epoch = 0

    def _unmap(self) -> None:
        self.kv_caches = []
        region, self._region, self._fenced = self._region, None, False
        if region is not None:
            region.close()

    def reconnect(self) -> None:
        """Attach again (after StaleEpoch, NotAttached or LeaseLost): a new session, the pool
        remapped (the same shard). The pool must have the layout (page count aside) and
        shard count of the first attach, whatever that one expected: everything built on
        the old session (an engine's views, page tables, its block size) assumes them,
        so a daemon restarted with another layout is a LayoutMismatch, never a remap.

        A lost session not yet acknowledged (a map-less or CUDA client's: see the module
        docstring) is acknowledged first, once this process can write none of its pages
        (the CUDA work queued so far done, the pool unmapped): the daemon frees them now.
        A failed attach (any KVCoreError) leaves the client unattached."""
        if self._expected is None and self.epoch:
            self._expected = self.layout
            self._expected_shards = self.shards
        with self._lose_lock:  # the heartbeat may be acknowledging a host mapping's loss
            if self.session and self._lost and not self._acked:
                self._wait_for_gpu()
                self._unmap()
                self._acknowledge(self._channel)
        self.session = self.epoch = 0
        self._lost = self._acked = False
        self._attach()

    @property
    def lease_lost(self) -> bool:
        """True once the daemon said this session's lease is lost (see the module doc)."""
        return self._lost

    def _lose(self, channel: DealerChannel) -> None:
        """The lease is lost: a host mapping is fenced, then acknowledged on ``channel``
        (the daemon frees the fenced pages). A CUDA mapping cannot be fenced, and a
        map-less client's page numbers may be in use by other processes' mappings: their
        acknowledgement waits for :meth:`reconnect` or :meth:`close` (or the process's
        exit, or the daemon's fence timeout). Idempotent, for either thread."""
        with self._lose_lock:
            if self._lost:
                return
            self._lost = True
            region = self._region
            if isinstance(region, HostRegion):
                if not self._fenced:
                    self._fenced = True
                    region.fence()
                self._acknowledge(channel)

    def fence(self) -> None:
        """Replace a host mapping by private scratch pages (what LeaseLost does), for a
        session the daemon no longer knows: it restarted (StaleEpoch). Whatever this
        process writes through its old views then reaches no page of the pool, which
        the restarted daemon may have re-adopted and handed to other writers.
        Idempotent; :meth:`reconnect` maps the pool again."""
        with self._lose_lock:
            region = self._region
            if isinstance(region, HostRegion) and not self._fenced:
                self._fenced = True
                region.fence()

    def _acknowledge(self, channel: DealerChannel) -> None:
        """Tell the daemon this fenced session will write no more (a ``detach``)."""
        self._acked = True
        request = msg.Request(0, msg.Detach(), self.session, self.epoch)
        channel.send(msgspec.msgpack.encode(request))
        with contextlib.suppress(ChannelTimeout):
            channel.recv(int(min(self._timeout_s, 2.0) * 1000))

    def heartbeat(self) -> None:
        self._call(msg.Heartbeat(), msg.Empty)

    def close(self) -> None:
        """Detach (the daemon frees this session's sequences) and unmap the pool. Idempotent;
        afterwards every call raises NotAttached."""
        if self._closed:
            return
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        if self.session and not self._lost:
            self._wait_for_gpu()
            with contextlib.suppress(KVCoreError):  # the daemon is gone or restarted
                self._call(msg.Detach(), msg.Empty, timeout_s=min(self._timeout_s, 2.0))
        self._unmap()
        if self.session and self._lost and not self._acked:
            self._acknowledge(self._channel)  # a CUDA pool (unmapped only now), or none
        self.session = 0
        self._channel.close()
        self._closed = True

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the Manager's operations (kvcore.ops: signature, docstring and result types) ------

    allocate = ops.allocate
    extend = ops.extend
    commit = ops.commit
    fork = ops.fork
    free = ops.free
    lookup = ops.lookup
    block_table = ops.block_table
    num_tokens = ops.num_tokens
    allocate_pages = ops.allocate_pages
    lookup_pages = ops.lookup_pages
    commit_pages = ops.commit_pages

    def run_op(self, op: Operation[Any, T], request: msg.BatchOp) -> T:
        """One Manager operation over the wire: its result, as the Manager returns it."""
        if op.ends is not None:  # its pages go back to the daemon
            self._wait_for_gpu()
        result: T = op.decode(self._call(request, op.result))
        return result

    def stats(self) -> Stats:
        """This pool's figures, as Manager.stats() returns them."""
        for p in self.daemon_stats().pools:
            if p.name == self.pool:
                return Stats(
                    p.total_pages,
                    p.free_pages,
                    p.evictable_pages,
                    p.held_pages,
                    p.cached_pages,
                    p.num_sequences,
                    p.query_tokens,
                    p.hit_tokens,
                    p.evictions,
                    p.withheld_pages,
                )
        raise UnknownPool(f"the daemon no longer serves {self.pool!r}")

    def daemon_stats(self) -> msg.StatsOk:
        """Every pool, session and counter of the daemon (what `kvcore stats` shows)."""
        return self._call(msg.GetStats(), msg.StatsOk)

    def check_integrity(self) -> None:
        """Run the daemon's integrity checks (every pool, every session); InternalError
        if one fails."""
        self._call(msg.Check(), msg.Empty)

    def snapshot(self) -> msg.SnapshotOk:
        """This pool's prefix index as of event ``seq_no`` (to rebuild a view after a gap
        in the event stream: apply the events numbered after ``seq_no`` on top)."""
        return self._call(msg.Snapshot(), msg.SnapshotOk)

    def batch(self) -> Batch:
        """Collect operations and send them in one round trip (see :class:`Batch`)."""
        return Batch(self)

    def _wait_for_gpu(self) -> None:
        """Before pages go back to the daemon (free, close): on a CUDA pool, wait for the
        kernels queued on this process's current stream, which may still read them; the
        daemon may hand a freed page to another process at once."""
        if isinstance(self._region, CudaRegion):
            self._region.wait_for_stream()

    # -- the wire ------------------------------------------------------------------

    def _call(self, body: msg.Op, result_type: type[T], timeout_s: float | None = None) -> T:
        """One round trip: the typed result, or the typed error of the reply."""
        if self._closed:
            raise NotAttached("the client is closed")
        if self._lost:
            raise LeaseLost("this session's lease was lost; reconnect() to attach again")
        self._next_id += 1
        request_id = self._next_id
        try:
            frame = self._codec.encode(msg.Request(request_id, body, self.session, self.epoch))
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:
            raise BadRequest(f"cannot encode {type(body).__name__}: {exc}") from None
        self._channel.send(frame)
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        while True:  # replies with other ids answer earlier requests that timed out
            try:
                frame = self._channel.recv(timeout_ms)
            except Replaced as exc:  # the daemon that had the request stopped: a new epoch
                self.fence()
                raise StaleEpoch(
                    f"{type(body).__name__}: {exc}; reconnect() to attach again"
                ) from None
            except NoListener:
                raise Timeout(f"{type(body).__name__}: {no_daemon(self.endpoint)}") from None
            except ChannelTimeout as exc:
                raise Timeout(f"{type(body).__name__}: {exc}") from None
            try:
                reply = self._codec.decode_reply(frame, result_type)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # A late reply to another op has another result type: skip it by its id.
                if self._codec.reply_id(frame) not in (request_id, 0, None):
                    continue
                raise InternalError(f"undecodable reply to {type(body).__name__}: {exc}") from None
            if reply.id == request_id or reply.id == 0:
                break
        if reply.error is not None:
            error = error_from_code(reply.error.code, reply.error.message)
            if isinstance(error, LeaseLost):
                self._lose(self._channel)
            elif isinstance(error, StaleEpoch):
                self.fence()
            elif self._lost and isinstance(error, NotAttached):  # the heartbeat acked first
                raise LeaseLost("this session's lease was lost; reconnect() to attach again")
            raise error
        if reply.result is None:
            raise InternalError(f"reply to {type(body).__name__} has neither result nor error")
        return reply.result


def no_daemon(endpoint: str) -> str:
    """What to tell a user whose daemon is gone (or was never started)."""
    return f"no daemon answers on {endpoint} — start one with `kvcore serve`"


def _check_endpoint(endpoint: str, trusted: set[int]) -> set[int]:
    """The uids whose segments this client maps: ``trusted``, and the owner of the ipc://
    socket once it passed :func:`kvcore.paths.check_socket_path`."""
    if not endpoint.startswith("ipc://"):
        return trusted
    path = endpoint[len("ipc://") :]
    check_socket_path(path, trusted, creating=False)
    try:
        return trusted | {os.stat(path).st_uid}
    except FileNotFoundError:  # not started yet, in a directory only trusted uids write
        return trusted


class Batch:
    """Operations collected for one round trip; ``run()`` (or leaving ``with``) sends them.

    Each method queues the Manager operation of the same name (kvcore.ops); run()
    returns their results in order, as the Manager returns them.

    Not atomic (spec/protocol.md): the ops run in order and the first failing op
    stops the batch; it changed nothing. Then run() raises a
    :class:`~kvcore.errors.BatchFailed` that is also that op's typed error
    (``except OutOfPages`` catches it), with ``error.batch_index`` (its index),
    ``error.batch_results`` (the results of the ops before it) and ``error.error``
    (the op's error alone); an op that would take the batch's work over
    ``max_request_tokens`` fails the same way. A request refused as a whole (more
    tokens carried than ``max_request_tokens``, too many ops) raises the plain typed
    error: nothing ran.
    """

    allocate = Queued(ops.allocate)
    extend = Queued(ops.extend)
    commit = Queued(ops.commit)
    fork = Queued(ops.fork)
    free = Queued(ops.free)
    lookup = Queued(ops.lookup)
    block_table = Queued(ops.block_table)
    num_tokens = Queued(ops.num_tokens)
    allocate_pages = Queued(ops.allocate_pages)
    lookup_pages = Queued(ops.lookup_pages)
    commit_pages = Queued(ops.commit_pages)

    def __init__(self, client: Client) -> None:
        self._client = client
        self._ops: list[tuple[Operation[Any, Any], msg.BatchOp]] = []
        self.results: list[Any] = []

    def __len__(self) -> int:
        return len(self._ops)

    def queue_op(self, op: Operation[Any, Any], request: msg.BatchOp) -> None:
        self._ops.append((op, request))

    def run(self) -> list[Any]:
        """Send the ops; the list of their results (the Manager's result types)."""
        queued, self._ops = self._ops, []
        requests = msg.Batch([request for _, request in queued])
        if any(op.ends is not None for op, _ in queued):  # pages go back to the daemon
            self._client._wait_for_gpu()
        kinds = {op for op, _ in queued}
        error: msg.ErrorBody | None
        if len(kinds) == 1:  # one scheduler step is usually all extends: decode in one pass
            op = kinds.pop()
            typed: msg.TypedBatchOk[Any] = self._client._call(
                requests,
                msg.TypedBatchOk[op.result],  # type: ignore[name-defined]
            )
            self.results = [op.decode(r) for r in typed.results]
            error = typed.error
        else:
            codec = self._client._codec
            raw = self._client._call(requests, msg.RawBatchOk)
            self.results = [
                op.decode(codec.decode_result(r, op.result))
                for (op, _), r in zip(queued, raw.results, strict=False)
            ]
            error = raw.error
        if error is not None:
            cause = error_from_code(error.code, error.message)
            raise batch_failed(cause, len(self.results), self.results)
        return self.results

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.run()


class _Heartbeat:
    """Renews the client's lease from a thread with its own socket."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvcore-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """Beat every third of the lease. An answer ``lease_lost`` (or ``not_attached``
        while the client thinks it is attached) fences the client at once. Each beat has
        its own request id: a beat sent while the daemon was down is answered late, by
        the next daemon (``stale_epoch``, for the session of then), and that answer must
        not pass for a later beat's (it fenced a reconnected session's valid mapping:
        writes went to scratch while commits succeeded)."""
        client = self._client
        channel = client.open_channel()
        encoder = msgspec.msgpack.Encoder()
        decoder = msgspec.msgpack.Decoder(msg.TypedReply[msg.Empty])
        beat = 0
        try:
            while not self._stopped.wait(max(client.lease_s / 3, 0.01)):
                session = client.session
                if not session or client._lost:
                    continue
                beat += 1
                request = msg.Request(beat, msg.Heartbeat(), session, client.epoch)
                channel.send(encoder.encode(request))
                try:
                    while (reply := decoder.decode(channel.recv())).id != beat:
                        pass  # an earlier beat's late answer
                except ChannelTimeout:
                    continue  # the daemon is busy or gone; the next beat tries again
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                code = reply.error.code if reply.error is not None else ""
                if code in (LeaseLost.code, NotAttached.code) and session == client.session:
                    client._lose(channel)
                elif code == StaleEpoch.code and session == client.session:
                    client.fence()  # the daemon restarted (Client.fence)
        finally:
            channel.close()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
