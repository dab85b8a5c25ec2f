"""Where a daemon's sockets live, and when a path is trusted (docs/security.md).

The runtime directory is ``$XDG_RUNTIME_DIR/kvcore``, else ``/tmp/kvcore-$UID``;
the default endpoint is the socket ``kvcore.sock`` in it. A path is trusted only
if nobody but its owner (a trusted uid, or root for a directory) could have
made or swapped it: never a symlink, never a directory others can write unless
it is sticky. A refusal is :class:`~kvcore.errors.UntrustedEndpoint`.

A leaf: it imports nothing of kvcore but its errors, so a client checks its
endpoint without loading the daemon's configuration.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from kvcore.errors import BadRequest, Timeout, UntrustedEndpoint

SOCKET_NAME = "kvcore.sock"


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/kvcore, else /tmp/kvcore-$UID; created 0700 on first use, and
    refused (UntrustedEndpoint) unless it is a real directory of this user, mode 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "kvcore" if base else Path(f"/tmp/kvcore-{os.getuid()}")
    if base:
        Path(base).mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)  # never through a symlink: mkdir does not follow one
    check_runtime_dir(path)
    return path


def default_endpoint() -> str:
    """The endpoint ``kvcore serve`` binds and ``Client.connect()`` uses by default
    ($KVCORE_ENDPOINT overrides)."""
    return os.environ.get("KVCORE_ENDPOINT") or f"ipc://{runtime_dir() / SOCKET_NAME}"


def check_runtime_dir(path: Path) -> None:
    """UntrustedEndpoint unless ``path`` is a directory (not a symlink) owned by this user
    with mode 0700: anyone else who could write there could swap the daemon's socket."""
    st = os.lstat(path)
    why = _untrusted(st, {os.getuid()})
    if why is None and not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    if why is None and stat.S_IMODE(st.st_mode) != 0o700:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if why is not None:
        raise UntrustedEndpoint(
            f"runtime directory {path} {why}: another user may have made it. Remove it "
            f"(as its owner or root) or choose another place (XDG_RUNTIME_DIR, --endpoint)"
        )


def check_socket_path(path: str, trusted_uids: set[int], *, creating: bool) -> None:
    """UntrustedEndpoint unless an ipc:// socket path can only be a trusted daemon's: its
    directory belongs to a trusted uid or root and nobody else can write there (or it is
    sticky, like /tmp), and the file, if it exists, is a socket (not a symlink) of a
    trusted uid. A client (not ``creating``) also needs the socket to exist already in a
    directory others can write. The daemon trusts its own uid; a client also root.
    A missing directory is Timeout for a client (no daemon ever bound there) and
    BadRequest for the daemon."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        pst = os.stat(parent)
    except FileNotFoundError:
        if not creating:
            raise Timeout(
                f"no daemon answers on ipc://{path} (its directory {parent} does "
                f"not exist) — start one with `kvcore serve`"
            ) from None
        raise BadRequest(
            f"socket directory {parent} does not exist: create it (yours, mode "
            f"0700) or choose another endpoint"
        ) from None
    shared = bool(pst.st_mode & 0o022)
    why = _untrusted(pst, trusted_uids | {0})
    if why is None and shared and not pst.st_mode & stat.S_ISVTX:
        why = f"is writable by others (mode {stat.S_IMODE(pst.st_mode):04o})"
    if why is not None:
        raise UntrustedEndpoint(
            f"socket directory {parent} {why}: use a directory only you (or root) can write"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if shared and not creating:
            raise UntrustedEndpoint(
                f"no socket at {path} yet, and others may create one there: start the daemon first"
            ) from None
        return
    why = _untrusted(st, trusted_uids)
    if why is None and not stat.S_ISSOCK(st.st_mode):
        why = "is not a socket"
    if why is not None:
        raise UntrustedEndpoint(
            f"{path} {why}: not a daemon you trust; remove it (as its "
            f"owner or root), or trust its owner (trusted_uids)"
        )


def _untrusted(st: os.stat_result, uids: set[int]) -> str | None:
    """Why a path with status ``st`` (from lstat) is not trusted, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if st.st_uid not in uids:
        return f"is owned by uid {st.st_uid}"
    return None


_OPEN_PRIVATE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def read_private_file(path: str, what: str, max_bytes: int = 4096) -> bytes:
    """The bytes of a secret file (a CURVE secret key, a bearer token, a tier secret),
    read once by descriptor. BadRequest, naming ``what`` and ``path``, unless it is a
    regular file (never through a symlink, never a FIFO to wait on) owned by this user
    or root, with no group or other permission bits, of at most ``max_bytes`` bytes:
    a file another user wrote is a secret that user knows."""
    try:
        fd = os.open(path, _OPEN_PRIVATE)
    except OSError as exc:
        why = "is a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise BadRequest(f"{what} {path!r}: {why}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadRequest(f"{what} {path!r} is not a regular file")
        if info.st_uid not in (os.getuid(), 0):
            raise BadRequest(
                f"{what} {path!r} is owned by uid {info.st_uid}, who knows what it holds: "
                "it must be this user's (or root's)"
            )
        if info.st_mode & 0o077:
            raise BadRequest(
                f"{what} {path!r} is readable by others (mode {stat.S_IMODE(info.st_mode):04o}): "
                f"it must be readable by its owner only (chmod 600 {path})"
            )
        raw = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise BadRequest(f"{what} {path!r} is over {max_bytes} bytes")
    return raw
