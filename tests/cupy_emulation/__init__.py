"""Run kvcore_cupy's CUDA kernels on the CPU, for tests on machines without a GPU.

A test asset, not part of the wheel (tests/test_backend_cupy.py imports it).
:class:`EmulatedCupyBackend` is :class:`kvcore_cupy.CupyBackend` -- the same host
code (planning, argument marshalling, splits, merges) and the very same ``.cu``
sources -- with the kernels compiled by ``g++`` against ``host_emu.h`` (a CPU
fiber scheduler that gives each CUDA thread a fiber and emulates warp shuffles
and ``__syncthreads``) instead of by NVRTC, and launched on CPU tensors.

What it proves: indexing, paging, strides, causal bounds, split-KV and its
merge, GQA tiling and dtype conversions. What it cannot: speed, coalescing,
races between CTAs, or NVRTC-specific compile errors (tests/test_cuda_compile.py
runs nvcc for those). It is slow (one OS thread, a context switch per shuffle):
keep shapes small. Needs ``g++`` (C++17, ``_Float16``); Unsupported otherwise.

Compiled modules are cached under ``$TMPDIR/kvcore_cupy_emu`` by a hash of the
sources, the name expressions and the flags.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from kvcore_cupy import kernels
from kvcore_cupy.backend import CupyBackend

from kvcore.backend import Capabilities
from kvcore.errors import Unsupported

if TYPE_CHECKING:
    import torch

EMU_DIR = Path(__file__).resolve().parent
CXX_FLAGS: tuple[str, ...] = ("-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-U_FORTIFY_SOURCE")

_CTYPES: dict[type, type] = {
    np.uint64: ctypes.c_uint64,
    np.int64: ctypes.c_int64,
    np.int32: ctypes.c_int32,
    np.uint32: ctypes.c_uint32,
    np.float32: ctypes.c_float,
}


class EmulatedFunction:
    """One kernel instantiation; called like ``cupy.RawKernel``: ``fn(grid, block, args)``."""

    def __init__(self, entry: Any) -> None:
        self._entry = entry

    def __call__(
        self, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple[Any, ...]
    ) -> None:
        assert block[1] == block[2] == 1, "kernels use 1-D blocks"
        values = []
        for a in args:
            ctype = _CTYPES.get(type(a))
            assert ctype is not None, f"unsupported kernel argument {a!r} ({type(a)})"
            values.append(ctype(a))
        argv = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        self._entry(*grid, block[0], argv)


class EmulatedModules:
    """The CPU counterpart of kvcore_cupy.runtime.Modules (same keys, same names)."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self._cache_dir = cache_dir or Path(tempfile.gettempdir()) / "kvcore_cupy_emu"
        self._libs: dict[tuple[str, tuple[str, ...]], tuple[ctypes.CDLL, list[str]]] = {}

    def function(
        self, file: str, dtype: str, head_dim: int, wide: bool, name: str
    ) -> EmulatedFunction:
        return self._get(file, tuple(kernels.module_names(file, dtype, head_dim, wide)), name)

    def cache_op(self, name: str) -> EmulatedFunction:
        return self._get(kernels.CACHE_OPS_FILE, kernels.CACHE_OPS_KERNELS, name)

    def _get(self, file: str, names: tuple[str, ...], name: str) -> EmulatedFunction:
        key = (file, names)
        if key not in self._libs:
            self._libs[key] = (self._build(file, names), list(names))
        lib, listed = self._libs[key]
        entry = getattr(lib, f"kvemu_{listed.index(name)}")
        entry.restype = None
        entry.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_void_p]
        return EmulatedFunction(entry)

    def _build(self, file: str, names: tuple[str, ...]) -> ctypes.CDLL:
        code = emulation_source(file, names)
        digest = hashlib.sha256(
            "\0".join(
                [
                    code,
                    kernels.source(file),
                    kernels.source("common.cuh"),
                    (EMU_DIR / "host_emu.h").read_text(),
                    *CXX_FLAGS,
                ]
            ).encode()
        ).hexdigest()[:24]
        self._cache_dir.mkdir(parents=True, exist_ok=True)
        lib = self._cache_dir / f"{digest}.so"
        if not lib.exists():
            src = self._cache_dir / f"{digest}.cpp"
            src.write_text(code)
            tmp = self._cache_dir / f"{digest}.{os.getpid()}.so"
            cmd = ["g++", *CXX_FLAGS, f"-I{EMU_DIR}", f"-I{kernels.KERNEL_DIR}", str(src)]
            done = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"g++ failed on {file}:\n{done.stderr[-4000:]}")
            os.replace(tmp, lib)  # atomic: concurrent builders agree
        return ctypes.CDLL(str(lib))


def emulation_source(file: str, names: tuple[str, ...]) -> str:
    """C++ that includes the emulation shim and a kernel file, and exports one
    ``kvemu_<i>(gx, gy, gz, bx, void** args)`` launcher per name expression."""
    lines = ['#include "host_emu.h"', f'#include "{file}"', ""]
    for i, name in enumerate(names):
        lines.append(
            f'extern "C" void kvemu_{i}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
            f"void** args) {{ emu::launch_kernel(&{name}, dim3{{gx, gy, gz}}, "
            f"dim3{{bx, 1, 1}}, args); }}"
        )
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _no_stream(device: torch.device) -> Iterator[None]:
    yield


class EmulatedCupyBackend(CupyBackend):
    """CupyBackend on CPU tensors through the emulation (tests only; slow).

    ``num_sms``, ``split_min`` and ``split_align`` shape the decode split plan so
    that short test sequences still run several splits and the merge kernel.
    """

    name = "cupy-emulated"
    capabilities = Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=CupyBackend.capabilities.dtypes,
        head_dims=CupyBackend.capabilities.head_dims,
        page_sizes=None,
        features=CupyBackend.capabilities.features,
    )

    def __init__(self, *, num_sms: int = 8, split_min: int = 16, split_align: int = 8) -> None:
        # deliberately not CupyBackend.__init__: no cupy, no CUDA
        if shutil.which("g++") is None:
            raise Unsupported("the CPU emulation of the cupy kernels needs g++")
        self._modules = EmulatedModules()
        self._on_stream = _no_stream
        self._num_sms = {0: num_sms}
        self._split_min = split_min
        self._split_align = split_align
