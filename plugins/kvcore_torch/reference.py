"""The reference numerics of the kernel contract, on one sequence's contiguous K/V:
:func:`gather_kv` (the pages a sequence reads, dequantized), :func:`attend` (causal
attention with the :class:`~kvcore.backend.Attention` options, in fp32) and
:func:`quantize` (the fp8 store). :class:`kvcore_torch.backend.TorchBackend` runs
them per sequence; the conformance suite holds every backend to them.
"""

from __future__ import annotations

import torch

from kvcore.backend import Attention
from kvcore.layout import cdiv

__all__ = ["FP8", "PLAIN", "attend", "gather_kv", "quantize"]

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
PLAIN = Attention()


def gather_kv(
    kv_cache: torch.Tensor,
    pages: torch.Tensor,
    seq_len: int,
    *,
    first_page: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    v_head_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's tokens ``first_page * page_size .. seq_len - 1``,
    contiguous: each [tokens, Hkv, D] in the cache dtype, or fp32 dequantized
    (``* k_scale`` / ``* v_scale``) from an fp8 cache.

    ``pages`` [>= ceil(seq_len / page_size)] holds the sequence's page indices in
    token order; entries before ``first_page`` and past the pages it uses are
    ignored. A latent cache ([num_pages, 1, ...]) gives K = its vector and V = the
    first ``v_head_dim`` elements of it (both scaled by ``k_scale``).
    """
    page_size = kv_cache.shape[2]
    n_pages = cdiv(seq_len, page_size)
    idx = pages[first_page:n_pages].long()
    tokens = seq_len - first_page * page_size
    fp8 = kv_cache.dtype in FP8
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache  # fp8 moves as bytes

    def part(i: int, scale: float) -> torch.Tensor:
        x = cache[idx, i].reshape(-1, *cache.shape[3:])[:tokens]
        return x.view(kv_cache.dtype).float() * scale if fp8 else x

    k = part(0, k_scale)
    if kv_cache.shape[1] == 1:
        assert v_head_dim is not None, "a latent cache's V is its first v_head_dim elements"
        return k, k[..., :v_head_dim]
    return k, part(1, v_scale)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    *,
    attention: Attention = PLAIN,
    sinks: torch.Tensor | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Bottom-right aligned causal attention of one sequence, in fp32.

    query [Lq, Hq, D], key [Lk, Hkv, D], value [Lk, Hkv, Dv] holding the tokens
    ``key_start .. key_start + Lk - 1`` (Lq <= key_start + Lk, Hq a multiple of
    Hkv): query row i sits at token position ``key_start + Lk - Lq + i`` = p and
    attends keys ``0 .. p`` (with a window, ``max(0, p - window_left) .. p``).
    ``attention``'s soft cap and ``sinks`` ([Hq] fp32) as kvcore.backend.Attention
    states. Returns [Lq, Hq, Dv] fp32.

        keys      0 1 2 3 4 5        (Lk = 6, Lq = 2, no window)
        query 0   x x x x x .        position 4
        query 1   x x x x x x        position 5
    """
    lq, hq, _ = query.shape
    lk, hkv, _ = key.shape
    group = hq // hkv  # query heads per kv head; query head h reads kv head h // group
    q = query.float()
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    cap = attention.logits_soft_cap
    if cap > 0:
        scores = torch.tanh(scores / cap) * cap
    end = key_start + lk
    q_pos = torch.arange(end - lq, end, device=query.device)
    k_pos = torch.arange(key_start, end, device=query.device)
    hidden = k_pos[None, :] > q_pos[:, None]  # [Lq, Lk]: the future
    if attention.window_left >= 0:  # and the keys before the window
        hidden |= k_pos[None, :] < q_pos[:, None] - attention.window_left
    scores = scores.masked_fill(hidden[None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # one more logit per head, with no value row: it only adds to the denominator
        sink = sinks.float().view(hq, 1, 1).expand(hq, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :lk]
    return torch.einsum("hqk,khd->qhd", probs, v)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x / scale`` in the fp8 ``dtype``, saturated to its largest finite value and
    rounded to nearest even (vLLM's convention)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)
