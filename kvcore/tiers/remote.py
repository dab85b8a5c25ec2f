"""RemoteTier: pages shared by daemons on many nodes through Mooncake Store (TCP).

Each page is one store object, framed like a disk entry::

    without a secret   object key "kvcore/v1/<tier key hex>"   (layout fingerprint || prefix key)
                       value      80-byte header || page, checksummed (kvcore.tiers.codec)
    with a keyring     object key "kvcore/s1/<HMAC(name key, tier key) hex>"  (kvcore.tiers.secret)
                       value      80-byte header || page (or its ciphertext), MAC'd (kvcore.tiers.keyed)

Mooncake trusts every client of its master: any process that reaches the
master's RPC port can put, upsert (replace) or remove any object, and its HTTP
metadata port lists them. Without a secret this tier trusts them all back (a
warning at start; the daemon refuses it unless ``--insecure-remote-tier``,
kvcore.config): a peer can publish a well-framed page under a key it
computed, or replace a page another daemon published. With the deployment's
secret (``keyring``), a page verifies only if a holder of the secret wrote it
for that very key (a forged, replaced or moved object is a counted corrupt
miss, never wrong K/V) and names reveal nothing of the prefix. During a
rotation a read tries the current secret's names, then the previous one's,
inside the same bounded call (docs/tiers.md, "Authentication").

Where the time goes, and its bounds:

* ``put_many`` (publish) only enqueues a copy of the pages on a bounded queue
  (``queue_pages`` pages; a full queue drops the batch, counted in
  ``dropped``); a publisher thread frames and writes them (``put_batch`` in
  chunks of at most ``buffer_bytes``, the client's staging buffer).
* ``match`` (one ``batch_is_exist``) and ``get_many`` (``get_batch`` in
  chunks) run on one reader thread; the caller waits at most ``timeout_s``.
  A call past the bound is abandoned (``timeouts``) and, while it is still
  running, later calls do not queue behind it: they miss at once. A store that
  is down, slow or returns a bad object costs a counted miss, never an
  exception and never a wait longer than ``timeout_s``.
* The connection (``setup``) is made on the reader thread when the tier is
  built, only once both servers accept TCP (``setup`` holds the GIL while it
  retries an absent master: kvcore.tiers.worker); until it succeeds every call
  misses (:meth:`RemoteTier.wait_ready`), and it is retried every ``retry_s``.
* ``close`` leaves a healthy store within ``2 x timeout_s``; a store whose
  master is gone is closed at process exit instead (it would hold the GIL).

Mooncake keeps objects in memory segments that its clients contribute
(``segment_bytes`` here): a daemon that leaves takes its segment's share of
the objects with it; the master evicts under memory pressure. Either is a miss.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.tiers.base import TierKey, TierStats, check_keys, check_pages, layout_fingerprint
from kvcore.tiers.codec import HEADER_BYTES, Checksummed, Framing
from kvcore.tiers.keyed import Keyed
from kvcore.tiers.secret import Keyring
from kvcore.tiers.transfer import byte_view, pages_from_bytes
from kvcore.tiers.worker import Worker, abandon, accepts

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
log = logging.getLogger("kvcore.tiers")
MIN_SEGMENT_BYTES = 16 << 20  # the store refuses smaller segments and buffers
OBJECT_PREFIX = "kvcore/v1/"


def mooncake_available() -> bool:
    """True iff ``mooncake.store`` imports (the mooncake-transfer-engine package)."""
    try:
        importlib.import_module("mooncake.store")
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """Where the store is, and the bounds. Sizes in bytes, times in seconds."""

    master: str  # the master's RPC address, "host:port"
    metadata_server: str  # "http://host:port/metadata" (the master's built-in server)
    local_hostname: str = "127.0.0.1"  # this node's address as the store's peers reach it
    segment_bytes: int = 64 << 20  # memory this daemon contributes to the store
    buffer_bytes: int = 32 << 20  # the client's staging buffer; bounds one put/get chunk
    timeout_s: float = 1.0  # the longest a caller ever waits on the store
    retry_s: float = 5.0  # after a failed connection, the pause before the next try
    queue_pages: int = 1024  # publish queue bound, in pages

    def __post_init__(self) -> None:
        if self.segment_bytes < MIN_SEGMENT_BYTES or self.buffer_bytes < MIN_SEGMENT_BYTES:
            raise BadRequest(f"segment_bytes and buffer_bytes must be >= {MIN_SEGMENT_BYTES}")
        if not self.timeout_s > 0 or self.queue_pages < 1:
            raise BadRequest("timeout_s must be > 0 and queue_pages >= 1")


def object_key(key: TierKey) -> str:
    """The store's key of a tier key without a secret (anyone can compute it)."""
    return OBJECT_PREFIX + key.hex()


def object_names(keyring: Keyring | None, keys: Sequence[TierKey]) -> list[list[str]]:
    """The names a read tries for ``keys``: one list per accepted secret (current
    first), or the unkeyed names. A write uses the first list."""
    if keyring is None:
        return [[object_key(key) for key in keys]]
    return [[secret.object_name(key) for key in keys] for secret in keyring.accepted()]


