"""kvcore_torch: the reference backend in plain PyTorch; the oracle of the conformance suite.

Correct before fast: prefill loops over sequences on the host, gathers the
pages a sequence uses into contiguous K/V, and computes a masked softmax in
fp32; decode gathers all rows at once (up to the longest row, the tails
masked) and calls SDPA, since it runs once per layer per generated token. Runs on any device torch runs on, for every dtype and shape the backend
API allows (head dims 1..256, page sizes 1..128 tokens).

Numerics: scores, softmax and the weighted sum are computed in fp32 from the
stored values (fp16/bf16 are upcast after the gather); the output is rounded
once, to the query's dtype, at the end.

The unused slots of a sequence's last page (which may hold anything, NaN
included) never enter the arithmetic: prefill gathers only tokens
``0 .. seq_len - 1``; decode zeroes them and masks them out of the scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcore.backend import Backend, Capabilities

__all__ = ["TorchBackend", "attend", "gather_kv"]


def gather_kv(
    kv_cache: torch.Tensor, pages: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence, contiguous: each [seq_len, Hkv, D] in the cache dtype.

    ``pages`` [>= ceil(seq_len / page_size)] holds the sequence's page indices in
    token order; entries past the pages it uses are ignored.
    """
    page_size = kv_cache.shape[2]
    n_pages = -(-seq_len // page_size)
    idx = pages[:n_pages].long()
    k = kv_cache[idx, 0].reshape(n_pages * page_size, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[idx, 1].reshape(n_pages * page_size, *kv_cache.shape[3:])[:seq_len]
    return k, v


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bottom-right aligned causal attention of one sequence, in fp32.

    query [Lq, Hq, D], key/value [Lk, Hkv, D] with Lq <= Lk and Hq a multiple of
    Hkv: query row i sits at token position ``Lk - Lq + i`` and attends keys
    ``0 .. Lk - Lq + i``. Returns [Lq, Hq, D] fp32.

        keys      0 1 2 3 4 5        (Lk = 6, Lq = 2)
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
    q_pos = torch.arange(lk - lq, lk, device=query.device)
    k_pos = torch.arange(lk, device=query.device)
    future = k_pos[None, :] > q_pos[:, None]  # [Lq, Lk]
    scores = scores.masked_fill(future[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


class TorchBackend(Backend):
    """Plain PyTorch paged attention: any device, fp32/fp16/bf16, any head dim and page size."""

    name = "torch"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
    )

    def _write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        page_size = kv_cache.shape[2]
        if bool((slots < 0).any()):  # the common case (no skipped slot) needs no mask
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        page, offset = slots // page_size, slots % page_size
        kv_cache[page, 0, offset] = key
        kv_cache[page, 1, offset] = value

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        # All rows at once: gather every row's pages up to the longest row. The
        # padding of short rows' tables may hold anything, so it is clamped to a
        # real page; the slots past a row's length (NaN included) are zeroed and
        # masked out, since 0 * NaN or NaN - inf would poison the sum.
        batch, num_heads, head_dim = query.shape
        num_pages, _, page_size, num_kv_heads, _ = kv_cache.shape
        lens = seq_lens.tolist()
        max_len = max(lens)
        ragged = min(lens) < max_len  # only then does a row's table have padding in use
        used = -(-max_len // page_size)
        pages = block_table[:, :used]
        pages = (pages.clamp(0, num_pages - 1) if ragged else pages).long()
        # K and V gathered separately: each [B, used, page_size, Hkv, D], contiguous,
        # so the token view below is free; slots past the longest row are sliced off.
        k = kv_cache[pages, 0].float().view(batch, -1, num_kv_heads, head_dim)[:, :max_len]
        v = kv_cache[pages, 1].float().view(batch, -1, num_kv_heads, head_dim)[:, :max_len]
        mask = None
        if ragged:
            valid = torch.arange(max_len, device=query.device) < seq_lens[:, None]  # [B, L]
            k = torch.where(valid[:, :, None, None], k, 0.0)
            v = torch.where(valid[:, :, None, None], v, 0.0)
            mask = valid[:, None, None, :]
        # One query token: the query heads that share kv head h act as the query
        # rows of h, so GQA needs no repeat of K/V.
        q = query.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
        )
        return out.reshape(batch, num_heads, head_dim).to(query.dtype)

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = cu_seqlens_q.tolist()
        for b, seq_len in enumerate(seq_lens.tolist()):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            k, v = gather_kv(kv_cache, block_table[b], seq_len)
            out[lo:hi] = attend(query[lo:hi], k, v, scale).to(query.dtype)
        return out

    def _copy_pages(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_cache[dst] = kv_cache[src]  # the gather copies src out before the scatter
