"""The PUB stream of page-stored / page-removed events, for KV-aware routers.

Each message is two frames: ``[topic, payload]``; the topic is the pool name
(UTF-8) followed by one NUL byte, so a subscription to :func:`topic`
(ZeroMQ matches topic prefixes) receives that pool's events and no other
pool's whose name merely starts the same way; the payload is one msgpack map,
an :class:`~kvcore_ipc.messages.EventBatch`: the events one request caused on
one pool, numbered from ``first_seq_no``. Numbers count a pool's events from 1
without gaps within one epoch: a gap tells a subscriber it lost events (PUB
drops on a slow subscriber) and should rebuild its view from a snapshot.

The PUB socket is secured like the request socket: an ipc:// socket file is
the daemon user's alone (mode 0600, bound under umask 077); on tcp:// it is a
CURVE server whose subscribers the daemon's ZAP handler admits
(``zap_domain``). What it buffers per subscriber is bounded: ``max_messages``
(ZMQ_SNDHWM) messages, then a slow subscriber loses events (a gap).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import msgspec
import zmq

from kvcore_ipc.messages import EventBatch
from kvcore_ipc.sockets import bind_private, close_unlinking, curve_client, curve_server


def topic(pool: str) -> bytes:
    """The first frame of a pool's events: its name and a NUL terminator."""
    return pool.encode() + b"\0"


class Publisher(Protocol):
    """What the daemon publishes through: this module's EventPublisher (kvcore's format)
    or kvcore_ipc.vllm_events.VllmEventPublisher (vLLM's)."""

    endpoint: str

    def publish(self, batch: EventBatch) -> None: ...
    def close(self) -> None: ...


class EventPublisher:
    """A PUB socket; publishing never blocks (a slow subscriber loses events)."""

    __slots__ = ("_encoder", "_socket", "endpoint")

    def __init__(
        self,
        endpoint: str,
        *,
        max_messages: int = 1000,
        curve_secret_key: bytes | None = None,
        zap_domain: str = "",
    ) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, max_messages)
        curve_server(sock, curve_secret_key, zap_domain)
        self.endpoint = bind_private(sock, endpoint)
        self._socket = sock
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, batch: EventBatch) -> None:
        payload = self._encoder.encode(batch)
        with contextlib.suppress(zmq.Again):  # dropped: the subscriber sees a seq_no gap
            self._socket.send_multipart((topic(batch.pool), payload), zmq.NOBLOCK)

    def close(self) -> None:
        """Close the socket and remove an ipc:// socket file."""
        close_unlinking(self._socket, self.endpoint)


class EventSubscriber:
    """A SUB socket on a daemon's event endpoint, optionally filtered to one pool."""

    __slots__ = ("_decoder", "_socket")

    def __init__(
        self,
        endpoint: str,
        pool: str | None = None,
        *,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
    ) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        curve_client(sock, curve_server_key, curve_keypair)
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"" if pool is None else topic(pool))
        self._socket = sock
        self._decoder = msgspec.msgpack.Decoder(EventBatch)

    def recv(self, timeout_ms: int) -> EventBatch | None:
        """The next batch of events, or None after ``timeout_ms``."""
        if not self._socket.poll(timeout_ms):
            return None
        _topic, payload = self._socket.recv_multipart()
        batch: EventBatch = self._decoder.decode(payload)
        return batch

    def drain(self, timeout_ms: int = 0) -> Iterator[EventBatch]:
        while (batch := self.recv(timeout_ms)) is not None:
            yield batch

    def close(self) -> None:
        self._socket.close(linger=0)
