"""Multi-head latent attention (MLA, DeepSeek-V2's) on a latent pool, in absorbed form.

transformers' ``DeepseekV2Attention`` expands its latent into per-head K
(qk_nope_head_dim + qk_rope_head_dim) and V (v_head_dim) for the attention function.
A latent pool holds one vector per token and layer instead,
``cat(kv_a_layernorm(c_kv), rope(k_pe))`` of D = kv_lora_rank + qk_rope_head_dim
elements, and the kernels attend over it with ``Attention(v_head_dim=kv_lora_rank)``
(kvcore/backend.py): K is the whole vector, V its first kv_lora_rank elements.

While a paged cache's forward runs in the thread, :func:`bind` makes each MLA module
run :func:`absorbed` (its own forward otherwise, so a DynamicCache run is
transformers' own). Per layer, with W_UK [H, qk_nope, r] and W_UV [H, v, r] the two
blocks of ``kv_b_proj``'s weight (r = kv_lora_rank, H query heads):

* the latent is written with ``cache.update(c_kv [B, 1, q, r], k_pe [B, 1, q, rope],
  layer)``: the two tensors, in the order, the module hands transformers' own cache;
* the query is absorbed, ``cat(q_nope @ W_UK, q_pe)`` [B, H, q, D], so its dot product
  with a latent is the module's ``q_nope . k_nope + q_pe . k_pe`` per head;
* attention with the module's ``scaling`` (1/sqrt(qk_nope + qk_rope), times yarn's
  mscale squared when the rope parameters set ``mscale_all_dim``) gives [B, q, H, r];
  W_UV maps it to each head's V space, [B, q, H, v], then ``o_proj``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2Attention,
    apply_rotary_emb,
)

from kvcore.backend import Attention
from kvcore.errors import Unsupported

__all__ = ["LatentCache", "absorbed", "bind", "latent_dims"]


class LatentCache(Protocol):
    """What :func:`absorbed` needs of the active paged cache."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        scale: float,
        attention: Attention,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor: ...


def latent_dims(model: torch.nn.Module) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of a model whose attention is MLA served here
    (DeepseekV2Attention), None for a model without MLA; Unsupported for another MLA."""
    config: Any = model.config
    text = config.get_text_config(decoder=True)
    if any(isinstance(m, DeepseekV2Attention) for m in model.modules()):
        return int(text.kv_lora_rank), int(text.qk_rope_head_dim)
    if getattr(text, "kv_lora_rank", None):
        raise Unsupported(
            f"model_type {text.model_type!r} has latent attention (kv_lora_rank) in modules "
            "the kvcore cache does not serve (it serves DeepseekV2Attention)"
        )
    return None


def bind(model: torch.nn.Module, active: Callable[[], LatentCache | None]) -> Callable[[], None]:
    """Make every MLA module of ``model`` run :func:`absorbed` while ``active()`` returns
    a cache (its own forward otherwise); returns what undoes it."""
    saved: list[tuple[torch.nn.Module, Any]] = []
    for module in model.modules():
        if isinstance(module, DeepseekV2Attention):
            saved.append((module, module.__dict__.get("forward")))
            module.forward = _switch(module, module.forward, active)

    def undo() -> None:
        for module, forward in saved:
            if forward is None:
                del module.forward
            else:
                module.forward = forward

    return undo


def _switch(
    module: torch.nn.Module,
    original: Callable[..., Any],
    active: Callable[[], LatentCache | None],
) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = active()
        if cache is None:
            return original(*args, **kwargs)
        return absorbed(module, cache, *args, **kwargs)

    return forward


def absorbed(
    module: Any,
    paged: LatentCache,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cache: object = None,
    position_embeddings: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``DeepseekV2Attention.forward`` over the latent pages of ``paged`` (the mask is
    unused: the pages hold only real tokens and the kernels are causal)."""
    assert position_embeddings is not None, "DeepseekV2 layers pass the rope's freqs_cis"
    batch, q = hidden_states.shape[:-1]
    heads, nope, rope = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim
    rank, v_dim = module.kv_lora_rank, module.v_head_dim
    if module.q_lora_rank is None:
        query = module.q_proj(hidden_states)
    else:
        query = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    query = query.view(batch, q, heads, nope + rope).transpose(1, 2)
    q_nope, q_pe = torch.split(query, [nope, rope], dim=-1)
    c_kv, k_pe = torch.split(module.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    c_kv = module.kv_a_layernorm(c_kv).view(batch, 1, q, rank)
    q_pe, k_pe = apply_rotary_emb(
        q_pe, k_pe.view(batch, 1, q, rope), position_embeddings.to(q_pe.device)
    )
    paged.update(c_kv, k_pe, module.layer_idx)
    w_b = module.kv_b_proj.weight.view(heads, nope + v_dim, rank)
    latent_query = torch.cat((torch.einsum("bhqn,hnr->bhqr", q_nope, w_b[:, :nope]), q_pe), -1)
    out = paged.attend(
        module.layer_idx, latent_query, float(module.scaling), Attention(v_head_dim=rank), None
    )  # [B, q, H, r]
    values = torch.einsum("bqhr,hvr->bqhv", out, w_b[:, nope:]).reshape(batch, q, heads * v_dim)
    return module.o_proj(values), None
