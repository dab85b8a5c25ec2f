"""The CUDA sources of this backend and the template instantiations it uses.

Pure Python (no cupy, no torch): the backend (through CuPy ``RawModule``) and the
CI compile test (through ``nvcc``) both take the kernel list from here, so CI
compiles exactly the instantiations a GPU would.

Templates (see the ``.cu`` headers):

* ``decode_partial<T, D, NG, WIDE>`` and ``prefill<T, D, NG, WIDE>`` in decode.cu /
  prefill.cu,
* ``decode_merge<T>`` in decode.cu,
* ``write_kv<CB>`` and ``copy_pages<CB>`` (dtype-free byte copies) and
  ``write_kv_fp8<T>`` (quantizing fp32 key/value into an fp8 cache) in cache_ops.cu,

with ``T`` the storage type (``float``, the raw 16-bit ``kv_f16`` / ``kv_bf16``
or the raw 8-bit ``kv_e4m3`` / ``kv_e5m2``, whose queries and outputs are fp32),
``D`` the head dim in elements, ``NG`` the number of query heads
of one kv head that a CTA (decode) or warp (prefill) handles together, ``WIDE``
whether K/V rows are read in 16-byte vectors (8-byte for fp8; aligned cache
views) or one element at a time, and ``CB`` the bytes one thread copies (16, 8,
4, 2 or 1).
"""

from __future__ import annotations

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

#: torch dtype name -> the kernels' storage type
C_TYPES: dict[str, str] = {
    "float32": "float",
    "float16": "kv_f16",
    "bfloat16": "kv_bf16",
    "float8_e4m3fn": "kv_e4m3",
    "float8_e5m2": "kv_e5m2",
}
#: fp8 cache dtypes: their queries and outputs are fp32 (the host converts), K/V are
#: dequantized on load (times k_scale / v_scale) and write_kv_fp8 quantizes
FP8_DTYPES: frozenset[str] = frozenset({"float8_e4m3fn", "float8_e5m2"})
#: the kvcore.backend.FEATURES these kernels compute (see the .cu headers): fp8 caches,
#: sliding windows, soft-capping, sinks. Not "mla" (the package docstring says why).
FEATURES: frozenset[str] = frozenset({"fp8", "window", "soft_cap", "sinks"})
#: head dims (elements) with a compiled instantiation; each row is a whole number of
#: 16-byte chunks for every dtype
HEAD_DIMS: tuple[int, ...] = (64, 80, 96, 128, 256)
#: query heads per CTA/warp; a larger GQA group is cut into chunks of the largest
#: (a tile of 8 held 2 x 8 x kE fp32 per lane: up to 255 registers, 2 CTAs per SM)
GROUP_TILES: tuple[int, ...] = (1, 2, 4)

ATTENTION_FILES: tuple[str, ...] = ("decode.cu", "prefill.cu")
CACHE_OPS_FILE = "cache_ops.cu"
#: bytes one thread of write_kv / copy_pages moves, widest first (1: fp8 views only)
COPY_CHUNK_BYTES: tuple[int, ...] = (16, 8, 4, 2, 1)
CACHE_OPS_KERNELS: tuple[str, ...] = (
    *(f"{kernel}<{cb}>" for kernel in ("write_kv", "copy_pages") for cb in COPY_CHUNK_BYTES),
    *(f"write_kv_fp8<{C_TYPES[dtype]}>" for dtype in sorted(FP8_DTYPES)),
)
ALL_FILES: tuple[str, ...] = (*ATTENTION_FILES, CACHE_OPS_FILE)


def _flag(wide: bool) -> str:
    return "true" if wide else "false"


def decode_partial_name(dtype: str, head_dim: int, group_tile: int, wide: bool) -> str:
    return f"decode_partial<{C_TYPES[dtype]}, {head_dim}, {group_tile}, {_flag(wide)}>"


def decode_merge_name(dtype: str) -> str:
    """The merge writes the output dtype: the cache's, fp32 for an fp8 cache."""
    return f"decode_merge<{'float' if dtype in FP8_DTYPES else C_TYPES[dtype]}>"


def prefill_name(dtype: str, head_dim: int, group_tile: int, wide: bool) -> str:
    return f"prefill<{C_TYPES[dtype]}, {head_dim}, {group_tile}, {_flag(wide)}>"


def write_fp8_name(dtype: str) -> str:
    return f"write_kv_fp8<{C_TYPES[dtype]}>"


def copy_name(kernel: str, chunk_bytes: int) -> str:
    """``write_kv<16>`` etc.; ``kernel`` is "write_kv" or "copy_pages"."""
    return f"{kernel}<{chunk_bytes}>"


def module_names(file: str, dtype: str, head_dim: int, wide: bool) -> list[str]:
    """Name expressions of one (file, dtype, head dim, wide) module, as the backend
    compiles it: every group tile (and, for decode, the merge)."""
    if file == "decode.cu":
        tiles = [decode_partial_name(dtype, head_dim, g, wide) for g in GROUP_TILES]
        return [*tiles, decode_merge_name(dtype)]
    if file == "prefill.cu":
        return [prefill_name(dtype, head_dim, g, wide) for g in GROUP_TILES]
    raise ValueError(f"{file} has no per-dtype instantiations")


def all_name_expressions() -> dict[str, list[str]]:
    """Every instantiation the backend may ask for, per file (deduplicated)."""
    names: dict[str, list[str]] = {}
    for file in ATTENTION_FILES:
        seen: dict[str, None] = {}
        for dtype in C_TYPES:
            for head_dim in HEAD_DIMS:
                for wide in (True, False):
                    seen.update(dict.fromkeys(module_names(file, dtype, head_dim, wide)))
        names[file] = list(seen)
    names[CACHE_OPS_FILE] = list(CACHE_OPS_KERNELS)
    return names


INCLUDE_LINE = '#include "common.cuh"'


def source(file: str) -> str:
    """The text of a kernel file with ``common.cuh`` pasted in place of its #include.

    One self-contained text: NVRTC needs no include path, and CuPy's compile cache
    (keyed by the source text and options) sees every change to common.cuh.
    ``#line`` directives keep compiler messages pointing at the real files.
    """
    text = (KERNEL_DIR / file).read_text()
    if INCLUDE_LINE not in text:
        return text
    common = (KERNEL_DIR / "common.cuh").read_text().replace("#pragma once\n", "\n")
    head, tail = text.split(INCLUDE_LINE, 1)
    after = head.count("\n") + 2  # the line after the #include, 1-based
    return f'{head}#line 1 "common.cuh"\n{common}#line {after} "{file}"{tail}'


def options() -> tuple[str, ...]:
    """Compiler options valid for NVRTC and nvcc alike."""
    return ("--std=c++17",)
