"""The metrics endpoint's HTTP server: bounded so that no client can exhaust the daemon.

Whoever can reach the metrics port (every local user, on loopback) gets only this:

* at most ``max_connections`` connections are served at once, each by a thread of
  its own; a connection past that is answered 503 and closed at once, so the
  endpoint holds at most ``max_connections + 1`` descriptors however many connect;
* a connection has ``deadline_s`` in all to send its request and take the reply
  (a partial request line, or one byte every few seconds, is dropped at the
  deadline), so a slot is never held longer than that;
* when the process is out of descriptors, accepting waits (``ACCEPT_BACKOFF_S``)
  instead of spinning: what is queued stays in the kernel's backlog.

The request loop never waits on this thread: ``/health`` reads a timestamp, and a
scrape asks the loop for a snapshot it may take at its next tick (kvcore.daemon.metrics).

Two ways to keep the figures from other local users (docs/deploy.md): a unix socket
(mode 0600, and only peers of the daemon's uid or root are served: the kernel's
``SO_PEERCRED``), or a bearer token every path but ``/health`` requires.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import io
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from kvcore.errors import BadRequest
from kvcore.paths import check_socket_path, read_private_file

ACCEPT_BACKOFF_S = 0.05  # out of descriptors: accepting waits this long before trying again
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
MIN_TOKEN_CHARS = 16
OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

log = logging.getLogger("kvcore.daemon")

App = Callable[[dict[str, Any], Any], Iterable[bytes]]


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one metrics client may take. Fixed at start; nobody changes them."""

    max_connections: int = 16  # served at once; the rest are closed at once
    deadline_s: float = 5.0  # seconds a connection has for its request and reply, in all

    def __post_init__(self) -> None:
        assert self.max_connections >= 1 and self.deadline_s > 0, self


DEFAULT_LIMITS = HttpLimits()


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each with only the time left before ``deadline`` (monotonic s);
    TimeoutError once it has passed. The socket's writes get the same bound."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the metrics client's deadline passed")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Handler(WSGIRequestHandler):
    """One request per connection (wsgiref's), read under the server's deadline; quiet."""

    server: BoundedServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by one that keeps the deadline
        deadline = time.monotonic() + self.server.limits.deadline_s
        self.request.settimeout(self.server.limits.deadline_s)
        self.rfile = io.BufferedReader(_DeadlineReader(self.request, deadline))

    def log_message(self, format: str, *args: Any) -> None:
        pass


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``limits.max_connections`` of them (daemon
    threads: none is joined at close). The standard library's, not prometheus_client's
    server class: the daemon imports this module whether metrics are on or not.

    Invariant: ``_slots`` is held once per connection whose thread was started and
    has not finished; a connection that gets no slot is closed before the next accept.
    """

    block_on_close = False  # close() does not wait for clients (each ends by its deadline)
    daemon_threads = True

    def __init__(self, address: Any, limits: HttpLimits) -> None:
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in OUT_OF_DESCRIPTORS:
                time.sleep(ACCEPT_BACKOFF_S)  # the backlog waits; the loop keeps what is left
            raise  # socketserver drops it and selects again

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):  # a full buffer, a reset: closed all the same
                request.send(BUSY, socket.MSG_DONTWAIT)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread started: it will not release its slot
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics client dropped", exc_info=True)  # a timeout, a reset: theirs


class UnixServer(BoundedServer):
    """The same on a unix socket: mode 0600, and only peers of this uid or root served."""

    address_family = socket.AF_UNIX

    def __init__(self, path: str, limits: HttpLimits) -> None:
        self.path = path
        super().__init__(path, limits)

    def server_bind(self) -> None:
        self.socket.bind(self.path)
        os.chmod(self.path, 0o600)  # in a directory check_socket_path trusted
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = "localhost", 0
        self.setup_environ()

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, _ = super().get_request()
        return conn, ("", 0)  # wsgiref wants a (host, port) for REMOTE_ADDR

    def verify_request(self, request: Any, client_address: Any) -> bool:
        creds = request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid in (os.getuid(), 0)  # a peer that got in before the chmod is refused too


def serve_tcp(app: App, addr: str, port: int, limits: HttpLimits) -> BoundedServer:
    """A bounded server of ``app`` on ``addr:port`` (0: any free port), not yet serving.
    BadRequest if the port is taken or the address is not this host's."""
    try:
        server = BoundedServer((addr, port), limits)
    except OSError as exc:
        raise BadRequest(f"--metrics-port {port} on {addr}: {exc.strerror or exc}") from None
    server.set_app(app)
    return server


def serve_unix(app: App, path: str, limits: HttpLimits) -> UnixServer:
    """A bounded server of ``app`` on the unix socket ``path`` (mode 0600), not yet
    serving. The path is checked as the request socket's is (UntrustedEndpoint);
    a dead daemon's socket there is replaced, a live one is BadRequest."""
    check_socket_path(path, {os.getuid()}, creating=True)
    _remove_stale(path)
    try:
        server = UnixServer(path, limits)
    except OSError as exc:
        raise BadRequest(f"metrics socket {path}: {exc.strerror or exc}") from None
    server.set_app(app)
    return server


def _remove_stale(path: str) -> None:
    """Unlink a socket at ``path`` that no one answers on (check_socket_path has made sure
    it is a socket of ours); BadRequest if someone does."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return
    except FileNotFoundError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise BadRequest(f"metrics socket {path} is in use by another daemon")


def require_bearer(app: App, token: str, open_paths: frozenset[str]) -> App:
    """``app`` behind ``Authorization: Bearer <token>`` (compared in constant time);
    ``open_paths`` need none. A missing or wrong token is 401 with nothing else."""
    want = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO") in open_paths:
            return app(environ, start_response)
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, want):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("WWW-Authenticate", 'Bearer realm="kvcore"'), ("Content-Type", "text/plain")],
        )
        return [b"a bearer token is required\n"]

    return guarded


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped). BadRequest unless the
    file is this user's (or root's), not a symlink, readable by its owner only
    (kvcore.paths.read_private_file), and the token has MIN_TOKEN_CHARS or more."""
    raw = read_private_file(path, "metrics token file")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise BadRequest(f"metrics token file {path}: {exc}") from None
    if len(text) < MIN_TOKEN_CHARS or any(c.isspace() for c in text):
        raise BadRequest(
            f"metrics token in {path}: at least {MIN_TOKEN_CHARS} characters and no "
            f"spaces (e.g. `openssl rand -hex 32 > {path}`)"
        )
    return text
