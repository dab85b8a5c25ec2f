"""TorchBackend: the reference backend in plain PyTorch; the oracle of the conformance suite.

Correct before fast: prefill loops over sequences on the host, gathers the
pages a sequence uses into contiguous K/V, and computes a masked softmax in
fp32. Decode runs once per layer per generated token, so its plan does the
index work once per step (:class:`DecodeGather`): per layer it is one gather of
K and V together plus one SDPA call. Runs on any device torch runs on, for every
dtype and shape the backend API allows (head dims 1..256, page sizes 1..128
tokens).

Syncs: a run never synchronises. Planning a write whose slots skip (< 0) finds
the kept rows with ``nonzero``, a second device sync on CUDA; decode steps write
every row and never skip.

Numerics (the contract's definition; kvcore.backend.Attention states the
formulas): scores, softmax and the weighted sum are computed in fp32 from the
stored values (fp16/bf16 are upcast after the gather; fp8 values are dequantized,
``fp8 -> fp32 * scale``); the soft cap applies to the scaled logits before the
mask; a sink joins the softmax denominator as one more logit with no value; the
output is rounded once, to the query's dtype, at the end. A write to an fp8 cache
stores ``(x / scale)`` clamped to the format's largest finite value, then rounded
to nearest even by ``.to(float8)``.

Two paths. The plain one (a float kv cache, default ``Attention()``) decodes
with one gather and SDPA per layer. Every feature (fp8, window, soft cap, sinks,
MLA) takes the general one: per sequence, gather the pages it reads (from
``plan.first_page(b)``: pages released before a window are never touched),
dequantize, and run :func:`~kvcore_torch.reference.attend`; decode is prefill with
one query per sequence.

The unused slots of a sequence's last page (which may hold anything, NaN
included) never enter the arithmetic: prefill gathers only tokens
``0 .. seq_len - 1``; decode gathers, for the positions past a row's length, its
token 0 again (a written token, so finite) and masks them out of the scores (a batch
whose rows have one length gathers whole pages instead and attends over the first
seq_len positions only).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcore.backend import (
    FEATURES,
    HOST_LIST_MAX,
    AttentionPlan,
    Backend,
    Capabilities,
    CopyPlan,
    DecodePlan,
    PrefillPlan,
    WritePlan,
)
from kvcore.layout import cdiv
from kvcore_torch.reference import PLAIN, attend, gather_kv, quantize
from kvcore_torch.rows import RowLayout, Rows, page_offsets, row_layout, token_rows

__all__ = ["DecodeGather", "TorchBackend"]


@dataclass(frozen=True, slots=True)
class DecodeGather:
    """A decode plan's gather, computed once per step.

    Position ``j < max_len`` of row b is token j of sequence b; past the row's
    length it repeats the row's token 0 (finite) and ``mask`` (additive fp32
    [B, 1, 1, max_len]: 0 or -inf; None when every row has max_len tokens) removes
    it from the softmax. ``rows`` indexes those tokens as head rows (one [D] row per
    token and kv head), ``index`` shaped [2, B, Hkv, width], so one
    ``index_select`` yields K and V head-major, each head's tokens contiguous, as
    SDPA reads them fastest. ``width`` is max_len where rows are padded, else the
    whole pages of the longest row (>= max_len): the positions past max_len are
    gathered (the last page's unwritten slots) but lie outside ``k``/``v``. Where
    the planning cache's strides allow no such view, ``rows`` is None and
    ``pages``/``offsets`` hold each position's page and offset for an
    advanced-index gather (a run on a cache whose strides differ from the planning
    cache's computes them itself).

    ``workspace`` [2 * B * Hkv * width, D] (cache dtype) receives that gather in
    runs from the planning thread (``owner``), and ``k``/``v`` [B, Hkv, max_len, D]
    are its two halves, viewed once here: a layer's run is then one ``index_select``
    into it and one SDPA call. It is scratch, read only inside the run that filled
    it (the output is SDPA's own tensor), so the layers of a step reuse it; runs
    from another thread gather into a tensor of their own, so threads never share it.
    """

    max_len: int  # tokens
    pages: torch.Tensor | None  # [B, max_len] int64; only where rows is None
    offsets: torch.Tensor | None  # [B, max_len] int64; only where rows is None
    mask: torch.Tensor | None
    rows: Rows | None
    workspace: torch.Tensor | None = None  # None where rows is None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    owner: int = 0  # threading.get_ident() of the planning thread
    width: int = 0  # positions gathered per row: max_len, or whole pages (see rows)


@dataclass(frozen=True, slots=True)
class WriteIndex:
    """A write plan's scatter: the kept tokens (``keep`` None: all), their slots' page and
    offset (int64), and the same slots as token rows ([Hkv, D] blocks) where the
    planning cache allows that view (one ``index_copy_`` each for K and V)."""

    keep: torch.Tensor | None
    page: torch.Tensor
    offset: torch.Tensor
    rows: Rows | None
    k_rows: torch.Tensor | None = None  # rows.index[0] and [1], taken once per step
    v_rows: torch.Tensor | None = None


class TorchBackend(Backend):
    """Plain PyTorch paged attention: any device, fp32/fp16/bf16 and fp8 caches, any head
    dim and page size, every feature of the contract."""

    name = "torch"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        dtypes=frozenset({"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}),
        features=FEATURES,
    )

    # -- plans ------------------------------------------------------------------------

    def _prepare_decode(self, plan: DecodePlan, kv_cache: torch.Tensor) -> DecodeGather | None:
        if plan.batch == 0 or _general(plan):
            return None
        page_size = plan.cache.page_size
        max_len = plan.max_seq_len
        device = kv_cache.device
        valid = None  # [B, L] bool: position < the row's length; None when all are
        mask = None
        if min(plan.host_seq_lens) < max_len:
            valid = torch.arange(max_len, device=device) < plan.seq_lens[:, None]
            mask = torch.where(valid, 0.0, float("-inf")).view(plan.batch, 1, 1, max_len)  # fp32
        layout = row_layout(kv_cache, per_head=True)
        if layout is None:  # other strides: the advanced-index gather reads (pages, offsets)
            return DecodeGather(max_len, *_token_pages(plan, valid), mask, None)
        # Head rows at page granularity: row (kv, b, h, j) = table[b, j // page_size] *
        # a_page + (kv, h, j % page_size)'s offset, one broadcast add over the pages the
        # longest row uses; past a row's length, its token 0 (a written, finite row).
        batch, num_kv_heads, head_dim = plan.batch, kv_cache.shape[3], kv_cache.shape[4]
        n_pages = cdiv(max_len, page_size)
        table = plan.block_table  # contiguous: its used columns as [B, 1, n_pages, 1]
        table = table.as_strided((batch, 1, n_pages, 1), (table.shape[1], 0, 1, 0))
        index = torch.add(page_offsets(layout, device), table, alpha=layout.a_page)  # int64
        index = index.view(2, batch, num_kv_heads, n_pages * page_size)
        if valid is not None:
            valid = valid.view(1, batch, 1, max_len)
            index = torch.where(valid, index[..., :max_len], index[..., :1])
        # Without padding the gather reads whole pages (the index needs no copy): the
        # positions past max_len lie outside the k/v views, so they never enter SDPA.
        width = index.shape[-1]
        flat = index.view(-1)
        rows = Rows(layout.strides, layout.contiguous, layout.n_rows, (head_dim,), index, flat)
        workspace = kv_cache.new_empty((flat.shape[0], head_dim))
        k, v = _halves(workspace, batch, num_kv_heads, width, max_len)
        return DecodeGather(
            max_len, None, None, mask, rows, workspace, k, v, threading.get_ident(), width
        )

    def _prepare_write(self, plan: WritePlan, kv_cache: torch.Tensor) -> WriteIndex:
        slots, keep = plan.slots, None
        if plan.skips:  # the common case (no skipped slot) needs no mask
            keep = (slots >= 0).nonzero().squeeze(1)  # (a device sync where slots skip)
            slots = slots.index_select(0, keep)
        page_size = plan.cache.page_size
        layout = None if plan.cache.latent else row_layout(kv_cache, per_head=False)
        if layout is not None and slots.device.type == "cpu" and slots.numel() <= HOST_LIST_MAX:
            return _host_write_index(keep, slots.tolist(), page_size, layout, kv_cache)
        page, offset = slots // page_size, slots % page_size
        rows = None if layout is None else token_rows(kv_cache, page, offset)
        if rows is None:
            return WriteIndex(keep, page, offset, None)
        return WriteIndex(keep, page, offset, rows, *rows.index.unbind(0))

    # -- kernels ----------------------------------------------------------------------

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
        index = plan.prepared
        assert isinstance(index, WriteIndex), "a torch write plan carries its WriteIndex"
        if index.keep is not None:
            key, value = key.index_select(0, index.keep), value.index_select(0, index.keep)
        if plan.cache.fp8:  # quantized, then moved as bytes
            key = quantize(key, kv_cache.dtype, k_scale).view(torch.uint8)
            value = quantize(value, kv_cache.dtype, v_scale).view(torch.uint8)
            kv_cache = kv_cache.view(torch.uint8)
        view = None if index.rows is None else index.rows.view(kv_cache)
        if view is not None and index.k_rows is not None and index.v_rows is not None:
            view.index_copy_(0, index.k_rows, key)
            view.index_copy_(0, index.v_rows, value)
            return
        kv_cache[index.page, 0, index.offset] = key
        kv_cache[index.page, 1, index.offset] = value

    def _write_latent(
        self, plan: WritePlan, kv_cache: torch.Tensor, latent: torch.Tensor, **scales: float
    ) -> None:
        index = plan.prepared
        assert isinstance(index, WriteIndex), "a torch write plan carries its WriteIndex"
        if index.keep is not None:
            latent = latent.index_select(0, index.keep)
        if plan.cache.fp8:
            latent = quantize(latent, kv_cache.dtype, scales["k_scale"]).view(torch.uint8)
            kv_cache = kv_cache.view(torch.uint8)
        kv_cache[index.page, 0, index.offset] = latent

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
        g = plan.prepared
        if g is None:  # a feature: the general path (decode = one query per sequence)
            return _attend_paged(plan, query, kv_cache, scale, k_scale, v_scale, sinks)
        assert isinstance(g, DecodeGather), "a torch decode plan carries its DecodeGather"
        batch, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        view = None if g.rows is None else g.rows.view(kv_cache)
        if view is not None and g.rows is not None:  # K, V: [B, Hkv, L, D] contiguous
            if g.owner == threading.get_ident() and g.k is not None and g.v is not None:
                torch.index_select(view, 0, g.rows.flat, out=g.workspace)
                k, v = g.k, g.v
            else:
                kv = view.index_select(0, g.rows.flat)
                k, v = _halves(kv, batch, num_kv_heads, g.width, g.max_len)
        else:  # other strides: one advanced-index gather, [B, L, 2, Hkv, D]
            pages, offsets = g.pages, g.offsets
            if pages is None or offsets is None:  # the planning cache took the row view
                valid = None if g.mask is None else g.mask[:, 0, 0] == 0
                pages, offsets = _token_pages(plan, valid)
            kv = kv_cache[pages, :, offsets]
            k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        # One query token: the query heads that share kv head h act as the query
        # rows of h, so GQA needs no repeat of K/V.
        q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if query.dtype != torch.float32:  # fp32 arithmetic, one rounding at the end
            q, k, v = q.float(), k.float(), v.float()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
        out = out.view(batch, num_heads, head_dim)
        return out if out.dtype == query.dtype else out.to(query.dtype)

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
        return _attend_paged(plan, query, kv_cache, scale, k_scale, v_scale, sinks)

    def _copy_pages(self, plan: CopyPlan, kv_cache: torch.Tensor) -> None:
        if plan.cache.fp8:
            kv_cache = kv_cache.view(torch.uint8)  # fp8 moves as bytes
        kv_cache[plan.dst] = kv_cache[plan.src]  # the gather copies src out before the scatter


def _host_write_index(
    keep: torch.Tensor | None,
    slots: list[int],
    page_size: int,
    layout: RowLayout,
    kv_cache: torch.Tensor,
) -> WriteIndex:
    """The WriteIndex of a step's few CPU slots (non-negative), computed on the host and
    made one int64 tensor [4, T] (page, offset, K row, V row): between a model's layers
    each torch op costs microseconds, more than a Python loop over a step's slots."""
    page = [s // page_size for s in slots]
    offset = [s % page_size for s in slots]
    k = [p * layout.a_page + o * layout.a_tok for p, o in zip(page, offset, strict=True)]
    table = torch.tensor([page, offset, k, [r + layout.a_kv for r in k]], dtype=torch.int64)
    index = table[2:]
    row_shape = (kv_cache.shape[3], kv_cache.shape[4])
    rows = Rows(layout.strides, layout.contiguous, layout.n_rows, row_shape, index, index.view(-1))
    pages, offsets, k_rows, v_rows = table.unbind(0)
    return WriteIndex(keep, pages, offsets, rows, k_rows, v_rows)


def _general(plan: AttentionPlan) -> bool:
    """Whether a plan needs the general path: any feature beyond plain attention."""
    return plan.cache.fp8 or plan.cache.latent or plan.attention != PLAIN


def _attend_paged(
    plan: DecodePlan | PrefillPlan,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Each sequence's queries (decode: row b; prefill: its cu_seqlens_q rows) over the
    pages it reads, by :func:`attend`; [rows, Hq, Dv] in the query dtype."""
    opts = plan.attention
    rows, heads, head_dim = query.shape
    out = query.new_empty(rows, heads, opts.v_head_dim or head_dim)
    page_size = plan.cache.page_size
    for b, seq_len in enumerate(plan.host_seq_lens):
        hi = b + 1 if isinstance(plan, DecodePlan) else plan.host_cu_seqlens_q[b + 1]
        lo = hi - plan.q_len(b)
        if hi == lo:
            continue
        first = plan.first_page(b)
        k, v = gather_kv(
            kv_cache,
            plan.block_table[b],
            seq_len,
            first_page=first,
            k_scale=k_scale,
            v_scale=v_scale,
            v_head_dim=opts.v_head_dim,
        )
        got = attend(
            query[lo:hi], k, v, scale, attention=opts, sinks=sinks, key_start=first * page_size
        )
        out[lo:hi] = got.to(query.dtype)
    return out


def _halves(
    gathered: torch.Tensor, batch: int, num_kv_heads: int, width: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, Hkv, max_len, D] of a contiguous head-row gather laid out
    [2, B, Hkv, width] (two strided views: the cheapest view op, once per step)."""
    assert gathered.is_contiguous(), "a gather into a fresh tensor or the workspace"
    head_dim = gathered.shape[-1]
    shape = (batch, num_kv_heads, max_len, head_dim)
    stride = (num_kv_heads * width * head_dim, width * head_dim, head_dim, 1)
    k = gathered.as_strided(shape, stride)
    v = gathered.as_strided(shape, stride, gathered.storage_offset() + gathered.numel() // 2)
    return k, v


def _token_pages(plan: DecodePlan, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Page and offset [B, max_len] int64 of each position; past a row's length (``valid``
    [B, max_len] False) its token 0."""
    position = torch.arange(plan.max_seq_len, device=plan.seq_lens.device)
    token = position.expand(plan.batch, -1) if valid is None else position * valid
    page_size = plan.cache.page_size
    return plan.block_table.long().gather(1, token // page_size), token % page_size
