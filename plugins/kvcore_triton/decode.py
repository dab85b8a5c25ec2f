# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels: @triton.jit is untyped, and kernel arguments take no annotations.)
"""Paged decode with split-KV (flash-decoding), GQA heads packed into one ``tl.dot`` tile.

One query token per sequence (at position ``p = seq_len - 1``) attends that
sequence's cached tokens ``[first, seq_len)``, ``first = 0``, or with a sliding
window ``max(0, p - window_left)``. Two kernels:

1. ``_decode_split_kernel``, grid ``(B, Hkv * HEAD_BLOCKS, num_splits)``:
   program (b, g * HEAD_BLOCKS + j, s) takes query heads ``j * BLOCK_H ..`` of
   the ``QUERY_GROUP = Hq / Hkv`` sharing KV head g as the rows of one tile
   ``Q [BLOCK_H, BLOCK_D]`` (rows past the group are zero padding; ``BLOCK_H
   >= 16`` because ``tl.dot`` needs M >= 16) and runs an online softmax over
   tokens ``[first + s * tokens_per_split, first + (s + 1) * tokens_per_split)
   ∩ [first, seq_len)`` in blocks of ``BLOCK_N`` tokens::

       S   = Q Kᵀ          [BLOCK_H, BLOCK_D] x [BLOCK_D, BLOCK_N]   (scores, log2 units)
       m_i = running row max,  l_i = running Σ 2^(S - m_i),  acc = Σ 2^(S - m_i) V

   It writes the split's normalised output ``acc / l_i`` and its log-sum-exp
   ``m_i + log2(l_i)`` (base 2) to fp32 scratch; an empty split writes
   ``lse = -inf`` and a zero output.
2. ``_decode_merge_kernel``, grid ``(B, Hq)``: ``out = v_scale * Σ_s 2^(lse_s -
   M) o_s / (Σ_s 2^(lse_s - M) [+ 2^(sink - M)])`` with ``M = max(max_s lse_s
   [, sink])``: an attention sink (log2 units) joins the denominator once, here,
   not once per split.

The features of :class:`kvcore.backend.Attention` are constexpr variants, so a
plain decode compiles to the kernel it was before:

* ``SOFT_CAP``: ``S = cap * tanh(scale * q.k / cap)`` (:func:`paged.soft_cap`),
  before the mask; the query is then pre-scaled by ``scale * k_scale / cap``.
* ``WINDOW``: the walk starts at ``first``; pages before it are never looked up.
* fp8 caches: K and V are loaded as fp8 and converted to fp32 at once; ``k_scale``
  is folded into the query's scale and ``v_scale`` into the merge, so no element
  is multiplied by a scale.
* ``LATENT`` (MLA): K is two pieces, ``HEAD_DIM`` (= v_head_dim, also V: the
  same tile, not loaded twice) and ``ROPE_DIM``; ``S = Q₁K₁ᵀ + Q₂K₂ᵀ``.

Tokens are found through the block table as :mod:`~kvcore_triton.paged` says
(any page size; only tokens in the walk are loaded, so unused slots of a page,
possibly NaN, and unused or released block-table entries never matter).
Offsets are int64; block tables int32; everything loaded is converted to fp32
at once (the interpreter's bf16 and fp8 arithmetic is wrong, and fp32
accumulation is what we want on a GPU too). Scores are pre-scaled by ``scale *
log2(e)`` so the softmax uses ``exp2``. Launch choices (tiles, splits, warps)
and their reasons are in :mod:`~kvcore_triton.decode_plan`.

``_decode_split_kernel`` is one body of about 100 lines on purpose: it reads
top-down as the math above (load the query tile, the online softmax over the
blocks, the normalised store), its state ``m_i``, ``l_i``, ``acc`` carried
through one loop; the paging it shares with prefill is already
:func:`kvcore_triton.paged.block_rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_triton import paged
from kvcore_triton.decode_plan import INTERPRETER_SMS, plan_decode, sm_count

LOG2_E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D] query, any float dtype
    kv_ptr,  # [num_pages, 2 (1: latent), PAGE_SIZE, Hkv, D] cache, last dim contiguous
    block_table_ptr,  # [B, max_pages] int32
    seq_lens_ptr,  # [B] int32, tokens
    part_out_ptr,  # [B, Hq, num_splits, HEAD_DIM] fp32 scratch, contiguous
    part_lse_ptr,  # [B, Hq, num_splits] fp32 scratch (base-2 log-sum-exp), contiguous
    qk_scale,  # fp32: scale * k_scale * log2(e); SOFT_CAP: scale * k_scale / cap
    cap_log2,  # fp32: cap * log2(e) (SOFT_CAP only)
    window_left,  # tokens (WINDOW only)
    num_q_heads,
    stride_qb,
    stride_qh,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    stride_bt_b,
    tokens_per_split,  # tokens, a multiple of BLOCK_N
    num_splits,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # K's first piece, V and the output (elements)
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM (and >= 16)
    ROPE_DIM: tl.constexpr,  # K's second piece (MLA's rope part; 0: none)
    BLOCK_R: tl.constexpr,  # next power of two >= ROPE_DIM (and >= 16)
    LATENT: tl.constexpr,  # V is K's first piece
    QUERY_GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # query heads per program, a power of two >= 16
    HEAD_BLOCKS: tl.constexpr,  # cdiv(QUERY_GROUP, BLOCK_H)
    BLOCK_N: tl.constexpr,  # tokens per iteration
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_H * HEAD_BLOCKS >= QUERY_GROUP)
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    first = 0
    if WINDOW:  # the query is at seq_len - 1
        first = tl.maximum(seq_len - 1 - window_left, 0)
    start = first + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    group_idx = head_block * BLOCK_H + offs_h
    mask_h = group_idx < QUERY_GROUP
    mask_d = offs_d < HEAD_DIM
    mask_r = offs_r < ROPE_DIM
    q_head = (kv_head * QUERY_GROUP + group_idx).to(tl.int64)

    q_rows = q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale
    if ROPE_DIM > 0:
        q_r = tl.load(
            q_rows + HEAD_DIM + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0
        )
        q_r = q_r.to(tl.float32) * qk_scale

    # A finite floor instead of -inf keeps (m_i - m_new) free of inf - inf.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    v_base = k_base + stride_kv_kv
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    # Page ids run one block ahead of their K/V (paged.py): the first block's here,
    # each next block's in block_rows.
    page = tl.load(bt_row + (start + offs_n) // PAGE_SIZE, mask=start + offs_n < end, other=0)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        mask_n = tok < end
        row, page = paged.block_rows(
            bt_row, page, tok, end, stride_kv_page, stride_kv_tok, PAGE_SIZE, BLOCK_N
        )
        kv_offs = row[:, None] + offs_d[None, :]
        mask_nd = mask_n[:, None] & mask_d[None, :]

        k = tl.load(k_base + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N], log2 units (or logits / cap)
        if ROPE_DIM > 0:
            k_r = tl.load(
                k_base + row[:, None] + HEAD_DIM + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :],
                other=0.0,
            )
            s += tl.dot(q_r, tl.trans(k_r.to(tl.float32)))
        if SOFT_CAP:
            s = paged.soft_cap(s, cap_log2)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = k if LATENT else tl.load(v_base + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new

    # Empty split (start >= end): l_i == 0 -> lse = -inf, output 0; the merge weighs it 0.
    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)

    part_row = (b.to(tl.int64) * num_q_heads + q_head) * num_splits + split  # [BLOCK_H]
    tl.store(part_lse_ptr + part_row, lse, mask=mask_h)
    tl.store(
        part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
        o,
        mask=mask_h[:, None] & mask_d[None, :],
    )


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,  # [B, Hq, num_splits, HEAD_DIM] fp32
    part_lse_ptr,  # [B, Hq, num_splits] fp32, base 2
    sinks_ptr,  # [Hq] fp32 sink logits, natural units (SINKS only)
    out_ptr,  # [B, Hq, HEAD_DIM] output, the query's dtype
    v_scale,  # fp32: V's dequantisation scale (1.0 unless fp8)
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
    SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM

    part_row = (b.to(tl.int64) * num_q_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part_row, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 units
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): weights 0
    w = tl.exp2(lse - m)  # [BLOCK_S]
    denom = tl.sum(w, 0)
    if SINKS:
        denom += tl.exp2(sink - m)
    o = tl.load(
        part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    acc = tl.sum(w[:, None] * o, 0)  # [BLOCK_D]
    out = acc * (v_scale / tl.where(denom > 0.0, denom, 1.0))
    out_ptrs = out_ptr + b.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    interpreted: bool,
    num_splits: int | None = None,
    max_tokens: int | None = None,
    window_left: int = -1,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    v_head_dim: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """out [B, Hq, Dv] (query's dtype) = softmax(q Kᵀ * scale) V over each sequence's
    pages (Dv = D, or ``v_head_dim`` on a latent cache).

    ``num_splits`` forces the split count (the backend's plan chooses it once per
    step); ``max_tokens`` bounds every seq_len (tokens; default the table's width
    max_pages * page_size, which needs no device read). The options are those of
    :class:`kvcore.backend.Attention` (``window_left`` tokens, -1 none;
    ``soft_cap`` 0 off; ``sinks`` [Hq] fp32 or None; ``v_head_dim`` on a latent
    cache) and the fp8 scales (the cache holds x / scale).

    Inputs are validated by the caller: query [B, Hq, D], kv_cache
    [num_pages, 2 (1: latent), page_size, Hkv, D] with a contiguous last dim,
    block_table [B, max_pages] int32 with in-range pages from each sequence's
    window on, seq_lens [B] int32 with ``seq_lens[b] <= max_pages * page_size``;
    Hq a multiple of Hkv.

    Most of its length is the two launches' argument lists, one argument a line.
    """
    batch, num_q_heads, head_dim = query.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.stride(4) == 1 or kv_cache.shape[4] == 1, "last dim must be contiguous"
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    plan = plan_decode(
        batch=max(1, batch),
        num_kv_heads=num_kv_heads,
        group=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        max_tokens=block_table.shape[1] * page_size if max_tokens is None else max_tokens,
        sm_count=INTERPRETER_SMS if interpreted else sm_count(query.device),
        interpreted=interpreted,
        num_splits=num_splits,
        v_head_dim=v_head_dim,
        window_left=window_left,
        soft_cap=soft_cap > 0.0,
        sinks=sinks is not None,
    )
    out = torch.empty(batch, num_q_heads, plan.head_dim, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    part_out = torch.empty(
        batch, num_q_heads, plan.num_splits, plan.head_dim, dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(
        batch, num_q_heads, plan.num_splits, dtype=torch.float32, device=query.device
    )
    # Soft-capped: S = logits / cap, capped and put in log2 units by paged.soft_cap.
    qk_scale = scale * k_scale / soft_cap if soft_cap > 0.0 else scale * k_scale * LOG2_E
    _decode_split_kernel[(batch, num_kv_heads * plan.head_blocks, plan.num_splits)](
        query,
        kv_cache,
        block_table,
        seq_lens,
        part_out,
        part_lse,
        qk_scale,
        soft_cap * LOG2_E,
        window_left,
        num_q_heads,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        plan.tokens_per_split,
        plan.num_splits,
        **plan.split_constexprs(),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        part_lse if sinks is None else sinks,  # never read without sinks
        out,
        v_scale,
        out.stride(0),
        out.stride(1),
        plan.num_splits,
        **plan.merge_constexprs(),
        num_warps=plan.merge_warps,
    )
    return out
