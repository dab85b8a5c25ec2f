"""CUDA IPC: a GPU pool's region, exported by the daemon, opened by clients on the same GPU.

The exporter (:meth:`CudaRegion.create`) allocates the pool in a plain
cudaMalloc block and exports it once through torch's storage sharing; an
importer (:meth:`CudaRegion.attach`) opens that
:class:`~kvcore_ipc.messages.CudaMemory` description on the local GPU with the
same UUID and sees the very same bytes. The wire carries the raw 64-byte
``cudaIpcMemHandle_t`` (spec/protocol.md), never torch's versioned share
handle: :func:`ipc_mem_handle` and :func:`new_shared_cuda_args` translate
between the two. Sizes and offsets are in bytes.

torch is imported only inside the functions that need a GPU.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from kvcore_ipc.messages import CudaMemory

if TYPE_CHECKING:
    import torch

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
    (
        _device,
        handle,
        storage_bytes,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = share
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
    return (
        index,
        bytes(memory.handle),
        memory.size,
        memory.offset,
        bytes(memory.ref_counter_handle),
        memory.ref_counter_offset,
        bytes(memory.event_handle),
        bool(sync),
    )


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
