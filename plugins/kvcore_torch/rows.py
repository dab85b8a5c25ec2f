"""One layer's cache seen as rows of contiguous elements: views and row indices.

A row is one head's ``[D]`` (a head row) or one token's ``[Hkv, D]`` (a token
row). Where the cache's strides allow it, a gather or scatter of K/V is one
``index_select`` / ``index_copy_`` over such a view instead of an advanced-index
gather: decode (:class:`kvcore_torch.backend.DecodeGather`) reads head rows,
writes (:class:`kvcore_torch.backend.WriteIndex`) fill token rows. Indices are
int64 and count rows, not elements; a layout's ``a_*`` fields are strides in rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Rows:
    """The cache seen as rows of contiguous elements (``row_shape``): a view over its
    storage, no copy. ``index`` holds the rows of K (``index[0]``) and V
    (``index[1]``) of the gathered or scattered elements; ``flat`` is it flattened.
    Valid for caches with exactly ``strides`` (every layer of a pool has its first
    layer's); a contiguous cache takes the cheaper ``view``."""

    strides: tuple[int, ...]
    contiguous: bool  # the planning cache was contiguous
    n_rows: int
    row_shape: tuple[int, ...]  # (D,) for head rows, (Hkv, D) for token rows
    index: torch.Tensor
    flat: torch.Tensor

    def view(self, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """The row view of ``kv_cache``, or None where its strides differ from the plan's."""
        if self.contiguous and kv_cache.is_contiguous():
            return kv_cache.view(-1, *self.row_shape)
        if kv_cache.stride() != self.strides:
            return None
        shape = (self.n_rows, *self.row_shape)
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        return kv_cache.as_strided(shape, stride)


@dataclass(frozen=True, slots=True)
class RowLayout:
    """A cache's strides in rows of ``width`` elements (head rows [D] or token rows
    [Hkv, D]): ``a_*`` rows per page, K/V half, token and head (0 for token rows)."""

    strides: tuple[int, ...]  # the cache's, in elements
    contiguous: bool
    n_rows: int  # rows the view spans
    a_page: int
    a_kv: int
    a_tok: int
    a_head: int
    num_kv_heads: int
    page_size: int


def row_layout(kv_cache: torch.Tensor, *, per_head: bool) -> RowLayout | None:
    """The cache as rows: None where the strides allow no such view (a row must be
    contiguous and every stride of the indexed dims a multiple of its width)."""
    return _layout(tuple(kv_cache.shape), kv_cache.stride(), kv_cache.is_contiguous(), per_head)


@functools.lru_cache(maxsize=64)
def _layout(
    shape: tuple[int, ...], strides: tuple[int, ...], contiguous: bool, per_head: bool
) -> RowLayout | None:
    """:func:`row_layout` of a cache of this shape and strides (a constant of the
    geometry, computed once per step's plan otherwise)."""
    num_pages, _, page_size, num_kv_heads, head_dim = shape
    s_page, s_kv, s_tok, s_head, s_dim = strides
    if s_dim != 1 and head_dim > 1:
        return None
    if per_head:
        width = head_dim
    else:  # token rows: one [Hkv, D] block per token
        if s_head != head_dim and num_kv_heads > 1:
            return None
        width, s_head = num_kv_heads * head_dim, 0
    steps = (s_page, s_kv, s_tok, s_head)
    if any(s % width for s in steps):
        return None
    a_page, a_kv, a_tok, a_head = (s // width for s in steps)
    last = (num_pages - 1) * a_page + a_kv + (page_size - 1) * a_tok + (num_kv_heads - 1) * a_head
    per_row = (a_page, a_kv, a_tok, a_head, num_kv_heads, page_size)
    # the cache's own five strides: what Rows.view compares a run's cache against (a
    # four-entry tuple here never equalled a view's stride(), so every non-contiguous
    # cache, any order but layer-major, took the advanced-index path)
    return RowLayout(strides, contiguous, last + 1, *per_row)


@functools.lru_cache(maxsize=64)
def page_offsets(layout: RowLayout, device: torch.device) -> torch.Tensor:
    """[2, 1, Hkv, 1, page_size] int64: the head row of (K or V, head h, offset o) in
    page 0 (a constant of the geometry; never written)."""
    kv = torch.arange(2, device=device).view(2, 1, 1, 1, 1) * layout.a_kv
    head = torch.arange(layout.num_kv_heads, device=device).view(1, 1, -1, 1, 1) * layout.a_head
    tok = torch.arange(layout.page_size, device=device).view(1, 1, 1, 1, -1) * layout.a_tok
    return kv + head + tok


def token_rows(kv_cache: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> Rows | None:
    """Token rows [Hkv, D] of the tokens at (``pages``, ``offsets``) (int64 [T]) with
    an index [2, T] (K rows, then V rows); None where the strides allow no such view."""
    layout = row_layout(kv_cache, per_head=False)
    if layout is None:
        return None
    tok = offsets if layout.a_tok == 1 else offsets * layout.a_tok
    rows = torch.add(tok, pages, alpha=layout.a_page)
    index = torch.add(_kv_column(layout.a_kv, pages.device), rows)  # [2, T]: K rows, V rows
    row_shape = (kv_cache.shape[3], kv_cache.shape[4])
    return Rows(layout.strides, layout.contiguous, layout.n_rows, row_shape, index, index.view(-1))


@functools.lru_cache(maxsize=64)
def _kv_column(a_kv: int, device: torch.device) -> torch.Tensor:
    """[[0], [a_kv]] int64: the row offsets of K and V (a constant; never written)."""
    return torch.tensor([[0], [a_kv]], device=device)
