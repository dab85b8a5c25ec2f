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

from kvcore.errors import BadRequest

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(path: str, what: str = "disk tier directory") -> int:
    """A descriptor of directory ``path`` (created 0700 if missing, with missing parents
    0700), checked as the module docstring says. The caller closes it."""
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
            child = _step(fd, part, walked, what, path, parent=True)
            os.close(fd)
            fd = child
        return _step(fd, name, full, what, path, parent=False)
    finally:
        os.close(fd)


def _step(fd: int, part: str, shown: str, what: str, path: str, *, parent: bool) -> int:
    """Open (creating 0700 if missing) ``part`` under ``fd`` and check it (``fd`` stays open)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(part, 0o700, dir_fd=fd)
    try:
        child = os.open(part, _OPEN_DIR, dir_fd=fd)
    except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file where a directory must be
        raise BadRequest(
            f"{what} {path!r}: {shown} is not a directory, or is a symlink ({exc.strerror})"
        ) from None
    try:
        if parent:
            _check_parent(child, shown, what, path)
        else:
            _check_leaf(child, shown, what)
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
