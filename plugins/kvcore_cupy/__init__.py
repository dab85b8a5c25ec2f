"""kvcore_cupy: paged-attention kernels in CUDA C++, loaded through CuPy ``RawModule``.

GPU only. ``CupyBackend()`` raises :class:`kvcore.errors.Unsupported` where cupy
or a CUDA device is missing; importing this package needs neither.

The kernels (``*.cu``, ``common.cuh``; their header comments have the details):

* ``decode_partial<T, D, NG>`` + ``decode_merge<T>`` -- split-KV decode
  (flash-decoding): per-split partial outputs and log-sum-exp, then a merge.
  One CTA (4 warps) holds the NG query heads of one kv head, so each K/V row is
  read from memory once per GQA group; splits are chosen to put ~4 CTAs on each
  SM (132 on an H100/H200).
* ``prefill<T, D, NG>`` -- varlen causal attention over a cached prefix
  (bottom-right aligned), one warp per query row and kv head, online softmax.
* ``write_kv``, ``copy_pages`` -- 16-byte byte-copies (dtype-free).

Performance choices, for the decode bandwidth target (>= 70 % of copy bandwidth
at B=64, ctx 4096, Hq=32, Hkv=8, D=128, bf16, page 16): 16-byte vector loads
along D (a bf16 row of 128 is 16 lanes x 16 bytes, two tokens per warp step),
2 * 4 independent loads in flight per lane, q pre-scaled by scale * log2(e) and
kept in registers, ``ex2.approx`` exponentials, one max/rescale per 8 tokens,
warp-level xor-shuffle reductions, and a fast division by the page size
(multiply-high + shift) instead of an integer divide per token.

Numerics: bf16/fp16 arrive as raw 16-bit words and are converted to fp32 in
registers; all arithmetic is fp32; the output is rounded once (round to nearest
even). Tokens past a sequence's length are never loaded, so NaN in unused slots
cannot reach the result.

Declared: devices {cuda}; dtypes fp32/fp16/bf16; head dims 64, 80, 96, 128, 256;
page sizes 1..128 (any); GQA/MQA with any Hq multiple of Hkv (groups above 8
are cut into chunks of 8 query heads, each chunk reading K/V once). The cache
view must be 16-byte aligned (base and strides), else Unsupported.
"""

from __future__ import annotations

from kvcore_cupy.backend import CupyBackend

__all__ = ["CupyBackend"]
