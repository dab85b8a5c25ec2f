"""The engine side's DEALER channel: one request in flight, timeouts, CURVE.

A channel is owned by one thread (ZeroMQ sockets are not thread-safe); a
heartbeat thread opens its own channel. The channel moves bytes only: the
caller matches reply ids and discards late replies of timed-out requests.

A wait longer than ``PROBE_MS`` checks that something still listens at the
endpoint (:func:`listening`): when the operating system says nobody does (no
socket file, connection refused) the wait ends at once with :class:`NoListener`,
instead of running out the whole timeout against a daemon that is gone. On an
ipc:// endpoint it also checks that the listener is still the one the channel
last knew (the socket file's identity): a request sent to a daemon that has
since stopped is never answered, even when a new daemon listens on the path
by now (a restart, a takeover), so the wait ends with :class:`Replaced`.
"""

from __future__ import annotations

import errno
import os
import socket

import zmq

from kvcore_ipc.sockets import curve_client

PROBE_MS = 100  # a reply not here after this long: check that the endpoint still listens
RECONNECT_MS = 10  # a lost connection is tried again after this long, doubling per failure
RECONNECT_MAX_MS = 100  # ... up to this (ZeroMQ's default: 100 ms, always)


class ChannelTimeout(TimeoutError):
    """No reply within the timeout."""


class NoListener(ChannelTimeout):
    """Nothing listens at the endpoint any more (or yet): no reply will come."""


class Replaced(NoListener):
    """Another listener took the endpoint's path since the channel last knew it: the
    daemon that had the request is gone, and its reply with it."""


def listener_identity(endpoint: str) -> tuple[int, int, int] | None:
    """(device, inode, change time in ns) of an ipc:// endpoint's socket file: a new
    daemon's file may reuse its predecessor's inode number, never also the moment it
    was made (bound, then chmod-ed); None for other transports or no file."""
    if not endpoint.startswith("ipc://"):
        return None
    try:
        st = os.stat(endpoint[len("ipc://") :])
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def listening(endpoint: str) -> bool:
    """False only if the operating system says nothing accepts connections at ``endpoint``
    (an ipc:// path with no socket or a dead one's file; a refused tcp:// port); True
    when something does, and when it cannot tell (other transports, an unreachable host)."""
    try:
        if endpoint.startswith("ipc://"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(endpoint[len("ipc://") :])
        elif endpoint.startswith("tcp://"):
            host, _, port = endpoint[len("tcp://") :].rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=0.2):
                pass
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except OSError as exc:
        return exc.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK)
    except ValueError:  # a port that is not a number: let ZeroMQ say what is wrong
        return True
    return True


class DealerChannel:
    """A DEALER socket connected to a daemon endpoint."""

    __slots__ = ("_listener", "_rcvtimeo", "_socket", "endpoint", "timeout_ms")

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
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)  # a restarted daemon is found at once
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        curve_client(sock, curve_server_key, curve_keypair)
        self._listener = listener_identity(endpoint)  # None: not known yet
        sock.connect(endpoint)
        self._socket = sock
        self._rcvtimeo = -1

    def send(self, frame: bytes) -> None:
        self._socket.send(frame)

    def recv(self, timeout_ms: int | None = None) -> bytes:
        """The next frame; ChannelTimeout after ``timeout_ms`` (default: the channel's),
        NoListener as soon as a wait over PROBE_MS finds nothing listening, Replaced as
        soon as it finds another listener (which it then knows as the endpoint's)."""
        sock = self._socket
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        waited = 0
        while True:
            step = min(timeout - waited, PROBE_MS)
            if step != self._rcvtimeo:
                sock.setsockopt(zmq.RCVTIMEO, step)
                self._rcvtimeo = step
            try:
                frame: bytes = sock.recv()
            except zmq.Again:
                waited += step
                if waited >= timeout:
                    raise ChannelTimeout(f"no reply from {self.endpoint} in {timeout} ms") from None
                if not listening(self.endpoint):
                    raise NoListener(f"nothing listens on {self.endpoint}") from None
                self._check_listener()
                continue
            return frame

    def relearn(self) -> None:
        """Know the endpoint's current listener as the one this channel talks to: before a
        request that any daemon may answer (an attach), so that only a change after it
        ends a wait with Replaced."""
        self._listener = listener_identity(self.endpoint)

    def _check_listener(self) -> None:
        now = listener_identity(self.endpoint)
        known, self._listener = self._listener, now or self._listener
        if known is not None and now is not None and now != known:
            raise Replaced(
                f"the daemon on {self.endpoint} was replaced: the one that had the request is gone"
            )

    def close(self) -> None:
        self._socket.close(linger=0)