class RemoteTier:
    """A Mooncake Store client with bounded waits. Call from one thread; :meth:`close` it."""

    medium = "remote"

    def __init__(
        self, layout: KVLayout, config: RemoteConfig, *, keyring: Keyring | None = None
    ) -> None:
        self.layout = layout
        self.fingerprint = layout_fingerprint(layout)
        self.config = config
        self._page_bytes = layout.page_bytes
        self._entry_bytes = HEADER_BYTES + layout.page_bytes
        if self._entry_bytes > config.buffer_bytes // 2:
            raise BadRequest(
                f"buffer_bytes {config.buffer_bytes} is too small for pages of {self._page_bytes} bytes"
            )
        self._chunk = config.buffer_bytes // 2 // self._entry_bytes  # entries per store call
        self.keyring = keyring
        self._framing: Framing = Checksummed() if keyring is None else Keyed(keyring)
        if keyring is None:
            log.warning(
                "remote tier on %s without a secret_file: it trusts every client of the "
                "master, any of which can forge or replace the pages it reads (docs/security.md)",
                config.master,
            )
        self._lock = threading.Lock()  # guards _stats and _queued
        self._stats = TierStats()
        self._queued = 0  # pages on the publish queue
        self._closed = False
        self._store: Any = None  # a MooncakeDistributedStore once connected (reader thread)
        self._retry_at = time.monotonic() + config.retry_s
        self._reader = Worker("kvcore-remote-read")
        self._inflight: Future[Any] | None = None
        self._ready: Future[bool] = self._reader.submit(self._connect)
        self._queue: queue.Queue[_Batch | _Flush | None] = queue.Queue()
        self._publisher = threading.Thread(
            target=self._publish_loop, name="kvcore-remote-put", daemon=True
        )
        self._publisher.start()

    # -- the tier ---------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the connection; True iff connected."""
        try:
            return self._ready.result(timeout=timeout_s)
        except FutureTimeout:
            return False

    def match(self, keys: Sequence[TierKey]) -> int:
        """Leading ``keys`` the store holds (one batched existence check); 0 when the
        store is unreachable or slow (counted in ``timeouts``)."""
        check_keys(self.fingerprint, keys)
        if not keys:
            return 0
        found = self._bounded(self._exist, object_names(self.keyring, keys))
        count = 0
        for flags in zip(*found, strict=False) if found else ():
            if 1 not in flags:
                break
            count += 1
        return count

    def get_many(self, keys: Sequence[TierKey]) -> torch.Tensor:
        check_keys(self.fingerprint, keys)
        names = object_names(self.keyring, keys)
        blobs = self._bounded(self._get_chunks, names) if keys else []
        page_bytes = self._page_bytes
        buffer = bytearray(len(blobs or ()) * page_bytes)
        view = memoryview(buffer)
        count = corrupt = 0
        for key, blob in zip(keys, blobs or (), strict=False):
            if not blob:
                break
            raw = memoryview(blob)
            page = view[count * page_bytes : (count + 1) * page_bytes]
            if len(raw) != self._entry_bytes:
                corrupt = 1
                break
            page[:] = raw[HEADER_BYTES:]
            if not self._framing.unseal(key, raw[:HEADER_BYTES], page, page_bytes):
                corrupt = 1
                break
            count += 1
        with self._lock:
            stats = self._stats
            stats.hits += count
            stats.misses += len(keys) - count
            stats.corrupt += corrupt
            stats.bytes_out += count * page_bytes
        return pages_from_bytes(buffer, count, self.layout)

    def put_many(self, keys: Sequence[TierKey], pages: torch.Tensor) -> list[TierKey]:
        """Publish in the background: enqueue a copy of ``pages`` and return at once.
        Nothing is evicted here (the store evicts on its own): returns []."""
        check_keys(self.fingerprint, keys)
        check_pages(self.layout, keys, pages)
        if not keys:
            return []
        with self._lock:
            if self._closed or self._queued + len(keys) > self.config.queue_pages:
                self._stats.dropped += len(keys)
                return []
            self._queued += len(keys)
        self._queue.put(_Batch(list(keys), pages.contiguous().clone()))
        return []

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until the publish queue is empty (tests, shutdown)."""
        marker = _Flush(threading.Event())
        self._queue.put(marker)
        return marker.done.wait(timeout_s)

    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.copy()

    def check_integrity(self) -> None:
        with self._lock:
            assert 0 <= self._queued <= self.config.queue_pages, "publish queue over its bound"

    def close(self) -> None:
        """Stop the threads and leave the store, waiting at most ``timeout_s`` in all."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._publisher.join(self.config.timeout_s)
        if self._connected():
            health = self._reader.submit(self._store.health_check)
            closed: Future[Any] | None = None
            with contextlib.suppress(FutureTimeout):
                if health.result(timeout=self.config.timeout_s) == 0:
                    closed = self._reader.submit(self._store.close)
                    closed.result(timeout=self.config.timeout_s)
            if closed is None or not closed.done():
                abandon(self._store)
        self._reader.stop()

    # -- threads ----------------------------------------------------------------

    def _connected(self) -> bool:
        return self._ready.done() and self._ready.result()

    def _connect(self) -> bool:
        """Join the store (on the reader thread). The binding's ``setup`` holds the GIL
        while it retries an absent master (about 90 s), stalling every thread of the
        process, so it is called only after both servers accepted a TCP connection."""
        config = self.config
        metadata = urlsplit(config.metadata_server)
        master_host, _, master_port = config.master.rpartition(":")
        if not (
            accepts(master_host, master_port, config.timeout_s)
            and accepts(metadata.hostname or "", str(metadata.port or 80), config.timeout_s)
        ):
            return False
        store = importlib.import_module("mooncake.store").MooncakeDistributedStore()
        try:
            code = store.setup(
                {
                    "local_hostname": config.local_hostname,
                    "metadata_server": config.metadata_server,
                    "global_segment_size": config.segment_bytes,
                    "local_buffer_size": config.buffer_bytes,
                    "protocol": "tcp",
                    "rdma_devices": "",
                    "master_server_addr": config.master,
                }
            )
        except Exception:  # a malformed address: the tier stays down, every call misses
            code = -1
        if code != 0:
            abandon(store)  # a half-set-up store must not be destroyed either (worker.py)
            return False
        self._store = store
        return True

    def _reconnect(self) -> None:
        """After a failed connection, try again at most every ``retry_s`` (not waited on)."""
        now = time.monotonic()
        if self._ready.done() and not self._ready.result() and now >= self._retry_at:
            self._retry_at = now + self.config.retry_s
            self._ready = self._reader.submit(self._connect)

    def _bounded(self, call: Callable[[list[list[str]]], T], names: list[list[str]]) -> T | None:
        """``call(names)`` on the reader thread, waited on for at most ``timeout_s``."""
        busy = self._inflight is not None and not self._inflight.done()
        if not busy and not self._closed:
            self._reconnect()
        if busy or not self._connected() or self._closed:
            self._count_timeout()
            return None
        future = self._reader.submit(lambda: call(names))
        self._inflight = future
        try:
            return future.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            self._count_timeout()
        except Exception:  # the binding raised: the store failed, which is a miss
            self._count_timeout()
        return None

    def _count_timeout(self) -> None:
        with self._lock:
            self._stats.timeouts += 1

    def _exist(self, names: list[list[str]]) -> list[list[int]]:
        """One batch_is_exist for every accepted secret's names; flags per secret."""
        flat: list[int] = self._store.batch_is_exist([name for row in names for name in row])
        count = len(names[0])
        return [list(flat[i * count : (i + 1) * count]) for i in range(len(names))]

    def _get_chunks(self, names: list[list[str]]) -> list[bytes]:
        """get_batch in chunks that fit the staging buffer, each key's object under the
        first accepted secret that has one; stops at the first key none has."""
        blobs: list[bytes] = []
        for start in range(0, len(names[0]), self._chunk):
            end = min(start + self._chunk, len(names[0]))
            got: list[bytes] = list(self._store.get_batch(names[0][start:end]))
            for other in names[1:]:
                absent = [i for i, blob in enumerate(got) if not blob]
                if not absent:
                    break
                found = self._store.get_batch([other[start + i] for i in absent])
                for i, blob in zip(absent, found, strict=True):
                    got[i] = blob
            blobs.extend(got)
            if not all(got):
                break
        return blobs

    def _publish_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Flush):
                item.done.set()
                continue
            keys = item.keys
            stored = self._publish(keys, item.pages) if self._ready.result() else 0
            with self._lock:
                self._queued -= len(keys)
                self._stats.stored += stored
                self._stats.pages += stored
                self._stats.bytes_in += stored * self._page_bytes
                self._stats.dropped += len(keys) - stored

    def _publish(self, keys: list[TierKey], pages: torch.Tensor) -> int:
        """Frame and put ``pages``; returns how many the store accepted."""
        stored = 0
        for start in range(0, len(keys), self._chunk):
            rows = keys[start : start + self._chunk]
            names, values = object_names(self.keyring, rows)[0], []
            for row, key in enumerate(rows, start):
                header, body = self._framing.seal(key, byte_view(pages[row]))
                values.append(header + body)
            try:
                code = self._store.put_batch(names, values)
            except Exception:
                code = -1
            if code == 0:
                stored += len(names)
        return stored


@dataclass(slots=True)
class _Batch:
    """Pages to publish: a private copy, ``[len(keys), *stored_page_shape]``."""

    keys: list[TierKey]
    pages: torch.Tensor


@dataclass(slots=True)
class _Flush:
    """A queue item that flush() waits for: everything before it has been published."""

    done: threading.Event
