"""kvcore_triton: paged-attention kernels in Triton (entry point ``triton``).

Modules, one job each: :mod:`~kvcore_triton.decode` (split-KV decode),
:mod:`~kvcore_triton.prefill` (varlen causal prefill over a cached prefix),
:mod:`~kvcore_triton.cache_ops` (write_kv, copy_pages),
:mod:`~kvcore_triton.backend` (the :class:`TritonBackend` over them).

On a machine without CUDA set ``TRITON_INTERPRET=1`` before importing this
package to run the kernels in Triton's interpreter (CPU tensors, slow).
"""

from kvcore_triton.backend import TritonBackend

__all__ = ["TritonBackend"]
