"""POSIX shared memory: a host pool's region, exported by the daemon, mapped by clients.

The exporter (:meth:`HostRegion.create`) owns the segment, named
``<prefix>-<pid>-<random>`` and mode 0600, and unlinks it on close; existing
mappings stay valid until they are unmapped. An importer
(:meth:`HostRegion.attach`) maps it read-write from its
:class:`~kvcore_ipc.messages.HostMemory` description, zero-copy, without telling
the resource tracker (the importer's exit never unlinks the daemon's pool).
:func:`sweep` removes what a killed exporter left. Sizes and offsets are in bytes.

torch is imported only by :meth:`HostRegion.as_tensor`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

from kvcore_ipc.messages import HostMemory

if TYPE_CHECKING:
    import torch


class HostRegion:
    """A POSIX shm segment. The exporter (``create``) owns and unlinks it; an importer
    (``attach``) maps it without telling the resource tracker, so the importer's exit
    never unlinks the daemon's pool."""

    __slots__ = ("_map", "_name", "_shm", "offset", "owner", "size")

    def __init__(
        self,
        name: str,
        size: int,
        shm: shared_memory.SharedMemory | None,
        mm: mmap.mmap | None,
        offset: int = 0,
    ) -> None:
        self._name = name
        self._shm = shm  # set for the owner
        self._map = mm  # set for an importer
        self.size = size  # bytes of the region, from ``offset`` (bytes) into the segment
        self.offset = offset
        self.owner = shm is not None

    @classmethod
    def create(cls, size: int, prefix: str = "kvcore") -> HostRegion:
        """A new zero-filled segment of ``size`` bytes (mode 0600) named
        ``<prefix>-<pid>-<random>``, so that :func:`sweep` can tell whose it was."""
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
        return cls(name, size, shm, None)

    @classmethod
    def attach(cls, memory: HostMemory, owners: set[int] | None = None) -> HostRegion:
        """Map an exported segment read-write; FileNotFoundError if it is gone,
        PermissionError if its owner is not in ``owners`` (uids; None: any)."""
        import _posixshmem  # type: ignore[import-not-found]  # CPython shm_open, as shared_memory uses

        fd = _posixshmem.shm_open("/" + memory.name, os.O_RDWR | os.O_NOFOLLOW, mode=0o600)
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
        return cls(memory.name, memory.size, None, mm, memory.offset)

    @property
    def name(self) -> str:
        return self._name

    def describe(self) -> HostMemory:
        return HostMemory(name=self._name, size=self.size, offset=self.offset)

    def buffer(self) -> memoryview:
        """The region's bytes: ``size`` bytes from ``offset`` into the segment."""
        end = self.offset + self.size
        if self._shm is not None:
            buf = self._shm.buf
            assert buf is not None, "region is closed"
            return buf[self.offset : end]
        assert self._map is not None, "region is closed"
        return memoryview(self._map)[self.offset : end]

    def as_tensor(self) -> torch.Tensor:
        """A flat uint8 CPU tensor over the region (zero-copy)."""
        import torch

        with warnings_suppressed():
            return torch.frombuffer(self.buffer(), dtype=torch.uint8, count=self.size)

    def share_with_group(self, group: str) -> None:
        """Owner only: make the segment mode 0660 of ``group`` (a name or a gid), so that
        processes of other uids in that group can map it. KeyError if no such group."""
        import grp

        assert self._shm is not None, "only the owner shares a segment"
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        fd = self._shm._fd  # type: ignore[attr-defined]
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o660)

    def fence(self) -> None:
        """Replace an importer's mapping by private zero pages at the same address, so no
        later write of this process (a kernel still holding the tensors) reaches the
        segment. Views stay valid; what they show is scratch. Linux and macOS."""
        if self._map is None:
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

    def close(self) -> None:
        """Unmap (and unlink, if owner). Mappings still exported by tensors stay valid:
        the segment is then unmapped when the last of them is collected."""
        shm, mm, self._shm, self._map = self._shm, self._map, None, None
        if shm is not None:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
            with contextlib.suppress(BufferError):
                shm.close()
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()


def sweep(prefix: str) -> list[str]:
    """Unlink the segments ``<prefix>-<pid>-*`` of this user whose creator ``pid`` is dead
    (a daemon of the same endpoint that was killed); the names removed. Linux (/dev/shm)."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/dev/shm"):
            head, _, rest = entry.name.partition(f"{prefix}-")
            pid = rest.split("-", 1)[0]
            if head or not pid.isdigit() or _alive(int(pid)):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def warnings_suppressed() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns that shm is writable: it must be
        yield
