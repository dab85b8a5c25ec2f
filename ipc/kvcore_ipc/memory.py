"""Export and import of one memory region: POSIX shared memory (host) or CUDA IPC (GPU).

The daemon *exports* (creates and owns) a region and describes it with a
message (:class:`~kvcore_ipc.messages.HostMemory` or
:class:`~kvcore_ipc.messages.CudaMemory`); a client *imports* it from that
description and sees the very same bytes, zero-copy. Sizes and offsets are in
bytes. The exporter must outlive every importer's use of the region; a host
segment is unlinked by the exporter on close, after which existing mappings
stay valid until they are unmapped.

torch is imported only on the CUDA path and by :meth:`HostRegion.as_tensor`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

from kvcore_ipc.messages import CudaMemory, HostMemory

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
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]  # fmt: skip
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


CUDA_IPC_HANDLE_SIZE = 64  # bytes of a cudaIpcMemHandle_t and of a cudaIpcEventHandle_t

# What torch >= 2.2's ``_share_cuda_`` returns as the storage handle (c10's
# CUDACachingAllocator::shareIpcHandle): a version byte, a type byte, then the payload.
#
#   byte 0      byte 1      bytes 2..65
#   version     b"c"        cudaIpcMemHandle_t (64)       a cudaMalloc block
#   version     b"e"        pid, sizes, fds ...           an expandable segment
#
# torch's importer (getIpcDevPtr) takes a handle of exactly 64 bytes as a raw
# cudaIpcMemHandle_t of a cudaMalloc block, so the wire carries only those 64 bytes:
# what spec/protocol.md promises, readable by any client, and free of the version
# byte that another torch may refuse.
_TORCH_MALLOC, _TORCH_EXPANDABLE = ord("c"), ord("e")


def ipc_mem_handle(torch_handle: bytes) -> bytes:
    """The raw 64-byte ``cudaIpcMemHandle_t`` inside a handle from torch's ``_share_cuda_``.

    ValueError for an expandable segment (its payload is a pid and file descriptors,
    no IPC handle: pools must be plain cudaMalloc blocks) or any other shape."""
    if len(torch_handle) == CUDA_IPC_HANDLE_SIZE:  # torch < 2.2 sent the raw handle
        return bytes(torch_handle)
    if len(torch_handle) >= 2 and torch_handle[1] == _TORCH_EXPANDABLE:
        raise ValueError(
            "the pool lies in an expandable segment, which CUDA IPC cannot export; "
            "allocate it with expandable_segments:False"
        )
    if len(torch_handle) != 2 + CUDA_IPC_HANDLE_SIZE or torch_handle[1] != _TORCH_MALLOC:
        raise ValueError(f"not a torch cudaMalloc share handle ({len(torch_handle)} bytes)")
    return bytes(torch_handle[2:])


def cuda_memory_from_share(share: tuple[Any, ...], device_uuid: str, size: int) -> CudaMemory:
    """The wire description of a storage from the 8-tuple torch's ``_share_cuda_`` returns:
    ``(device, handle, storage_bytes, storage_offset_bytes, ref_counter_handle,
    ref_counter_offset, event_handle | None, event_sync_required)``."""
    (_device, handle, storage_bytes, storage_offset, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = share  # fmt: skip
    if int(storage_bytes) != size:
        raise ValueError(f"a CUDA pool is a whole storage: {storage_bytes} bytes, want {size}")
    event = bytes(event_handle or b"")
    if event and len(event) != CUDA_IPC_HANDLE_SIZE:
        raise ValueError(f"event handle of {len(event)} bytes, want {CUDA_IPC_HANDLE_SIZE}")
    return CudaMemory(
        device_uuid=_uuid_string(device_uuid),
        handle=ipc_mem_handle(bytes(handle)),
        size=size,
        offset=int(storage_offset),  # bytes from the cudaMalloc block's base to the storage
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=event,
        event_sync_required=bool(event_sync_required) and bool(event),
    )


def new_shared_cuda_args(memory: CudaMemory, index: int) -> tuple[Any, ...]:
    """The arguments of ``torch.UntypedStorage._new_shared_cuda`` for ``memory`` on the
    local GPU ``index``. Every handle is bytes (torch refuses None with a TypeError); an
    empty event handle means nothing to wait for. ValueError for a malformed message."""
    if len(memory.handle) != CUDA_IPC_HANDLE_SIZE:
        raise ValueError(f"handle of {len(memory.handle)} bytes, want {CUDA_IPC_HANDLE_SIZE}")
    sync = memory.event_sync_required
    if sync and len(memory.event_handle) != CUDA_IPC_HANDLE_SIZE:
        raise ValueError("event_sync_required without a 64-byte event_handle")
    return (index, bytes(memory.handle), memory.size, memory.offset,
            bytes(memory.ref_counter_handle), memory.ref_counter_offset,
            bytes(memory.event_handle), bool(sync))  # fmt: skip


class CudaRegion:
    """A CUDA allocation shared through CUDA IPC (torch's storage sharing).

    The exporter keeps ``tensor`` alive for the daemon's life and exports it once
    (``_share_cuda_`` takes a new ref-counter slot and an interprocess event on each
    call, for the storage's life): every importer gets the same description. The
    ref counter is torch's bookkeeping only; what keeps the memory mapped is the
    exporter holding ``tensor``. Importers open the handle on the GPU with the same
    UUID, which may have another index there.
    """

    __slots__ = ("_memory", "size", "tensor")

    def __init__(self, tensor: torch.Tensor, size: int, memory: CudaMemory | None = None) -> None:
        self.tensor = tensor
        self.size = size
        self._memory = memory  # the exporter's one export; None for an importer

    @classmethod
    def create(cls, size: int, device: str) -> CudaRegion:
        """A zero-filled pool of ``size`` bytes in a plain cudaMalloc block (never an
        expandable segment, which CUDA IPC cannot export), exported once."""
        import torch

        with _plain_cuda_malloc():
            tensor = torch.zeros(size, dtype=torch.uint8, device=device)
        share = tensor.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
        assert tensor.storage_offset() == 0, "a CUDA pool is a whole storage"
        uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
        return cls(tensor, size, cuda_memory_from_share(share, uuid, size))

    def describe(self) -> CudaMemory:
        """The pool's one export (the same for every importer)."""
        assert self._memory is not None, "only the exporter describes a CUDA region"
        return self._memory

    @classmethod
    def attach(cls, memory: CudaMemory) -> CudaRegion:
        """Open the handle on the local GPU whose UUID matches; ValueError if none does."""
        import torch

        index = cuda_index_of(memory.device_uuid)
        args = new_shared_cuda_args(memory, index)
        torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(*args)
            tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
            tensor.set_(storage, 0, (memory.size,), (1,))
        return cls(tensor, memory.size)

    def as_tensor(self) -> torch.Tensor:
        return self.tensor

    def wait_for_stream(self) -> None:
        """Block until the work queued so far on this process's current stream of the
        pool's GPU has run: an event recorded there, waited for on the host. Called before
        pages go back to the daemon, which may hand them to another process at once."""
        import torch

        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(self.tensor.device))
        done.synchronize()

    def close(self) -> None:
        del self.tensor


@contextlib.contextmanager
def _plain_cuda_malloc() -> Any:
    """Allocate with expandable segments off while inside (torch's allocator setting is
    process-wide: it is restored on exit), when the environment turned them on."""
    conf = ",".join(
        os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        yield
        return
    import torch

    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_settings is None:  # torch before 2.9
        set_settings = torch.cuda.memory._set_allocator_settings
    set_settings("expandable_segments:False")
    try:
        yield
    finally:
        set_settings("expandable_segments:True")


def cuda_index_of(device_uuid: str) -> int:
    """Local index of the GPU named by ``device_uuid`` ("GPU-..." or the bare UUID)."""
    import torch

    want = _uuid_string(device_uuid)
    for index in range(torch.cuda.device_count()):
        if _uuid_string(str(torch.cuda.get_device_properties(index).uuid)) == want:
            return index
    raise ValueError(f"no local GPU has UUID {device_uuid}")


def _uuid_string(uuid: str) -> str:
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
