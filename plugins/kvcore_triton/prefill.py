# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels: @triton.jit is untyped, and kernel arguments take no annotations.)
"""Paged prefill: varlen causal attention of new queries over a cached prefix.

Sequence b has ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` queries, which
are its *last* q_len tokens of ``seq_len = seq_lens[b]`` (bottom-right
aligned; their K/V are already written)::

    tokens   0 ......................... seq_len - q_len ........ seq_len - 1
             [ cached prefix (attended)  ][ the q_len new tokens        ]
    query i attends tokens 0 .. pos(i),  pos(i) = seq_len - q_len + i

One kernel, grid ``(cdiv(max q_len, BLOCK_Q), B, Hkv * HEAD_BLOCKS)``. Program
(j, b, g * HEAD_BLOCKS + h) packs queries ``j*BLOCK_Q .. j*BLOCK_Q + BLOCK_Q - 1``
of sequence b times query heads ``h*BLOCK_G ..`` of the ``QUERY_GROUP`` sharing
KV head g into the rows of one tile (``HEAD_BLOCKS`` is 1 unless MLA's many
heads on one KV head are cut into blocks of 16)::

    row r  ->  query  j*BLOCK_Q + r // BLOCK_G,  head  g*QUERY_GROUP + h*BLOCK_G + r % BLOCK_G
    BLOCK_M = BLOCK_Q * BLOCK_G rows   (rows past the group are padding)

so each K/V block is read once per KV head rather than once per query head.
It runs the online softmax (``m_i``, ``l_i``, ``acc``, exp2 on scores scaled
to log2 units) over tokens ``0 .. pos(last query of the tile)`` in blocks of
``BLOCK_N``, masking ``token > pos(row)``. Pages are looked up per token as
:mod:`~kvcore_triton.paged` says (any page size); only tokens < seq_len are
loaded, so unused slots never matter; offsets are int64.

The features of :class:`kvcore.backend.Attention` are constexpr variants, as in
decode.py: ``WINDOW`` starts the walk at the tile's first window start
``max(0, pos(first query) - window_left)`` (pages before it are never looked
up) and masks ``token < pos(row) - window_left``; ``SOFT_CAP`` caps the scaled
logits (:func:`paged.soft_cap`) before the masks; ``SINKS`` starts each row's
running max and denominator at its head's sink (``m_i = sink``, ``l_i = 1``);
fp8 caches convert K/V on load to the query's dtype (exactly: every e4m3fn and
e5m2 value is an fp16 and a bf16 value), with ``k_scale`` folded into the score
scale and ``v_scale`` into the final normalisation; ``LATENT`` (MLA)
reads K as two pieces, ``HEAD_DIM = v_head_dim`` (also V, the same tile) and
``ROPE_DIM``.

Numerics: on a GPU, fp16/bf16 queries feed ``tl.dot`` 16-bit K and V (the
cache's own, or fp8 converted to the query's dtype) and Q as given (the scale
multiplies S in fp32, so Q is not rounded twice), with fp32 accumulation, and
P (in [0, 1]) is rounded to that dtype for P V: wgmma on 16-bit operands, as
dense FlashAttention does. fp32 queries (and bf16 under the interpreter, whose
bf16 arithmetic is wrong) widen everything to fp32 at once (``F32_DOT``; TF32
on a GPU).

Launch choices (sm_90, figures from the builds of tests/test_triton_compile.py,
which asserts them): ``BLOCK_M = 64`` rows, 8 warps, ``BLOCK_N`` 32 tokens (16
at BLOCK_D = 256), ``num_stages = 3`` with page ids loaded one block ahead (as
in decode.py), so K/V blocks are staged through shared memory while the
previous block computes. At bf16, D=128, group 4: 96 registers, no spills,
64 KB of shared memory, 3 buffers (before: TF32 wgmma on fp32-widened
operands, num_stages 1, 159 registers). 64-token blocks take 148 registers
and 112 KB (one CTA per SM).
The grid needs the longest q_len, which the plan holds on the host, so the
launch reads no device value.

``_prefill_kernel`` is one body of about 130 lines on purpose: it reads top-down
as the math above (the row -> (query, head) packing, the online softmax with
its causal mask, the store), its state ``m_i``, ``l_i``, ``acc`` carried
through one loop; the paging it shares with decode is already
:func:`kvcore_triton.paged.block_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcore.layout import cdiv
from kvcore_triton import paged

LOG2_E = 1.4426950408889634
NUM_STAGES = 3  # page-id load, K/V load, compute: two K/V buffers in flight


@triton.jit
def _prefill_kernel(
    q_ptr,  # [total_q, Hq, D] queries, any float dtype
    kv_ptr,  # [num_pages, 2, PAGE_SIZE, Hkv, D] cache, last dim contiguous
    out_ptr,  # [total_q, Hq, D] output, the query's dtype
    block_table_ptr,  # [B, max_pages] int32
    cu_seqlens_q_ptr,  # [B + 1] int32, query rows
    seq_lens_ptr,  # [B] int32, tokens (cached prefix + new)
    sinks_ptr,  # [Hq] fp32 sink logits, natural units (SINKS only)
    qk_scale,  # fp32: scale * k_scale * log2(e); SOFT_CAP: scale * k_scale / cap
    cap_log2,  # fp32: cap * log2(e) (SOFT_CAP only)
    v_scale,  # fp32: V's dequantisation scale (1.0 unless fp8)
    window_left,  # tokens (WINDOW only)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    stride_bt_b,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # K's first piece, V and the output (elements)
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM (and >= 16)
    ROPE_DIM: tl.constexpr,  # K's second piece (MLA's rope part; 0: none)
    BLOCK_R: tl.constexpr,  # next power of two >= ROPE_DIM (and >= 16)
    LATENT: tl.constexpr,  # V is K's first piece
    QUERY_GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # query heads per tile: next power of two >= QUERY_GROUP, or 16
    HEAD_BLOCKS: tl.constexpr,  # cdiv(QUERY_GROUP, BLOCK_G)
    BLOCK_Q: tl.constexpr,  # queries per tile
    BLOCK_M: tl.constexpr,  # rows per tile = BLOCK_Q * BLOCK_G (>= 16)
    BLOCK_N: tl.constexpr,  # tokens per iteration
    F32_DOT: tl.constexpr,  # dot operands in fp32 (fp32 rows; bf16 under the interpreter)
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    tl.static_assert(BLOCK_M == BLOCK_Q * BLOCK_G)
    tl.static_assert(BLOCK_G * HEAD_BLOCKS >= QUERY_GROUP)
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    q_block = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2) // HEAD_BLOCKS
    head_block = tl.program_id(2) % HEAD_BLOCKS

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    first_q = q_block * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len  # cached tokens before the first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = first_q + offs_m // BLOCK_G  # query index within the sequence
    group_idx = head_block * BLOCK_G + offs_m % BLOCK_G
    mask_m = (q_idx < q_len) & (group_idx < QUERY_GROUP)
    mask_d = offs_d < HEAD_DIM
    mask_r = offs_r < ROPE_DIM
    pos = prefix + q_idx  # the last token each row attends
    q_head = (kv_head * QUERY_GROUP + group_idx).to(tl.int64)
    q_row = (q_start + q_idx).to(tl.int64)

    q_rows = q_ptr + q_row[:, None] * stride_qt + q_head[:, None] * stride_qh
    mask_md = mask_m[:, None] & mask_d[None, :]
    q = tl.load(q_rows + offs_d[None, :], mask=mask_md, other=0.0)  # the operand dtype
    if F32_DOT:
        q = q.to(tl.float32) * qk_scale  # the scale folded into Q
    # else: Q exactly as given; the scale multiplies S below
    if ROPE_DIM > 0:
        q_r = tl.load(
            q_rows + HEAD_DIM + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0
        )
        if F32_DOT:
            q_r = q_r.to(tl.float32) * qk_scale

    if SINKS:  # the sink is the first "logit" of the softmax: max = sink, sum = 1
        m_i = (
            tl.load(sinks_ptr + q_head, mask=mask_m, other=0.0).to(tl.float32) * 1.4426950408889634
        )
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite floor: no inf - inf
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kv_end = tl.minimum(seq_len, prefix + tl.minimum(first_q + BLOCK_Q, q_len))
    kv_start = 0
    if WINDOW:  # the tile's first query opens the earliest window
        kv_start = tl.maximum(prefix + first_q - window_left, 0)
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
    v_base = k_base + stride_kv_kv
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt_b
    # Page ids one block ahead of their K/V (paged.py): the first block's here (as in
    # decode.py), each next block's in block_rows.
    first_tok = kv_start + offs_n
    page = tl.load(bt_row + first_tok // PAGE_SIZE, mask=first_tok < kv_end, other=0)
    for t0 in range(kv_start, kv_end, BLOCK_N):
        tok = t0 + offs_n
        mask_n = tok < kv_end
        row, page = paged.block_rows(
            bt_row, page, tok, kv_end, stride_kv_page, stride_kv_tok, PAGE_SIZE, BLOCK_N
        )
        kv_offs = row[:, None] + offs_d[None, :]
        mask_nd = mask_n[:, None] & mask_d[None, :]

        k = tl.load(k_base + kv_offs, mask=mask_nd, other=0.0).to(q.dtype)  # no-op or exact
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N], fp32 accumulate
        if ROPE_DIM > 0:
            k_r = tl.load(
                k_base + row[:, None] + HEAD_DIM + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :],
                other=0.0,
            )
            s += tl.dot(q_r, tl.trans(k_r.to(q_r.dtype)))
        if not F32_DOT:
            s = s * qk_scale  # log2 units, scaled in fp32 (no second rounding of Q)
        if SOFT_CAP:
            s = paged.soft_cap(s, cap_log2)
        allowed = mask_n[None, :] & (tok[None, :] <= pos[:, None])
        if WINDOW:
            allowed = allowed & (tok[None, :] >= pos[:, None] - window_left)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = k if LATENT else tl.load(v_base + kv_offs, mask=mask_nd, other=0.0).to(q.dtype)
        # p in [0, 1] rounded to the 16-bit operand dtype (a no-op in fp32); acc stays fp32
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    out_ptrs = out_ptr + q_row[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_md)


MLA_BLOCK_G = 16  # query heads per tile on a latent cache


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Tiles of one prefill launch (the constexprs of ``_prefill_kernel``) and its warps."""

    page_size: int  # tokens per page
    head_dim: int  # elements of K's first piece, and of V and the output
    block_d: int  # next power of two >= head_dim, >= 16
    rope_dim: int  # elements of K's second piece (MLA's rope part; 0: none)
    block_r: int  # next power of two >= rope_dim, >= 16
    latent: bool  # V is K's first piece (MLA)
    group: int  # query heads per KV head
    block_g: int  # query heads per tile: next power of two >= group (MLA: 16)
    block_q: int  # queries per tile; block_q * block_g rows (64, or block_g if wider)
    block_n: int  # tokens per loop iteration
    f32_dot: bool  # dot operands in fp32 (else the query's 16-bit dtype, fp32 accumulate)
    window: bool = False  # a sliding window (window_left >= 0)
    soft_cap: bool = False  # logits soft-capped
    sinks: bool = False  # one sink logit per query head joins each row's denominator
    num_warps: int = 8
    num_stages: int = NUM_STAGES

    @property
    def head_blocks(self) -> int:
        """Programs per KV head along the grid's head axis."""
        return cdiv(self.group, self.block_g)

    def constexprs(self) -> dict[str, int]:
        return {
            "PAGE_SIZE": self.page_size,
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": self.block_d,
            "ROPE_DIM": self.rope_dim,
            "BLOCK_R": self.block_r,
            "LATENT": self.latent,
            "QUERY_GROUP": self.group,
            "BLOCK_G": self.block_g,
            "HEAD_BLOCKS": self.head_blocks,
            "BLOCK_Q": self.block_q,
            "BLOCK_M": self.block_q * self.block_g,
            "BLOCK_N": self.block_n,
            "F32_DOT": self.f32_dot,
            "WINDOW": self.window,
            "SOFT_CAP": self.soft_cap,
            "SINKS": self.sinks,
        }


