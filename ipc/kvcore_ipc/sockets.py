"""Socket set-up that the daemon's sockets and the engine's share: CURVE and socket files.

* A CURVE client (:func:`curve_client`) knows the server's public key and
  brings a keypair (its own, or a fresh one per socket); a CURVE server
  (:func:`curve_server`) holds its secret key and lets the ZAP handler of
  ``zap_domain`` admit client keys. Keys are 32 raw bytes.
* An ``ipc://`` socket file is the binder's alone: :func:`bind_private` creates
  it under umask 077 and then chmods it, and :func:`close_unlinking` removes it
  when the socket closes. Other transports have no file (:func:`ipc_path`).
"""

from __future__ import annotations

import contextlib
import os

import zmq

IPC = "ipc://"


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint; None for any other transport."""
    return endpoint[len(IPC) :] if endpoint.startswith(IPC) else None


def curve_client(
    sock: zmq.Socket[bytes],
    server_key: bytes | None,
    keypair: tuple[bytes, bytes] | None = None,
) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the server whose public key
    is ``server_key``, with ``keypair`` (public, secret) or a fresh one; nothing when
    ``server_key`` is None (a plain socket)."""
    if server_key is None:
        return
    public, secret = keypair or zmq.curve_keypair()
    sock.curve_serverkey = server_key
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def curve_server(sock: zmq.Socket[bytes], secret_key: bytes | None, zap_domain: str) -> None:
    """Make ``sock`` (before it binds) a CURVE server with ``secret_key`` (none: plain)
    whose ZAP requests carry ``zap_domain`` (empty: no domain)."""
    if zap_domain:
        sock.zap_domain = zap_domain.encode()
    if secret_key is not None:
        sock.curve_server = True
        sock.curve_secretkey = secret_key


def bind_private(sock: zmq.Socket[bytes], endpoint: str, mode: int = 0o600) -> str:
    """Bind ``sock`` to ``endpoint``; an ipc:// socket file is created under umask 077
    (never open to others, not even for a moment) and then given ``mode``. Returns the
    bound endpoint (ZMQ_LAST_ENDPOINT: a tcp:// wildcard port resolved)."""
    old = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    path = ipc_path(bound)
    if path is not None:
        os.chmod(path, mode)
    return bound


def close_unlinking(sock: zmq.Socket[bytes], endpoint: str | None) -> None:
    """Close ``sock`` at once (nothing queued is sent) and remove the socket file of
    ``endpoint`` if it is an ipc:// one that still exists."""
    sock.close(linger=0)
    path = ipc_path(endpoint or "")
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
