"""Open a tier's directory once, by descriptor, trusting only what was checked.

``open_private_dir(path)`` walks the directory's parents from ``/`` one
component at a time, each opened relative to the one before with
``O_DIRECTORY | O_NOFOLLOW`` and checked on its open descriptor (``fstat``),
then opens (creating it 0700 if missing) the directory itself the same way.
The caller works relative to the returned descriptor (``dir_fd=``) and never
by path again, so nothing swapped at ``path`` after or during the check is
ever used: what was checked is what is used.

Trusted, like kvcore.paths's socket directories (docs/security.md):

* each parent: owned by this user or root, and not writable by group or
  others unless sticky (``/tmp``): nobody else can rename or replace the
  entries below it;
* the directory: a real directory (not a symlink) owned by this user with no
  group or other permission bits.

Symlinks among the parents are resolved once (``realpath``) before the walk,
which then follows none: a link changed later is not followed. A refusal is
:class:`~kvcore.errors.BadRequest` naming the path and why.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable

from kvcore.errors import BadRequest

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(path: str, what: str = "disk tier directory") -> int:
    """A descriptor of directory ``path`` (created 0700 if missing, with missing parents
    0700), checked as the module docstring says. The caller closes it."""
    return _open_walked(path, what, create=True, leaf=_check_leaf)


def open_trusted_dir(path: str, what: str) -> int:
    """A descriptor of the existing directory ``path``, its parents checked as
    :func:`open_private_dir`'s, the directory itself a real directory of this user or
    root that group and others may not write (it may be readable: the authorized keys).
    Nothing is created. The caller closes it."""
    return _open_walked(path, what, create=False, leaf=check_trusted_fd)


def _open_walked(
    path: str, what: str, *, create: bool, leaf: Callable[[int, str, str], None]
) -> int:
    full = os.path.abspath(path)
    name = os.path.basename(full)
    if name in ("", ".", ".."):
        raise BadRequest(f"{what} {path!r} names no directory")
    parent = os.path.realpath(os.path.dirname(full))
    fd = os.open("/", _OPEN_DIR)
    try:
        _check_parent(fd, "/", what, path)
        walked = ""
        for part in [p for p in parent.split("/") if p]:
            walked += "/" + part
            child = _step(fd, part, walked, what, path, create, _parent_check(path))
            os.close(fd)
            fd = child
        return _step(fd, name, full, what, path, create, leaf)
    finally:
        os.close(fd)


def _parent_check(path: str) -> Callable[[int, str, str], None]:
    return lambda fd, shown, what: _check_parent(fd, shown, what, path)


def _step(
    fd: int,
    part: str,
    shown: str,
    what: str,
    path: str,
    create: bool,
    check: Callable[[int, str, str], None],
) -> int:
    """Open (creating 0700 if missing and ``create``) ``part`` under ``fd`` and
    ``check`` it (``fd`` stays open)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, 0o700, dir_fd=fd)
    try:
        child = os.open(part, _OPEN_DIR, dir_fd=fd)
    except FileNotFoundError:
        raise BadRequest(f"{what} {path!r}: {shown} does not exist") from None
    except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file where a directory must be
        raise BadRequest(
            f"{what} {path!r}: {shown} is not a directory, or is a symlink ({exc.strerror})"
        ) from None
    try:
        check(child, shown, what)
    except BaseException:
        os.close(child)
        raise
    return child


def _check_parent(fd: int, shown: str, what: str, path: str) -> None:
    info = os.fstat(fd)
    if info.st_uid not in (os.getuid(), 0):
        raise BadRequest(
            f"{what} {path!r}: its parent {shown} is owned by uid {info.st_uid}, "
            f"who could replace the directory: use a path only you (or root) control"
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise BadRequest(
            f"{what} {path!r}: its parent {shown} is writable by others (mode "
            f"{stat.S_IMODE(info.st_mode):04o}, not sticky), who could replace the directory"
        )


def _check_leaf(fd: int, shown: str, what: str) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise BadRequest(
            f"{what} {shown!r} must be owned by this user with mode 0700, "
            f"got uid {info.st_uid} mode {stat.S_IMODE(info.st_mode):o}"
        )


def check_trusted_fd(fd: int, shown: str, what: str) -> None:
    """BadRequest unless the open ``fd`` belongs to this user or root and no group or
    other may write it (what a file or directory others must not have planted needs)."""
    info = os.fstat(fd)
    if info.st_uid not in (os.getuid(), 0):
        raise BadRequest(
            f"{what} {shown!r} is owned by uid {info.st_uid}: it must be yours or root's"
        )
    if info.st_mode & 0o022:
        raise BadRequest(
            f"{what} {shown!r} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
        )