def plan_prefill(
    *,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    interpreted: bool,
    v_head_dim: int | None = None,
    window: bool = False,
    soft_cap: bool = False,
    sinks: bool = False,
) -> PrefillPlan:
    """Tiles for a GQA group of ``group`` query heads with ``dot`` operands of ``dtype``
    (the query's: the cache's, or any float over an fp8 cache), the module docstring
    gives the reasons. ``interpreted``: bf16 operands are widened to fp32 at once,
    since the interpreter's bf16 arithmetic is wrong. ``v_head_dim`` (MLA) splits the
    cache's ``head_dim`` into V's part and a rope part."""
    main = head_dim if v_head_dim is None else v_head_dim
    rope = head_dim - main
    block_g = triton.next_power_of_2(group)
    if v_head_dim is not None:
        block_g = min(block_g, MLA_BLOCK_G)
    block_d = max(16, triton.next_power_of_2(main))
    return PrefillPlan(
        page_size=page_size,
        head_dim=main,
        block_d=block_d,
        rope_dim=rope,
        block_r=max(16, triton.next_power_of_2(max(rope, 1))),
        latent=v_head_dim is not None,
        group=group,
        block_g=block_g,
        # MLA (BLOCK_D 512): 32 rows, mma.sync, 166 registers; 64 rows (wgmma) spill at 255
        block_q=max(1, (32 if block_d >= 512 else 64) // block_g),
        block_n=16 if block_d >= 256 else 32,
        f32_dot=dtype == torch.float32 or (interpreted and dtype == torch.bfloat16),
        window=window,
        soft_cap=soft_cap,
        sinks=sinks,
    )


def prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    interpreted: bool,
    window_left: int = -1,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    v_head_dim: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """out [total_q, Hq, Dv] (query's dtype; Dv = D, or ``v_head_dim`` on a latent cache):
    causal attention of each sequence's last q_len tokens over its ``seq_lens[b]``
    cached tokens. ``max_q_len`` (tokens) is the longest q_len, known on the host from
    the plan: the launch reads no device value. The options are those of
    :func:`kvcore_triton.decode.decode`.

    Inputs are validated by the caller: cu_seqlens_q [B+1] int32 non-decreasing
    from 0 to total_q, ``q_len <= seq_lens[b] <= max_pages * page_size``,
    block_table [B, max_pages] int32 with in-range pages from each sequence's first
    window on, Hq a multiple of Hkv.
    """
    total_q, num_q_heads, head_dim = query.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    assert kv_cache.stride(4) == 1 or kv_cache.shape[4] == 1, "last dim must be contiguous"
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    batch = seq_lens.shape[0]
    plan = plan_prefill(
        group=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=query.dtype,  # the operands' (an fp8 cache's K/V are converted to it)
        interpreted=interpreted,
        v_head_dim=v_head_dim,
        window=window_left >= 0,
        soft_cap=soft_cap > 0.0,
        sinks=sinks is not None,
    )
    out = torch.empty(total_q, num_q_heads, plan.head_dim, dtype=query.dtype, device=query.device)
    if total_q == 0 or batch == 0 or max_q_len == 0:
        return out

    # Soft-capped: S = logits / cap, capped and put in log2 units by paged.soft_cap.
    qk_scale = scale * k_scale / soft_cap if soft_cap > 0.0 else scale * k_scale * LOG2_E
    grid = (cdiv(max_q_len, plan.block_q), batch, num_kv_heads * plan.head_blocks)
    _prefill_kernel[grid](
        query,
        kv_cache,
        out,
        block_table,
        cu_seqlens_q,
        seq_lens,
        out if sinks is None else sinks,  # never read without sinks
        qk_scale,
        soft_cap * LOG2_E,
        v_scale,
        window_left,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        **plan.constexprs(),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    return out
