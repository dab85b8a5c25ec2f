"""The daemon's ROUTER loop: framing, socket security, and a clean stop.

Framing (spec/protocol.md, "Framing"): a DEALER peer sends one frame, the
msgpack request; the ROUTER sees ``[identity, request]`` and answers
``[identity, reply]``. A REQ peer's empty delimiter frame is accepted and
echoed (``[identity, b"", request]``). Any other shape cannot be answered
safely: it is dropped and counted in :attr:`RouterServer.dropped_frames`.

Security: an ``ipc://`` socket file is created under umask 077 and chmod
``socket_mode`` (0600 by default; its directory should be 0700); ``tcp://``
requires a CURVE secret key unless ``insecure=True``, and with CURVE a ZAP
handler (the daemon's) decides which client keys may connect (``zap_domain``).
The handler learns who sent a request from its frame (:func:`peer_of`): the
kernel's uid and pid of an ipc:// peer, the CURVE key of a tcp:// one.

Bounds: frames larger than ``hard_limit_bytes`` make libzmq drop the
connection (ZMQ_MAXMSGSIZE); smaller oversized frames reach the handler, which
answers them with an error. Each connection may queue at most
``max_queued_bytes`` (ZMQ_RCVHWM in whole frames of ``hard_limit_bytes``):
beyond that ZeroMQ stops reading from it, so one client cannot grow the
daemon. ROUTER fair-queues connections: each gets its turn.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvcore_ipc.sockets import bind_private, close_unlinking, curve_server, ipc_path

Handler = Callable[[bytes, zmq.Frame], bytes]
"""``handler(request bytes, request frame) -> reply bytes``; the frame carries the peer."""


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a frame, as the transport proved it (never what the peer said)."""

    uid: int | None  # ipc://: the peer process's uid (SO_PEERCRED); None on tcp://
    pid: int | None  # ipc://: its pid, in the daemon's pid namespace
    key: str | None  # tcp:// with CURVE: the client's z85 public key (set by ZAP)


def peer_of(frame: zmq.Frame, *, ipc: bool) -> Peer:
    """The peer of a frame received on an ``ipc`` (Unix) socket or not. libzmq gives a
    Unix-socket peer the address ``localhost:uid:gid:pid`` (SO_PEERCRED); only then are
    uid and pid read (a TCP peer's IPv6 address must never pass for one). A ZAP handler
    sets ``User-Id`` (the CURVE key)."""
    uid = pid = None
    with contextlib.suppress(zmq.ZMQError):
        parts = str(frame.get("Peer-Address")).split(":")
        if (
            ipc
            and len(parts) == 4
            and parts[0] == "localhost"
            and all(p.isdigit() for p in parts[1:])
        ):
            uid, pid = int(parts[1]), int(parts[3])
    key = None
    with contextlib.suppress(zmq.ZMQError):
        user = frame.get("User-Id")
        key = user if isinstance(user, str) and len(user) == 40 else None
    return Peer(uid, pid, key)


class InsecureEndpoint(ValueError):
    """A tcp:// endpoint without CURVE keys and without the insecure opt-out."""


class EndpointBusy(OSError):
    """Another live daemon holds this ipc:// endpoint."""


