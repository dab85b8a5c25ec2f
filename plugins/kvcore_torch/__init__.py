"""kvcore_torch: the reference backend in plain PyTorch; the oracle of the conformance suite.

Correct before fast: prefill loops over sequences on the host, gathers the
pages a sequence uses into contiguous K/V, and computes a masked softmax in
fp32; decode does the same for all rows at once (one gather up to the longest
row, the tails masked), since it runs once per layer per generated token. Runs on any device torch runs on, for every dtype and shape the backend
API allows (head dims 1..256, page sizes 1..128 tokens).

Numerics: scores, softmax and the weighted sum are computed in fp32 from the
stored values (fp16/bf16 are upcast after the gather); the output is rounded
once, to the query's dtype, at the end.

The unused slots of a sequence's last page (which may hold anything, NaN
included) never enter the arithmetic: prefill gathers only tokens
``0 .. seq_len - 1``; decode masks them out of the scores and zeroes them in V.
"""

from __future__ import annotations

import torch

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
        # All rows at once: gather every row's pages up to the longest row, mask the
        # tail. The padding of short rows' tables may hold anything, so it is
        # replaced by page 0 before the gather; unused slots (NaN included) are
        # masked out of the scores and zeroed in V (0 * NaN would poison the sum).
        batch, num_heads, head_dim = query.shape
        page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        num_pages = -(-int(seq_lens.max()) // page_size)
        lens = seq_lens.long()
        used = (lens + page_size - 1) // page_size
        columns = torch.arange(num_pages, device=query.device)
        pages = torch.where(columns[None, :] < used[:, None], block_table[:, :num_pages].long(), 0)
        kv = kv_cache[pages].float()  # [B, P, 2, page_size, Hkv, D]
        num_slots = num_pages * page_size
        k = kv[:, :, 0].reshape(batch, num_slots, num_kv_heads, head_dim)
        v = kv[:, :, 1].reshape(batch, num_slots, num_kv_heads, head_dim)
        valid = torch.arange(num_slots, device=query.device)[None, :] < lens[:, None]  # [B, L]
        v = torch.where(valid[:, :, None, None], v, 0.0)
        # Query head h reads kv head h // group: view the heads as [Hkv, group].
        q = query.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.einsum("bhgd,blhd->bhgl", q, k) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgl,blhd->bhgd", probs, v)
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
