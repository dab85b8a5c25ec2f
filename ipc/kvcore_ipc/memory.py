"""Export and import of one memory region: POSIX shared memory (host) or CUDA IPC (GPU).

The daemon *exports* (creates and owns) a region and describes it with a
message (:class:`~kvcore_ipc.messages.HostMemory` or
:class:`~kvcore_ipc.messages.CudaMemory`); a client *imports* it from that
description and sees the very same bytes, zero-copy. Sizes and offsets are in
bytes. The exporter must outlive every importer's use of the region; a host
segment is unlinked by the exporter on close, after which existing mappings
stay valid until they are unmapped.

Both kinds answer ``create`` (export), ``attach`` (import), ``as_tensor`` and
``close``; each lives in its own module (:mod:`kvcore_ipc.shm`,
:mod:`kvcore_ipc.cuda_ipc`), and this one is where callers import them from.
"""

from __future__ import annotations

from kvcore_ipc.cuda_ipc import (
    CUDA_IPC_HANDLE_SIZE,
    CudaRegion,
    cuda_index_of,
    cuda_memory_from_share,
    ipc_mem_handle,
    new_shared_cuda_args,
)
from kvcore_ipc.shm import HostRegion, sweep

__all__ = [
    "CUDA_IPC_HANDLE_SIZE",
    "CudaRegion",
    "HostRegion",
    "cuda_index_of",
    "cuda_memory_from_share",
    "ipc_mem_handle",
    "new_shared_cuda_args",
    "sweep",
]
