"""CuPy glue: compiled modules, launches on torch's current stream.

Imported only by :class:`kvcore_cupy.CupyBackend` after it has checked that cupy
and a CUDA device are there. Modules are compiled lazily, one ``RawModule`` per
(file, dtype, head dim, wide), with every group tile of that combination as a
name expression; CuPy caches the cubins on disk, so a process pays NVRTC once per
combination and machine.

Tensors reach kernels as raw device pointers (``numpy.uint64`` arguments), not as
DLPack-imported arrays: the call is enqueued on torch's current stream (wrapped in
a ``cupy.cuda.ExternalStream``), the tensors stay alive in the caller for the
duration of the launch and torch's caching allocator orders their reuse on that
stream, so zero-copy needs nothing more. (``cupy.from_dlpack`` costs ~10 us per
tensor; five tensors a call would be a quarter of a decode's kernel time.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import cupy
import torch

from kvcore_cupy import kernels


class Modules:
    """Lazily compiled RawModules keyed by (file, dtype, head_dim, wide); per backend."""

    def __init__(self) -> None:
        self._attention: dict[tuple[str, str, int, bool], Any] = {}
        self._cache_ops: Any = None

    def function(self, file: str, dtype: str, head_dim: int, wide: bool, name: str) -> Any:
        key = (file, dtype, head_dim, wide)
        module = self._attention.get(key)
        if module is None:
            module = cupy.RawModule(
                code=kernels.source(file),
                options=kernels.options(),
                name_expressions=kernels.module_names(file, dtype, head_dim, wide),
            )
            self._attention[key] = module
        return module.get_function(name)

    def cache_op(self, name: str) -> Any:
        if self._cache_ops is None:
            self._cache_ops = cupy.RawModule(
                code=kernels.source(kernels.CACHE_OPS_FILE),
                options=kernels.options(),
                name_expressions=list(kernels.CACHE_OPS_KERNELS),
            )
        return self._cache_ops.get_function(name)


@contextlib.contextmanager
def on_torch_stream(device: torch.device) -> Iterator[None]:
    """Make cupy launch on ``device`` and on torch's current stream there."""
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        yield
