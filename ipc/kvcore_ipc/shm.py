"""POSIX shared memory: a host pool's region, exported by the daemon, mapped by clients.

The exporter (:meth:`HostRegion.create`) owns the segment, named
``<prefix>-<pid>-<random>`` and mode 0600, and unlinks it on close; existing
mappings stay valid until they are unmapped. An importer
(:meth:`HostRegion.attach`) maps it read-write from its
:class:`~kvcore_ipc.messages.HostMemory` description, zero-copy, without telling
the resource tracker (the importer's exit never unlinks the daemon's pool).
:func:`sweep` removes what a killed exporter left. Sizes and offsets are in bytes.

Segments that outlive the daemon (a restart re-adopts them, kvcore.daemon.restore):

* ``create(tracked=False)`` does not register the segment with multiprocessing's
  resource tracker. A tracked one (the default) is unlinked by the tracker within
  about a second when its creator alone is SIGKILLed; an untracked one stays, with
  its bytes, until someone unlinks it (or the machine reboots).
* :meth:`HostRegion.reopen` maps such a segment again, as its owner, refusing it
  unless it is a regular file of this user, of exactly the mode it was made with
  and of the expected size: PermissionError (owner, mode, not a regular file),
  ValueError (size), FileNotFoundError (gone), as :meth:`~HostRegion.attach` does;
  an OSError (ELOOP) for a symlink.
* ``close(unlink=False)`` unmaps and keeps the segment (a tracked one is first
  unregistered, so the tracker does not unlink it at exit).
* ``sweep(prefix, keep=names)`` leaves the re-adopted segments alone. A re-adopted
  segment keeps its creator's pid in its name, so "creator dead" no longer means
  "nobody serves it": sweep only under the endpoint's lock, keeping what is served.
* :func:`unlink_own` unlinks one segment only if it is a regular file of this user.

Every segment is opened with O_NOFOLLOW and created with O_CREAT|O_EXCL, mode 0600
(0660 of a group after :meth:`~HostRegion.share_with_group`).

torch is imported only by :meth:`HostRegion.as_tensor`.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython shm_open, as shared_memory uses
import contextlib
import mmap
import os
import secrets
import stat
from collections.abc import Collection
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any

from kvcore_ipc.messages import HostMemory

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX segments (for sweep and unlink_own)
_CREATE = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW
_OPEN = os.O_RDWR | os.O_NOFOLLOW


class HostRegion:
    """A mapped POSIX shm segment. The exporter (``create``, ``reopen``) owns it and
    unlinks it at ``close`` unless told to keep it; an importer (``attach``) maps it
    without telling the resource tracker, so the importer's exit never unlinks the
    daemon's pool.

    An owner keeps the segment's descriptor (``share_with_group`` changes its mode)
    until ``close``; ``tracked`` says whether the resource tracker would unlink the
    segment if this process died."""

    __slots__ = ("_fd", "_map", "_name", "offset", "owner", "size", "tracked")

    def __init__(
        self,
        name: str,
        size: int,
        mm: mmap.mmap,
        offset: int = 0,
        *,
        fd: int | None = None,
        tracked: bool = False,
    ) -> None:
        self._name = name
        self._map: mmap.mmap | None = mm  # None once closed
        self._fd = fd  # the owner's descriptor; None for an importer
        self.size = size  # bytes of the region, from ``offset`` (bytes) into the segment
        self.offset = offset
        self.owner = fd is not None
        self.tracked = tracked  # registered with this process's resource tracker

    @classmethod
    def create(cls, size: int, prefix: str = "kvcore", *, tracked: bool = True) -> HostRegion:
        """A new zero-filled segment of ``size`` bytes (mode 0600) named
        ``<prefix>-<pid>-<random>``, so that :func:`sweep` can tell whose it was.
        ``tracked=False``: not registered with the resource tracker, so it outlives
        a SIGKILL of this process (see the module doc)."""
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open("/" + name, _CREATE, mode=0o600)
        try:
            os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask: reopen expects it
            os.ftruncate(fd, max(size, 1))
            mm = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        if tracked:
            resource_tracker.register("/" + name, "shared_memory")
        return cls(name, size, mm, fd=fd, tracked=tracked)

    @classmethod
    def reopen(cls, name: str, size: int, *, group: str = "") -> HostRegion:
        """Map an existing segment of this user again, as its owner (untracked; ``close``
        unlinks it unless told not to). Refused, naming the segment and what differs,
        unless it is a regular file (not a symlink: O_NOFOLLOW) owned by this uid, of
        mode 0600 (``group``: 0660 and that group's gid) and of ``size`` bytes (1 for
        0, as ``create`` makes it): PermissionError for the owner, mode, gid or file
        type, ValueError for the size, FileNotFoundError if it is gone, OSError (ELOOP)
        for a symlink. Never creates."""
        expected_mode, gid = (0o660, _gid_of(group)) if group else (0o600, None)
        fd = _posixshmem.shm_open("/" + name, _OPEN, mode=0o600)
        try:
            st = os.fstat(fd)
            why = _refusal(st, expected_mode, gid)
            if why is not None:
                raise PermissionError(f"segment {name} {why}")
            if st.st_size != max(size, 1):
                raise ValueError(f"segment {name} has {st.st_size} bytes, not {max(size, 1)}")
            mm = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            raise
        return cls(name, size, mm, fd=fd, tracked=False)

    @classmethod
    def attach(cls, memory: HostMemory, owners: set[int] | None = None) -> HostRegion:
        """Map an exported segment read-write; FileNotFoundError if it is gone,
        PermissionError if its owner is not in ``owners`` (uids; None: any)."""
        fd = _posixshmem.shm_open("/" + memory.name, _OPEN, mode=0o600)
        try:
            st = os.fstat(fd)
            if owners is not None and st.st_uid not in owners:
                raise PermissionError(
                    f"segment {memory.name} belongs to uid {st.st_uid}, not the daemon's user"
                )
            total = st.st_size
            if total < memory.offset + memory.size:
                raise ValueError(
                    f"segment {memory.name} has {total} bytes; need {memory.offset + memory.size}"
                )
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        return cls(memory.name, memory.size, mm, memory.offset)

    @property
    def name(self) -> str:
        return self._name

    def describe(self) -> HostMemory:
        return HostMemory(name=self._name, size=self.size, offset=self.offset)

    def buffer(self) -> memoryview:
        """The region's bytes: ``size`` bytes from ``offset`` into the segment."""
        assert self._map is not None, "region is closed"
        return memoryview(self._map)[self.offset : self.offset + self.size]

    def as_tensor(self) -> torch.Tensor:
        """A flat uint8 CPU tensor over the region (zero-copy)."""
        import torch

        with warnings_suppressed():
            return torch.frombuffer(self.buffer(), dtype=torch.uint8, count=self.size)

    def share_with_group(self, group: str) -> None:
        """Owner only: make the segment mode 0660 of ``group`` (a name or a gid), so that
        processes of other uids in that group can map it. KeyError if no such group."""
        assert self._fd is not None, "only the owner shares a segment"
        os.fchown(self._fd, -1, _gid_of(group))
        os.fchmod(self._fd, 0o660)

    def fence(self) -> None:
        """Replace an importer's mapping by private zero pages at the same address, so no
        later write of this process (a kernel still holding the tensors) reaches the
        segment. Views stay valid; what they show is scratch. Linux and macOS."""
        if self._map is None or self.owner:
            return
        import ctypes

        anchor = ctypes.c_char.from_buffer(self._map)
        address, length = ctypes.addressof(anchor), len(self._map)
        del anchor
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p  # mmap(addr, length, prot, flags, fd, offset)
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED
        got = libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if got != address:
            raise OSError(ctypes.get_errno(), "cannot fence the pool mapping")

    def close(self, *, unlink: bool = True) -> None:
        """Unmap; an owner also unlinks the segment, unless ``unlink`` is False: then it
        stays for a later :meth:`reopen` (a tracked one is unregistered first, so the
        resource tracker leaves it too). Mappings still exported by tensors stay valid:
        the segment is then unmapped when the last of them is collected."""
        mm, fd, self._map, self._fd = self._map, self._fd, None, None
        if fd is not None:
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    _posixshmem.shm_unlink("/" + self._name)
            if self.tracked:
                resource_tracker.unregister("/" + self._name, "shared_memory")
                self.tracked = False
            os.close(fd)
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()


