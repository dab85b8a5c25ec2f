"""TritonBackend: the kvcore kernel API on the Triton kernels of this package.

On a GPU the kernels are compiled by Triton. On a CPU-only machine they run
under Triton's interpreter, which Triton enables only when ``TRITON_INTERPRET=1``
is set *before* this package is imported (``@triton.jit`` reads it while
decorating); tests/conftest.py does that. The capabilities follow what the
import got: interpreted kernels take CPU tensors, compiled kernels CUDA
tensors, and a call on the other device raises Unsupported instead of failing
inside Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.backend import Backend, Capabilities
from kvcore_triton import cache_ops, decode, prefill

if TYPE_CHECKING:
    import torch

#: True when the kernels were created by the interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED: bool = type(decode._decode_split_kernel).__name__ == "InterpretedFunction"


class TritonBackend(Backend):
    """Split-KV decode (GQA-packed ``tl.dot``), paged prefill, write_kv, copy_pages.

    Supports fp32/fp16/bf16 caches, head dims 1..256 (masked to a power-of-two
    tile), every page size 1..128, GQA/MQA. On a GPU, fp32 ``tl.dot`` runs in
    TF32 (exact for fp16/bf16 K/V, ~1e-3 relative on fp32 data).
    """

    name = "triton"

    def __init__(self) -> None:
        self.interpreted = INTERPRETED
        self.capabilities = Capabilities(
            devices=frozenset({"cpu"} if INTERPRETED else {"cuda"}),
            dtypes=frozenset({"float32", "float16", "bfloat16"}),
            head_dims=None,
            page_sizes=None,
        )

    def _write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        cache_ops.write_kv(kv_cache, key, value, slots)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return decode.decode(
            query, kv_cache, block_table, seq_lens, scale, interpreted=self.interpreted
        )

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return prefill.prefill(query, kv_cache, block_table, cu_seqlens_q, seq_lens, scale)

    def _copy_pages(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        cache_ops.copy_pages(kv_cache, src, dst)
