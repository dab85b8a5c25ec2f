"""kvcore_cupy: paged-attention kernels in CUDA C++, loaded through CuPy ``RawModule``.

GPU only. ``CupyBackend()`` raises :class:`kvcore.errors.Unsupported` where cupy
or a CUDA device is missing; importing this package needs neither.

The kernels (``*.cu``, ``common.cuh``; their header comments have the details):

* ``decode_partial<T, D, NG, WIDE>`` + ``decode_merge<T>`` -- split-KV decode
  (flash-decoding): per-split partial outputs and log-sum-exp, then a merge.
  One CTA (4 warps) holds the NG query heads of one kv head, so each K/V row is
  read from memory once per GQA group; splits are chosen to put ~4 CTAs on each
  SM (132 on an H100/H200).
* ``prefill<T, D, NG, WIDE>`` -- varlen causal attention over a cached prefix
  (bottom-right aligned), one warp per query row and kv head, online softmax.
* ``write_kv<CB>``, ``copy_pages<CB>`` -- byte copies in CB = 16 (or 8/4/2) byte
  chunks (dtype-free).

kvcore_cupy.kernels lists every instantiation (the backend compiles them with
NVRTC per (file, dtype, head dim, WIDE) on first use; tests/test_cuda_compile.py
compiles all of them with nvcc for sm_90), kvcore_cupy.plan does the launch
arithmetic, and the test suite's CPU emulation (tests/cupy_emulation, not part
of the wheel) runs the same kernels on the CPU (g++ and a fiber scheduler that
emulates warps) so that CI checks them without a GPU.

Performance choices, for the decode bandwidth target (>= 70 % of copy bandwidth
at B=64, ctx 4096, Hq=32, Hkv=8, D=128, bf16, page 16): 16-byte vector loads
along D (a bf16 row of 128 is 16 lanes x 16 bytes, two tokens per warp step),
2 * 4 independent loads in flight per lane, q pre-scaled by scale * log2(e) and
kept in registers, ``ex2.approx`` exponentials, one max/rescale per 4 tokens,
warp-level xor-shuffle reductions, and a fast division by the page size
(multiply-high + shift) instead of an integer divide per token.

Numerics: bf16/fp16 arrive as raw 16-bit words and are converted to fp32 in
registers; all arithmetic is fp32; the output is rounded once (round to nearest
even). Tokens past a sequence's length are never loaded, so NaN in unused slots
cannot reach the result.

Declared: devices {cuda}; dtypes fp32/fp16/bf16; head dims 64, 80, 96, 128, 256;
page sizes 1..128 (any); GQA/MQA with any Hq multiple of Hkv (groups above 8
are cut into chunks of 8 query heads, each chunk reading K/V once). Any strides
with a contiguous last dim: a cache view whose base or strides are not multiples
of 16 bytes (a slice of a padded pool) takes the WIDE = false instantiations,
which load one element per lane instead of 16 bytes.

Runs read no device value: the plan (kvcore.backend) validated the tables and
holds the step's longest sequence on the host, which bounds the decode splits.

Not done: tensor cores (prefill is CUDA-core only, fine for short prompts over a
long cached prefix, slow for long fresh prompts), CUDA-graph capture (decode
allocates its split buffers per call).
"""

from __future__ import annotations

from kvcore_cupy.backend import CupyBackend

__all__ = ["CupyBackend"]
