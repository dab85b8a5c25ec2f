"""CupyBackend: the four kernel operations as CUDA C++ (the .cu files beside this),
compiled by NVRTC through CuPy ``RawModule`` and launched on torch's current stream.

Host side only: layout checks this backend needs beyond kvcore.backend's boundary
validation (16-byte alignment for vector loads), launch planning (kvcore_cupy.plan)
and the launches (kvcore_cupy.runtime). Inputs arrive validated (shapes, dtypes,
devices, page indices in range; see kvcore.backend.Backend); the plan's host copy
of the lengths bounds the decode splits, so a launch reads no device value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvcore.backend import (
    Attention,
    AttentionPlan,
    Backend,
    Capabilities,
    CopyPlan,
    DecodePlan,
    PrefillPlan,
    WritePlan,
)
from kvcore.errors import Unsupported
from kvcore.layout import cdiv
from kvcore_cupy import kernels
from kvcore_cupy import plan as launch

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    import torch

LOG2E = 1.4426950408889634
_WARPS = 4  # warps per CTA in decode_partial and prefill (KV_*_WARPS in the .cu files)
_COPY_THREADS = 256
_MAX_GRID_YZ = 65535


class KernelSource(Protocol):
    """Where launchable kernels come from: CuPy RawModules (kvcore_cupy.runtime) or the
    CPU emulation (tests/cupy_emulation). A kernel is called as
    ``fn(grid, block, args)`` like a ``cupy.RawKernel``."""

    def function(self, file: str, dtype: str, head_dim: int, wide: bool, name: str) -> Any: ...

    def cache_op(self, name: str) -> Any: ...


class CupyBackend(Backend):
    """Paged attention in CUDA C++ via CuPy; cuda only, fp32/fp16/bf16 and fp8
    (e4m3fn, e5m2) caches, head dims 64/80/96/128/256, any page size 1..128, GQA/MQA
    (any Hq multiple of Hkv). Features (kvcore.backend.Attention): fp8, sliding
    windows, soft-capping, sinks; not MLA (latent caches raise Unsupported naming
    "mla": see the package docstring).

    Construction raises :class:`~kvcore.errors.Unsupported` where cupy or a CUDA
    device is missing, so ``kvcore.backend.get("cupy")`` fails cleanly there.
    """

    name = "cupy"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset(kernels.C_TYPES),
        head_dims=frozenset(kernels.HEAD_DIMS),
        page_sizes=None,
        features=kernels.FEATURES,
    )

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise Unsupported("cupy is not installed (pip install kvcore[cupy])") from exc
        except Exception as exc:  # a broken install (missing CUDA libraries, ...)
            raise Unsupported(f"cupy cannot be imported: {exc}") from exc
        import torch

        if not torch.cuda.is_available():
            raise Unsupported("no CUDA device (torch.cuda.is_available() is False)")
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as exc:
            raise Unsupported(f"no CUDA device for cupy: {exc}") from exc
        if count < 1:
            raise Unsupported("no CUDA device for cupy")
        from kvcore_cupy import runtime

        self._modules: KernelSource = runtime.Modules()
        self._on_stream: Callable[[torch.device], AbstractContextManager[None]] = (
            runtime.on_torch_stream
        )
        self._num_sms: dict[int, int] = {}
        self._split_min = launch.MIN_SPLIT_TOKENS  # tokens; see kvcore_cupy.plan.split_plan
        self._split_align = launch.SPLIT_ALIGN

    # -- operations ----------------------------------------------------------------

    def _write_kv(
        self,
        plan: WritePlan,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Byte copies into a 16/32-bit cache; on an fp8 cache write_kv_fp8 quantizes
        (x / scale, saturated, round to nearest even) from fp32 rows."""
        slots, spec = plan.slots, plan.cache
        num_tokens, hkv, d = key.shape
        sp, skv, stok, shead = _byte_strides(kv_cache)
        if spec.fp8:  # quantize fp32 rows, one element per thread
            key, value = _dense(key.float()), _dense(value.float())
            name = kernels.write_fp8_name(spec.dtype_name)
            total = num_tokens * hkv * d
            row_args: tuple[Any, ...] = (_i32(hkv), _i32(d))
            tail: tuple[Any, ...] = (_f32(k_scale), _f32(v_scale))
        else:  # byte copies of cb-byte chunks
            key, value = _dense(key), _dense(value)
            cb = chunk_bytes(kv_cache)
            name = kernels.copy_name("write_kv", cb)
            row_chunks = d * key.element_size() // cb
            total = num_tokens * hkv * row_chunks
            row_args, tail = (_i32(hkv), _i32(row_chunks)), ()
        blocks = min(cdiv(total, _COPY_THREADS), 32 * self._sms(kv_cache))
        with self._on_stream(kv_cache.device):
            _launch(
                self._modules.cache_op(name),
                (blocks, 1, 1),
                _COPY_THREADS,
                (
                    _ptr(key), _ptr(value), _ptr(slots), _i64(num_tokens), *row_args,
                    _ptr(kv_cache), _i64(sp), _i64(skv), _i64(stok), _i64(shead),
                    _i64(spec.page_size), *tail,
                ),
            )  # fmt: skip

    def _decode(
        self,
        plan: DecodePlan,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        import torch

        block_table, seq_lens, att = plan.block_table, plan.seq_lens, plan.attention
        q = _rows_in(query, plan)
        wide = chunk_bytes(kv_cache) == 16
        batch, hq, d = q.shape
        page_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
        dtype = _dtype_name(kv_cache)
        tiling = launch.group_tiling(hq // hkv)
        # a window bounds the tokens of every sequence: splits cover those only
        span = plan.max_seq_len
        if att.window_left >= 0:
            span = min(span, att.window_left + 1)
        splits = launch.split_plan(
            span,
            batch * hkv * tiling.n_chunks,
            self._sms(kv_cache),
            min_split=self._split_min,
            align=self._split_align,
        )
        fd = launch.fast_divisor(page_size)
        out = torch.empty_like(q)
        s = splits.num_splits
        if s > 1:
            part_out = torch.empty((batch, hq, s, d), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((batch, hq, s), dtype=torch.float32, device=q.device)
            part_args: tuple[Any, Any] = (_ptr(part_out), _ptr(part_lse))
        else:
            part_args = (_ptr_null(), _ptr_null())
        sink_arg, sinks = _sinks(sinks)
        with self._on_stream(q.device):
            fn = self._modules.function(
                "decode.cu",
                dtype,
                d,
                wide,
                kernels.decode_partial_name(dtype, d, tiling.tile, wide),
            )
            _launch(
                fn,
                (batch, hkv * tiling.n_chunks, s),
                _WARPS * 32,
                (
                    _ptr(q), _ptr(kv_cache), *_elem_strides(kv_cache),
                    _ptr(block_table), _i64(block_table.stride(0)), _ptr(seq_lens),
                    _i32(hq), _i32(hq // hkv), _i32(tiling.n_chunks),
                    _f32(scale * k_scale * LOG2E),
                    _u32(fd.d), _u32(fd.mul), _u32(fd.shift),
                    _i32(splits.split_len), _i32(s),
                    *_options(att, sink_arg, v_scale),
                    _ptr(out), *part_args,
                ),
            )  # fmt: skip
            if s > 1:
                merge = self._modules.function(
                    "decode.cu", dtype, d, wide, kernels.decode_merge_name(dtype)
                )
                _launch(
                    merge,
                    (batch * hq, 1, 1),
                    128,
                    (*part_args, _i32(s), _i32(d), sink_arg, _i32(hq), _ptr(out)),
                )
        return out.to(query.dtype)  # fp32 -> the query's dtype on an fp8 cache

    def _prefill(
        self,
        plan: PrefillPlan,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        import torch

        block_table, cu_seqlens_q, seq_lens = plan.block_table, plan.cu_seqlens_q, plan.seq_lens
        q = _rows_in(query, plan)
        wide = chunk_bytes(kv_cache) == 16
        total_q, hq, d = q.shape
        page_size, hkv = kv_cache.shape[2], kv_cache.shape[3]
        dtype = _dtype_name(kv_cache)
        tiling = launch.group_tiling(hq // hkv)
        fd = launch.fast_divisor(page_size)
        out = torch.empty_like(q)
        sink_arg, sinks = _sinks(sinks)
        with self._on_stream(q.device):
            fn = self._modules.function(
                "prefill.cu", dtype, d, wide, kernels.prefill_name(dtype, d, tiling.tile, wide)
            )
            _launch(
                fn,
                (cdiv(total_q, _WARPS), hkv * tiling.n_chunks, 1),
                _WARPS * 32,
                (
                    _ptr(q), _ptr(kv_cache), *_elem_strides(kv_cache),
                    _ptr(block_table), _i64(block_table.stride(0)),
                    _ptr(cu_seqlens_q), _ptr(seq_lens),
                    _i32(seq_lens.shape[0]), _i32(total_q),
                    _i32(hq), _i32(hq // hkv), _i32(tiling.n_chunks),
                    _f32(scale * k_scale * LOG2E),
                    _u32(fd.d), _u32(fd.mul), _u32(fd.shift),
                    *_options(plan.attention, sink_arg, v_scale),
                    _ptr(out),
                ),
            )  # fmt: skip
        return out.to(query.dtype)

    def _copy_pages(self, plan: CopyPlan, kv_cache: torch.Tensor) -> None:
        src, dst = plan.src, plan.dst
        _, _, page_size, hkv, d = kv_cache.shape
        cb = chunk_bytes(kv_cache)
        row_chunks = d * kv_cache.element_size() // cb
        per_page = 2 * page_size * hkv * row_chunks
        blocks = min(cdiv(per_page, _COPY_THREADS), 1024)
        sp, skv, stok, shead = _byte_strides(kv_cache)
        fn = self._modules.cache_op(kernels.copy_name("copy_pages", cb))
        with self._on_stream(kv_cache.device):
            for lo in range(0, src.shape[0], _MAX_GRID_YZ):  # grid.y holds at most 65535
                n = min(_MAX_GRID_YZ, src.shape[0] - lo)
                _launch(
                    fn,
                    (blocks, n, 1),
                    _COPY_THREADS,
                    (
                        _ptr(kv_cache), _i64(sp), _i64(skv), _i64(stok), _i64(shead),
                        _ptr(src[lo:]), _ptr(dst[lo:]),
                        _i32(page_size), _i32(hkv), _i32(row_chunks),
                    ),
                )  # fmt: skip

    # -- helpers -------------------------------------------------------------------

    def _sms(self, t: torch.Tensor) -> int:
        import torch

        index = t.device.index or 0
        if index not in self._num_sms:
            props = torch.cuda.get_device_properties(index)
            self._num_sms[index] = int(props.multi_processor_count)
        return self._num_sms[index]


# -- kernel arguments: what cupy's RawKernel (and the emulation) take ------------------


def _launch(fn: Any, grid: tuple[int, int, int], block: int, args: tuple[Any, ...]) -> None:
    fn(grid, (block, 1, 1), args)


def _ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's address as a pointer argument (the tensor must outlive the launch)."""
    return np.uint64(t.data_ptr())


def _ptr_null() -> np.uint64:
    """A null pointer argument (for a buffer a launch does not use)."""
    return np.uint64(0)


def _i64(x: int) -> np.int64:
    return np.int64(x)


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _u32(x: int) -> np.uint32:
    return np.uint32(x)


def _f32(x: float) -> np.float32:
    return np.float32(x)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _rows_in(query: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """The query as the kernels read it: dense, in fp32 on an fp8 cache (Io<T>)."""
    import torch

    return _dense(query.to(torch.float32) if plan.cache.fp8 else query)


def _sinks(sinks: torch.Tensor | None) -> tuple[np.uint64, torch.Tensor | None]:
    """The sinks pointer argument (null: none) and the dense tensor it points at (kept
    alive by the caller for the launch)."""
    if sinks is None:
        return _ptr_null(), None
    sinks = _dense(sinks)
    return _ptr(sinks), sinks


def _options(attention: Attention, sink_arg: np.uint64, out_mult: float) -> tuple[Any, ...]:
    """The attention kernels' option arguments: window_left (tokens, -1 none),
    cap * log2(e) (0 off), the sinks pointer and the output multiplier (v_scale)."""
    return (
        _i32(attention.window_left),
        _f32(attention.logits_soft_cap * LOG2E),
        sink_arg,
        _f32(out_mult),
    )


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned base (a copy only where it is not)."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def _elem_strides(kv_cache: torch.Tensor) -> tuple[Any, Any, Any, Any]:
    """Strides of (page, kv, token, head), in elements, as kernel int64 arguments."""
    sp, skv, stok, shead, _ = kv_cache.stride()
    return (np.int64(sp), np.int64(skv), np.int64(stok), np.int64(shead))


def _byte_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Strides of (page, kv, token, head), in bytes."""
    size = kv_cache.element_size()
    sp, skv, stok, shead, _ = kv_cache.stride()
    return sp * size, skv * size, stok * size, shead * size


def chunk_bytes(kv_cache: torch.Tensor) -> int:
    """The widest load (16, 8, 4 or 2 bytes) that every row of this cache view allows."""
    return widest_chunk(
        tuple(kv_cache.shape), kv_cache.stride(), kv_cache.data_ptr(), kv_cache.element_size()
    )


def widest_chunk(
    shape: tuple[int, ...], strides: tuple[int, ...], data_ptr: int, element_size: int
) -> int:
    """The largest of kernels.COPY_CHUNK_BYTES (at least the element size) that divides
    a row's size, the base address and the byte stride of every dim longer than 1.

    16 means the attention kernels' WIDE (16-byte vector) path; anything less the
    element-wise path. Strides of dims of size 1 never move the address.
    """
    row = shape[-1] * element_size
    moves = [s * element_size for size, s in zip(shape[:-1], strides[:-1], strict=True) if size > 1]
    for cb in kernels.COPY_CHUNK_BYTES:
        if cb >= element_size and all(x % cb == 0 for x in (row, data_ptr, *moves)):
            return cb
    return element_size
