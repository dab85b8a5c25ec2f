"""kvcore_triton: paged-attention kernels in Triton (entry point ``triton``).

Modules, one job each: :mod:`~kvcore_triton.decode` (split-KV decode kernels),
:mod:`~kvcore_triton.decode_plan` (their launch shape: tiles, split count),
:mod:`~kvcore_triton.prefill` (varlen causal prefill over a cached prefix),
:mod:`~kvcore_triton.paged` (the paged-row walk and soft-cap both share),
:mod:`~kvcore_triton.cache_ops` (write_kv with fp8 quantization, copy_pages),
:mod:`~kvcore_triton.backend` (the :class:`TritonBackend` over them). Every
feature of :class:`kvcore.backend.Attention` (window, soft-cap, sinks, MLA) and
fp8 caches are constexpr variants of the same kernels.

On a machine without CUDA set ``TRITON_INTERPRET=1`` before importing this
package to run the kernels in Triton's interpreter (CPU tensors, slow).
"""

from kvcore_triton.backend import TritonBackend

__all__ = ["TritonBackend"]
