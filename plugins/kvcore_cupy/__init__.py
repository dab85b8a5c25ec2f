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
* ``write_kv<CB>``, ``copy_pages<CB>`` -- byte copies in CB = 16 (or 8/4/2/1) byte
  chunks (dtype-free); ``write_kv_fp8<T>`` -- quantizing writes into fp8 caches.

Features (kvcore.backend.Attention and the cache kinds; ``Capabilities.features``):

* fp8 caches (float8_e4m3fn, float8_e5m2): K/V bytes are converted to fp32 in
  registers by integer bit manipulation (no cuda_fp8.h: NVRTC gets no headers),
  exact for every byte; k_scale is folded into the query scale and v_scale into the
  output, so attention is dequantize-then-attend in fp32. Query and output are fp32
  inside the kernels (the host converts from and to the query's dtype). A wide load
  is 8 bytes, so a lane holds as many elements per row as with 16-bit dtypes (same
  registers). ``write_kv_fp8`` stores ``x / scale`` saturated to the largest finite
  value, rounded to nearest even (bit-identical to kvcore_torch.quantize).
* window: each query's loop starts at ``max(0, p - window_left)``; pages before it
  are never touched, their block-table entries included; decode splits cover the
  window only.
* soft_cap: ``cap * tanh(logit / cap)`` per score, before masking (tanhf).
* sinks: one logit per query head joins the final normalisation (with one split in
  decode_partial/prefill, as one more log-sum-exp term in decode_merge).
* not mla: latent caches raise Unsupported naming "mla". The kernels would take
  one (a single kv head whose V row is a prefix of its K row), but not its sizes:
  each instantiation is compiled for one head dim, and a lane keeps its share of q
  and of the output in registers (kE floats each per query head). DeepSeek's
  D = 576 (512 + 64) gives kE = 24: four query heads per CTA would not fit the
  128 registers of the split-KV decode (it spills), and one head per CTA re-reads
  the latent once per query head (MQA over 16..128 heads). MLA wants a kernel of
  its own (D split across warps, q in shared memory, tensor cores), not this one.

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

Declared: devices {cuda}; dtypes fp32/fp16/bf16/fp8 (e4m3fn, e5m2); features fp8,
window, soft_cap, sinks (not mla); head dims 64, 80, 96, 128, 256;
page sizes 1..128 (any); GQA/MQA with any Hq multiple of Hkv (groups above 4
are cut into chunks of 4 query heads, each chunk reading K/V once). Any strides
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