class EndpointLock:
    """An exclusive lock on an ``ipc://`` endpoint for a daemon's lifetime.

    ``flock`` on ``<socket path>.lock``: a second daemon on the same path is
    refused even while the first is too busy (or stopped) to answer a probe,
    and the kernel drops the lock when its holder dies, so whoever takes the
    lock removes the socket file a crashed daemon left. Other endpoints need no
    lock (a TCP bind fails by itself; see :func:`endpoint_in_use`). The lock
    file holds its holder's pid (:meth:`holder`: whom a takeover asks to stop)
    and is removed on :meth:`release`.
    """

    __slots__ = ("_fd", "_path")

    def __init__(self, endpoint: str) -> None:
        self._path: str | None = None
        self._fd: int | None = None
        socket_path = ipc_path(endpoint)
        if socket_path is None:
            return
        path = socket_path + ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.getuid() or mode & 0o077:
            os.close(fd)
            raise PermissionError(
                f"{path} is not this user's alone (owner {st.st_uid}, mode {mode:04o}): remove it"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EndpointBusy(f"a daemon already serves {endpoint} (it holds {path})") from None
        self._path, self._fd = path, fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)  # the lock was free: a dead daemon's socket

    @staticmethod
    def holder(endpoint: str) -> int | None:
        """The pid of the live daemon that holds ``endpoint``'s lock, or None: no lock, a
        free one (its holder died), or one whose file is not this user's alone. A held
        lock's file names its holder (written right after the lock was taken)."""
        socket_path = ipc_path(endpoint)
        if socket_path is None:
            return None
        try:
            fd = os.open(socket_path + ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: read whose
                text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                return int(text) if text.isdigit() and int(text) > 0 else None
            return None  # free
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is None or self._path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        os.close(self._fd)
        self._fd = self._path = None


class RouterServer:
    """A bound ROUTER socket that :meth:`serve` answers one request at a time.

    The socket is bound at construction and the handler is given to :meth:`serve`, so
    whoever builds the handler can hand it this server's counters first."""

    def __init__(
        self,
        endpoint: str,
        *,
        curve_secret_key: bytes | None = None,
        insecure: bool = False,
        hard_limit_bytes: int = 64 << 20,
        max_queued_bytes: int = 256 << 20,
        socket_mode: int = 0o600,
        zap_domain: str = "",
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if endpoint.startswith("tcp://") and curve_secret_key is None and not insecure:
            raise InsecureEndpoint(
                f"{endpoint}: tcp:// needs a CURVE secret key (or the insecure opt-out)"
            )
        self.endpoint = endpoint
        self.dropped_frames = 0
        self._stop = False
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, hard_limit_bytes)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._socket.setsockopt(zmq.RCVHWM, max(1, max_queued_bytes // hard_limit_bytes))
        curve_server(self._socket, curve_secret_key, zap_domain)
        self.endpoint = bind_private(self._socket, endpoint, socket_mode)

    def stop(self) -> None:
        """Ask :meth:`serve` to return after the current request (signal-handler safe)."""
        self._stop = True

    def pending(self) -> bool:
        """True if a request is queued (read it before judging anyone silent)."""
        events: int = self._socket.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
        return bool(events & zmq.POLLIN)

    def serve(self, handler: Handler, tick: Callable[[], None], tick_ms: int = 50) -> None:
        """Answer each request with ``handler`` until :meth:`stop`; call ``tick()`` at least
        every ``tick_ms``."""
        sock = self._socket
        sock.setsockopt(zmq.RCVTIMEO, tick_ms)  # a blocking recv, as lean as a raw echo loop
        while not self._stop:
            try:
                identity = sock.recv()  # bytes: as lean as a raw echo loop
            except zmq.Again:
                tick()
                continue
            except InterruptedError:
                continue
            self._answer(identity, handler)
            tick()

    def drain(self, handler: Handler, quiet_ms: int = 5, most_ms: int = 25) -> int:
        """Answer with ``handler`` every request queued, and every one that arrives until
        none has for ``quiet_ms`` (at most ``most_ms`` in all): a stopping daemon refuses
        them, so that no client waits for a reply that would never come (a request in
        flight as the daemon stops is still reaching its queue). How many."""
        answered, sock = 0, self._socket
        end = time.monotonic() + most_ms / 1000
        while (left := end - time.monotonic()) > 0:
            if not sock.poll(min(quiet_ms, max(1, int(left * 1000)))):
                break
            try:
                identity = sock.recv(zmq.NOBLOCK)
            except (zmq.Again, InterruptedError):
                continue
            self._answer(identity, handler)
            answered += 1
        return answered

    def _answer(self, identity: bytes, handler: Handler) -> None:
        """Read the rest of the message from ``identity`` and send ``handler``'s reply."""
        sock = self._socket
        body = sock.recv(copy=False)  # a Frame: it knows the peer (peer_of)
        if not body.more:
            sock.send_multipart((identity, handler(body.bytes, body)))
        elif not body.bytes and not (body := sock.recv(copy=False)).more:
            sock.send_multipart((identity, b"", handler(body.bytes, body)))
        else:
            while body.more:  # any other shape: drop the rest of the message
                body = sock.recv(copy=False)
            self.dropped_frames += 1

    def close(self) -> None:
        """Close the socket and remove an ipc:// socket file."""
        close_unlinking(self._socket, self.endpoint)


def endpoint_in_use(endpoint: str, probe: bytes, timeout_ms: int = 300) -> bool:
    """True if something answers ``probe`` at ``endpoint`` (a live daemon owns it).

    For transports without a lock; ``ipc://`` endpoints are guarded by :class:`EndpointLock`."""
    if "*" in endpoint:
        return False  # a wildcard port is never in use
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(probe)
        return bool(sock.poll(timeout_ms))
    finally:
        sock.close(linger=0)
