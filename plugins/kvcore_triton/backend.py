"""TritonBackend: the kvcore kernel API on the Triton kernels of this package.

On a GPU the kernels are compiled by Triton. On a CPU-only machine they run
under Triton's interpreter, which Triton enables only when ``TRITON_INTERPRET=1``
is set *before* this package is imported (``@triton.jit`` reads it while
decorating); tests/conftest.py does that. The capabilities follow what the
import got: interpreted kernels take CPU tensors, compiled kernels CUDA
tensors, and a call on the other device raises Unsupported instead of failing
inside Triton.

Plans precompute what the launches need from the host, so a run reads no device
value: decode's split count (from the batch, the KV heads, the SM count and the
longest sequence of the step, or the window) and prefill's longest query run.
The plan's :class:`~kvcore.backend.Attention` options select constexpr kernel
variants; the fp8 scales and the sinks are run arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcore.backend import (
    FEATURES,
    FP8_MAX,
    AttentionPlan,
    Backend,
    Capabilities,
    CopyPlan,
    DecodePlan,
    PrefillPlan,
    WritePlan,
)
from kvcore_triton import cache_ops, decode, decode_plan, prefill

if TYPE_CHECKING:
    import torch

#: True when the kernels were created by the interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED: bool = type(decode._decode_split_kernel).__name__ == "InterpretedFunction"


class TritonBackend(Backend):
    """Split-KV decode (GQA-packed ``tl.dot``), paged prefill, write_kv, copy_pages.

    Supports fp32/fp16/bf16 and fp8 (e4m3fn, e5m2) caches, head dims 1..256
    (masked to a power-of-two tile; latent caches up to 1024), every page size
    1..128, GQA/MQA, and every feature: sliding windows, soft-capping, sinks, MLA.
    On a GPU, decode's fp32 ``tl.dot`` runs in TF32 (exact for fp16/bf16/fp8 K/V,
    ~1e-3 relative on fp32 data); prefill multiplies fp16/bf16 operands on tensor
    cores with fp32 accumulation, fp32 and fp8 ones widened to TF32.
    """

    name = "triton"

    def __init__(self) -> None:
        self.interpreted = INTERPRETED
        self.capabilities = Capabilities(
            devices=frozenset({"cpu"} if INTERPRETED else {"cuda"}),
            dtypes=frozenset({"float32", "float16", "bfloat16", *FP8_MAX}),
            head_dims=None,
            page_sizes=None,
            features=FEATURES,
        )

    def _prepare_decode(self, plan: DecodePlan, kv_cache: torch.Tensor) -> DecodeSplits:
        spec = plan.cache
        max_tokens = max(1, plan.max_seq_len)
        sms = decode_plan.INTERPRETER_SMS if self.interpreted else decode_plan.sm_count(spec.device)
        launch = decode_plan.plan_decode(
            batch=max(1, plan.batch),
            num_kv_heads=spec.num_kv_heads,
            group=1,  # the query's heads are unknown until the run; 1 is a fair guess
            head_dim=spec.head_dim,
            page_size=spec.page_size,
            max_tokens=max_tokens,
            sm_count=sms,
            interpreted=self.interpreted,
            v_head_dim=plan.attention.v_head_dim,
            window_left=plan.attention.window_left,
        )
        return DecodeSplits(launch.num_splits, max_tokens)

    def _prepare_prefill(self, plan: PrefillPlan, kv_cache: torch.Tensor) -> int:
        cu = plan.host_cu_seqlens_q
        return max((cu[b + 1] - cu[b] for b in range(plan.batch)), default=0)

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
        cache_ops.write_kv(kv_cache, key, value, plan.slots, k_scale=k_scale, v_scale=v_scale)

    def _write_latent(
        self, plan: WritePlan, kv_cache: torch.Tensor, latent: torch.Tensor, **scales: float
    ) -> None:
        cache_ops.write_kv(kv_cache, latent, None, plan.slots, k_scale=scales.get("k_scale", 1.0))

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
        splits = plan.prepared
        assert isinstance(splits, DecodeSplits), "a triton decode plan carries its splits"
        return decode.decode(
            query,
            kv_cache,
            plan.block_table,
            plan.seq_lens,
            scale,
            interpreted=self.interpreted,
            num_splits=splits.num_splits,
            max_tokens=splits.max_tokens,
            **_options(plan, k_scale, v_scale, sinks),
        )

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
        assert isinstance(plan.prepared, int), "a triton prefill plan carries max_q_len"
        return prefill.prefill(
            query,
            kv_cache,
            plan.block_table,
            plan.cu_seqlens_q,
            plan.seq_lens,
            scale,
            max_q_len=plan.prepared,
            interpreted=self.interpreted,
            **_options(plan, k_scale, v_scale, sinks),
        )

    def _copy_pages(self, plan: CopyPlan, kv_cache: torch.Tensor) -> None:
        cache_ops.copy_pages(kv_cache, plan.src, plan.dst)


def _options(
    plan: AttentionPlan, k_scale: float, v_scale: float, sinks: torch.Tensor | None
) -> dict[str, Any]:
    """The launch keywords of a plan's Attention options and a run's scales and sinks (a
    latent cache's one vector, V included, is dequantised with ``k_scale``)."""
    attention = plan.attention
    return {
        "window_left": attention.window_left,
        "soft_cap": float(attention.logits_soft_cap),
        "sinks": sinks,
        "v_head_dim": attention.v_head_dim,
        "k_scale": k_scale,
        "v_scale": k_scale if plan.cache.latent else v_scale,
    }


@dataclass(frozen=True, slots=True)
class DecodeSplits:
    """A decode plan's launch choice: ``num_splits`` per (sequence, KV head), over at
    most ``max_tokens`` tokens (the step's longest sequence)."""

    num_splits: int
    max_tokens: int
