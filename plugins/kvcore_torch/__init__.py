"""kvcore_torch: the reference backend in plain PyTorch; the oracle of the conformance suite.

Correct before fast: prefill loops over sequences on the host, gathers the
pages a sequence uses into contiguous K/V, and computes a masked softmax in
fp32. Decode runs once per layer per generated token, so its plan does the
index work once per step (:class:`DecodeGather`): per layer it is one gather of
K and V together plus one SDPA call. Runs on any device torch runs on, for every
dtype and shape the backend API allows (head dims 1..256, page sizes 1..128
tokens).

Numerics: scores, softmax and the weighted sum are computed in fp32 from the
stored values (fp16/bf16 are upcast after the gather); the output is rounded
once, to the query's dtype, at the end.

The unused slots of a sequence's last page (which may hold anything, NaN
included) never enter the arithmetic: prefill gathers only tokens
``0 .. seq_len - 1``; decode gathers, for the positions past a row's length, its
token 0 again (a written token, so finite) and masks them out of the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcore.backend import Backend, Capabilities, CopyPlan, DecodePlan, PrefillPlan, WritePlan

__all__ = ["DecodeGather", "TorchBackend", "attend", "gather_kv"]


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


@dataclass(frozen=True, slots=True)
class DecodeGather:
    """A decode plan's gather, computed once per step.

    Position ``j < max_len`` of row b is token j of sequence b, at page
    ``pages[b, j]`` and offset ``offsets[b, j]``; past the row's length it repeats
    the row's token 0 (finite) and ``mask`` (additive fp32 [B, 1, 1, max_len]: 0 or
    -inf; None when every row has max_len tokens) removes it from the softmax.

    ``rows`` [2, B, max_len] int64 indexes the same tokens' K (index 0) and V (1) as
    rows of the cache viewed as ``[n_rows, Hkv, D]`` -- possible when a token's
    [Hkv, D] block is contiguous and every stride of dims 0..2 is a multiple of it;
    valid for caches with exactly ``strides`` (every layer of a pool), None otherwise.
    """

    max_len: int  # tokens
    pages: torch.Tensor  # [B, max_len] int64
    offsets: torch.Tensor  # [B, max_len] int64
    mask: torch.Tensor | None
    strides: tuple[int, ...]
    rows: torch.Tensor | None
    n_rows: int


@dataclass(frozen=True, slots=True)
class WriteIndex:
    """A write plan's scatter: the kept tokens (``keep`` None: all) and their slots' page
    and offset, int64."""

    keep: torch.Tensor | None
    page: torch.Tensor
    offset: torch.Tensor


class TorchBackend(Backend):
    """Plain PyTorch paged attention: any device, fp32/fp16/bf16, any head dim and page size."""

    name = "torch"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=frozenset({"float32", "float16", "bfloat16"}),
    )

    # -- plans ------------------------------------------------------------------------

    def _prepare_decode(self, plan: DecodePlan, kv_cache: torch.Tensor) -> DecodeGather | None:
        if plan.batch == 0:
            return None
        page_size = plan.cache.page_size
        lens = plan.seq_lens.long()
        max_len = plan.max_seq_len
        position = torch.arange(max_len, device=lens.device)
        valid = position[None, :] < lens[:, None]  # [B, L]
        token = torch.where(valid, position[None, :], 0)
        pages = plan.block_table.long().gather(1, token // page_size)
        offsets = token % page_size
        mask = None
        if min(plan.host_seq_lens) < max_len:
            zero = torch.zeros((), device=lens.device)
            mask = torch.where(valid, zero, float("-inf"))[:, None, None, :]
        strides = kv_cache.stride()
        rows, n_rows = _row_index(kv_cache, pages, offsets)
        return DecodeGather(max_len, pages, offsets, mask, strides, rows, n_rows)

    def _prepare_write(self, plan: WritePlan, kv_cache: torch.Tensor) -> WriteIndex:
        slots, keep = plan.slots, None
        if plan.skips:  # the common case (no skipped slot) needs no mask
            keep = (slots >= 0).nonzero().squeeze(1)
            slots = slots.index_select(0, keep)
        page_size = plan.cache.page_size
        return WriteIndex(keep, slots // page_size, slots % page_size)

    # -- kernels ----------------------------------------------------------------------

    def _write_kv(
        self, plan: WritePlan, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        index = plan.prepared
        assert isinstance(index, WriteIndex), "a torch write plan carries its WriteIndex"
        if index.keep is not None:
            key, value = key.index_select(0, index.keep), value.index_select(0, index.keep)
        kv_cache[index.page, 0, index.offset] = key
        kv_cache[index.page, 1, index.offset] = value

    def _decode(
        self, plan: DecodePlan, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        g = plan.prepared
        assert isinstance(g, DecodeGather), "a torch decode plan carries its DecodeGather"
        batch, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        if g.rows is not None and kv_cache.stride() == g.strides:
            view = kv_cache.as_strided(
                (g.n_rows, num_kv_heads, head_dim), (num_kv_heads * head_dim, head_dim, 1)
            )
            kv = view.index_select(0, g.rows.view(-1)).view(
                2, batch, g.max_len, num_kv_heads, head_dim
            )
            k, v = kv[0], kv[1]
        else:  # any other strides: one advanced-index gather, [B, L, 2, Hkv, D]
            kv = kv_cache[g.pages, :, g.offsets]
            k, v = kv[:, :, 0], kv[:, :, 1]
        # One query token: the query heads that share kv head h act as the query
        # rows of h, so GQA needs no repeat of K/V.
        q = query.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q, k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=g.mask, scale=scale
        )
        return out.reshape(batch, num_heads, head_dim).to(query.dtype)

    def _prefill(
        self, plan: PrefillPlan, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = plan.host_cu_seqlens_q
        for b, seq_len in enumerate(plan.host_seq_lens):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            k, v = gather_kv(kv_cache, plan.block_table[b], seq_len)
            out[lo:hi] = attend(query[lo:hi], k, v, scale).to(query.dtype)
        return out

    def _copy_pages(self, plan: CopyPlan, kv_cache: torch.Tensor) -> None:
        kv_cache[plan.dst] = kv_cache[plan.src]  # the gather copies src out before the scatter


def _row_index(
    kv_cache: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor | None, int]:
    """Rows of K and V of each (page, offset) in the cache viewed as [n_rows, Hkv, D],
    and n_rows; (None, 0) where this cache's strides allow no such view."""
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    row = num_kv_heads * head_dim  # elements of one token's K (or V)
    s_page, s_kv, s_tok, s_head, s_dim = kv_cache.stride()
    dense_token = (s_dim == 1 or head_dim == 1) and (s_head == head_dim or num_kv_heads == 1)
    strides = (s_page, s_kv, s_tok)
    if not dense_token or any(s < 0 or s % row for s in strides):
        return None, 0
    k_rows = pages * (s_page // row) + offsets * (s_tok // row)
    rows = torch.stack([k_rows, k_rows + s_kv // row])
    last = (kv_cache.shape[0] - 1) * s_page + s_kv + (page_size - 1) * s_tok
    return rows, last // row + 1
