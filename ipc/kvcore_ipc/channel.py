"""The engine side's DEALER channel: one request in flight, timeouts, CURVE.

A channel is owned by one thread (ZeroMQ sockets are not thread-safe); a
heartbeat thread opens its own channel. The channel moves bytes only: the
caller matches reply ids and discards late replies of timed-out requests.
"""

from __future__ import annotations

import zmq


class ChannelTimeout(TimeoutError):
    """No reply within the timeout."""


class DealerChannel:
    """A DEALER socket connected to a daemon endpoint."""

    __slots__ = ("_rcvtimeo", "_socket", "endpoint", "timeout_ms")

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_ms = max(1, int(timeout_s * 1000))
        sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key is not None:
            public, secret = curve_keypair or zmq.curve_keypair()
            sock.curve_serverkey = curve_server_key
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(endpoint)
        self._socket = sock
        self._rcvtimeo = -1

    def send(self, frame: bytes) -> None:
        self._socket.send(frame)

    def recv(self, timeout_ms: int | None = None) -> bytes:
        """The next frame; ChannelTimeout after ``timeout_ms`` (default: the channel's)."""
        sock = self._socket
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        if timeout != self._rcvtimeo:
            sock.setsockopt(zmq.RCVTIMEO, timeout)
            self._rcvtimeo = timeout
        try:
            frame: bytes = sock.recv()
        except zmq.Again:
            raise ChannelTimeout(f"no reply from {self.endpoint} in {timeout} ms") from None
        return frame

    def close(self) -> None:
        self._socket.close(linger=0)