def sweep(prefix: str, keep: Collection[str] = ()) -> list[str]:
    """Unlink the segments ``<prefix>-<pid>-*`` of this user whose creator ``pid`` is dead
    (a daemon of the same endpoint that was killed), except those named in ``keep``
    (re-adopted ones); the names removed. Linux (/dev/shm)."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(SHM_DIR):
            head, _, rest = entry.name.partition(f"{prefix}-")
            pid = rest.split("-", 1)[0]
            if head or not pid.isdigit() or entry.name in keep or pid_alive(int(pid)):
                continue
            if unlink_own(entry.name):
                removed.append(entry.name)
    return removed


def unlink_own(name: str) -> bool:
    """Unlink segment ``name`` if it is a regular file of this user; whether it did.
    /dev/shm is sticky, so a file of ours cannot be swapped for another's between the
    check and the unlink (only its owner or root may rename or remove it)."""
    path = os.path.join(SHM_DIR, name)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _refusal(st: os.stat_result, mode: int, gid: int | None) -> str | None:
    """Why a reopened segment with status ``st`` is not ours as made, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not {os.getuid()}"
    if stat.S_IMODE(st.st_mode) != mode:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, not {mode:04o}"
    if gid is not None and st.st_gid != gid:
        return f"belongs to group {st.st_gid}, not {gid}"
    return None


def _gid_of(group: str) -> int:
    """The gid of ``group`` (a name or a number); KeyError if no such group."""
    import grp

    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` lives (one of another user counts: it cannot be signalled,
    but it lives); a zombie, which maps nothing any more, does not. A number no process
    can have (<= 0, over 2**31 - 1) is no process: a name in /dev/shm, which anyone may
    create, must not make kill() signal our group or overflow."""
    if not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]  # after "(comm)": the state
    except OSError:
        return True  # no /proc: it exists
    return state != [b"Z"]


@contextlib.contextmanager
def warnings_suppressed() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns that shm is writable: it must be
        yield
