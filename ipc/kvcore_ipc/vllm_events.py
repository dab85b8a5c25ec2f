"""kvcore's page events in vLLM's KV-event format, for routers that read vLLM's stream.

What vLLM's ``ZmqEventPublisher`` publishes, frame for frame (spec/vllm-events.md):
each message is three frames ``[topic, seq, payload]``: ``topic`` (UTF-8, default
empty), ``seq`` an 8-byte big-endian batch number, +1 per message, counting from the
publisher's start time in nanoseconds (vLLM counts from 0; see :class:`VllmEventPublisher`),
and ``payload`` a msgpack ``EventBatch`` ``[ts, events]`` whose events are tagged
maps (``"type"``): ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``, and
``extra_keys`` when a block has any), ``BlockRemoved`` (``block_hashes``,
``medium``) and ``AllBlocksCleared``.

A block hash is the low 64 bits of kvcore's 32-byte page key read big-endian, as
vLLM derives its integer block hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
Consecutive stored pages of one chain become one ``BlockStored``.

Key spaces (spec/hashing.md: namespace, model, LoRA adapter, cache salt) are
carried as vLLM carries a request's adapter and salt, so that a consumer that
hashes tokens itself (Dynamo's indexer) keeps them apart; a router queries with
the same values. (Block hashes come from kvcore's keys, which hash the whole key
space: what follows only labels them, it never decides what a page holds.)

* ``lora_name`` (:func:`lora_name_of`), for a key space without a model: the
  adapter name in the default namespace; the namespace when a page of another
  namespace has no adapter (as before adapters existed); the namespace, one NUL
  character and the adapter for both; None for neither. With a model (every
  engine's pages since model identities exist): the namespace, the adapter and
  the model, joined by NUL characters (three parts, so never one of the forms
  before).
* ``extra_keys``, one entry per block as vLLM publishes them (untagged): the
  ``lora_name`` on every block of an adapter's or a model's chain, then the salt on the
  chain's first page (the block whose parent is the root); None for a block
  with neither, and no ``extra_keys`` at all for a batch without any. Dynamo
  1.6.1 reads a salt from the first block's entries only if it starts with
  ``"dynamo-cache-salt:"`` (what its frontend hands vLLM as ``cache_salt``) and
  answers ``/query`` with ``cache_salt`` = the rest; a later event of the chain
  inherits it from its parent block.

The replay socket (a ROUTER, as vLLM's ``replay_endpoint``) answers a request
``[b"", seq as 8 bytes big-endian]`` with every buffered message numbered from
``seq`` on, as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1 as 8 bytes, b""]``.

This module knows nothing of kvcore beyond :mod:`kvcore_ipc.messages`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from kvcore_ipc.messages import EventBatch, PageRemovedEvent, PageStoredEvent
from kvcore_ipc.sockets import bind_private, close_unlinking

DEFAULT_NAMESPACE = "default"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REMIND_FOR_S = 30.0  # after a start, the last message is repeated while nothing else goes out
REMIND_EVERY_S = 1.0  # ... at most this often (see VllmEventPublisher.remind)
MEDIUMS = ("GPU", "CPU")


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """vLLM's ``BlockStored`` (fields without defaults are always on the wire)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block (vLLM's untagged extra keys): adapter, then salt; see the module.
    extra_keys: list[list[str] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM's ``KVEventBatch``: ``[ts, events]`` (``data_parallel_rank`` omitted)."""

    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


def lora_name_of(namespace: str, lora: str, model: str = "") -> str | None:
    """The ``lora_name`` of a key space's stored events (module docstring)."""
    namespace = namespace or DEFAULT_NAMESPACE
    if model:
        return f"{namespace}\0{lora}\0{model}"
    if namespace == DEFAULT_NAMESPACE:
        return lora or None
    return f"{namespace}\0{lora}" if lora else namespace


def block_hash(key: bytes) -> int:
    """A page key's 64-bit block hash: its low 8 bytes, big-endian (vLLM's rule)."""
    return int.from_bytes(key[-8:], "big")


def to_vllm(batch: EventBatch, page_size: int, medium: str | None) -> list[VllmEvent]:
    """The batch's events as vLLM events, in order; chained stores of one key space merged."""
    out: list[VllmEvent] = []
    last_key = b""
    for event in batch.events:
        if isinstance(event, PageStoredEvent):
            tokens = list(event.tokens)
            namespace = event.namespace or DEFAULT_NAMESPACE
            lora = lora_name_of(namespace, event.lora, event.model)
            first = event.parent == root_key(namespace, event.model, event.lora, event.salt)
            labelled = event.lora or event.model
            extra = _extra_keys(lora if labelled else None, event.salt if first else "")
            prev = out[-1] if out else None
            if (
                isinstance(prev, BlockStored)
                and event.parent == last_key
                and prev.lora_name == lora
            ):
                prev.block_hashes.append(block_hash(event.key))
                prev.token_ids.extend(tokens)
                _append_extra(prev, extra)
            else:
                parent = None if first else block_hash(event.parent)
                size = len(tokens) or page_size  # a stored event carries one page of tokens
                stored = BlockStored(
                    [block_hash(event.key)], parent, tokens, size, None, medium, lora
                )
                _append_extra(stored, extra)
                out.append(stored)
            last_key = event.key
        elif isinstance(event, PageRemovedEvent):
            prev = out[-1] if out else None
            if isinstance(prev, BlockRemoved):
                prev.block_hashes.append(block_hash(event.key))
            else:
                out.append(BlockRemoved([block_hash(event.key)], medium))
            last_key = b""
    return out


def _extra_keys(lora_name: str | None, salt: str) -> list[str] | None:
    """One block's ``extra_keys`` entry: its ``lora_name``, then its salt (vLLM's order)."""
    keys = [key for key in (lora_name, salt) if key]
    return keys or None


def _append_extra(stored: BlockStored, extra: list[str] | None) -> None:
    """Add the entry of ``stored``'s newest block (its last block hash) to its extra_keys,
    which stay None while every block's entry is None."""
    if extra is None and stored.extra_keys is None:
        return
    if stored.extra_keys is None:
        stored.extra_keys = [None] * (len(stored.block_hashes) - 1)
    stored.extra_keys.append(extra)


@functools.lru_cache(maxsize=1024)
def root_key(namespace: str, model: str = "", lora: str = "", salt: str = "") -> bytes:
    """The key space's root key (spec/hashing.md), the parent of a chain's first page."""
    message = b"kvcore/prefix/v1" + _tlv(0x01, namespace)
    if model:
        message += _tlv(0x06, model)
    if lora:
        message += _tlv(0x04, lora)
    if salt:
        message += _tlv(0x05, salt)
    return hashlib.sha256(message).digest()


def _tlv(tag: int, value: str) -> bytes:
    raw = value.encode("utf-8")
    return bytes([tag]) + len(raw).to_bytes(4, "little") + raw


class VllmEventPublisher:
    """A PUB socket (+ an optional ROUTER replay socket) speaking vLLM's KV events.

    ``publish`` never blocks (a slow subscriber loses messages and sees a gap in
    ``seq``; it can ask the replay socket for the last ``buffer`` messages).
    ``BlockStored.block_size`` is the number of tokens a stored event carries (one
    page), ``page_size`` when it carries none; ``medium`` is ``"GPU"`` or ``"CPU"``
    (where the pools live), ``mediums`` overrides it per pool name.
    A batch of a new epoch is preceded by ``AllBlocksCleared``; :meth:`cleared`
    sends one explicitly (a daemon start).

    Messages are numbered from the publisher's start time in nanoseconds, not from 0 as
    vLLM's are: a subscriber that followed the last daemon on this endpoint drops every
    number up to the last it saw as already seen (Dynamo's indexer does), so a restarted
    daemon that counted from 0 again went unheard, its AllBlocksCleared and re-adopted
    pages included. Numbered above the last daemon's, its first message is a gap to such
    a subscriber, which replays the new daemon's messages from the replay socket.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        page_size: int = 16,
        medium: str | None = "GPU",
        mediums: dict[str, str] | None = None,
        topic: str = "",
        buffer: int = 10_000,
    ) -> None:
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint: str = bind_private(self._pub, endpoint)  # ipc://: 0600 from the start
        self.page_size = page_size
        self.medium = medium
        self.mediums = dict(mediums or {})
        self._topic = topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = time.time_ns()  # above any number an earlier publisher reached
        self._started = self._sent_at = time.monotonic()
        self._last: tuple[bytes, bytes] | None = None  # (seq frame, payload) last sent
        self._epoch: int | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._replay = zmq.Context.instance().socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = bind_private(self._replay, replay_endpoint)
            self._thread = threading.Thread(
                target=self._serve_replay, name="kvcore-vllm-replay", daemon=True
            )
            self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Publish one kvcore batch (nothing if it maps to no vLLM event)."""
        if self._epoch is not None and batch.epoch != self._epoch:
            self.cleared()
        self._epoch = batch.epoch
        events = to_vllm(batch, self.page_size, self.mediums.get(batch.pool, self.medium))
        if events:
            self._send(events)

    def cleared(self) -> None:
        """Publish ``AllBlocksCleared``: subscribers drop what this publisher stored."""
        self._send([AllBlocksCleared()])

    def remind(self, now: float) -> None:
        """For REMIND_FOR_S seconds (``time.monotonic()``) after the start, send the last
        message again, with its number, once a REMIND_EVERY_S in which nothing else
        went out. A PUB socket sends nothing to a subscriber before it has (re)joined,
        and a subscriber asks for a replay only at a message whose number shows a gap:
        so a router that rejoins a restarted daemon, or joins it late, learns its start
        (AllBlocksCleared, re-adopted pages) from the replay socket even if the daemon
        then publishes nothing. A subscriber that had the message drops it as seen."""
        last = self._last
        if (
            last is None
            or now - self._started > REMIND_FOR_S
            or now - self._sent_at < REMIND_EVERY_S
        ):
            return
        self._sent_at = now
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, *last), zmq.NOBLOCK)

    def close(self) -> None:
        """Stop the replay thread, close both sockets, remove ipc:// socket files."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sock, endpoint in ((self._pub, self.endpoint), (self._replay, self.replay_endpoint)):
            if sock is None:
                continue
            close_unlinking(sock, endpoint)

    def _send(self, events: list[Any]) -> None:
        payload = self._encoder.encode(VllmEventBatch(time.time(), events))
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        self._last, self._sent_at = (seq.to_bytes(8, "big"), payload), time.monotonic()
        with contextlib.suppress(zmq.Again):  # dropped: the subscriber sees a seq gap
            self._pub.send_multipart((self._topic, *self._last), zmq.NOBLOCK)

    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3:
                continue  # not a replay request
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                buffered = [(s, p) for s, p in self._buffer if s >= first]
            for seq, payload in buffered:
                sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", b"", END_SEQ, b""))
