"""Pages between SGLang's host KV pool and a kvcore pool, as strided views.

Both sides are seen as ``[pages, layers, parts, page_size, heads, head_dim]``
without a copy: kvcore's pool is ``[layers, pages, parts, page_size, heads,
head_dim]`` (kvcore.layout; parts: K then V of a ``kv`` page, the one latent
vector of a ``latent`` page), SGLang's host pool one ``kv_buffer`` in one of four
layouts (its ``pool_host/mha.py`` and ``pool_host/mla.py``), with ``size`` =
pages x page_size tokens:

==================  ============================================  =================
layout              MHA kv_buffer                                 one page (flat)
==================  ============================================  =================
layer_first         [2, layers, size, heads, head_dim]            [2, layers, ps, h, d]
page_first          [2, size, layers, heads, head_dim]            [2, ps, layers, h, d]
page_first_direct   [2, pages, layers, ps, heads, head_dim]       [2, layers, ps, h, d]
page_head           [2, pages, heads, ps, layers, head_dim]       [2, h, ps, layers, d]
==================  ============================================  =================

An MLA host pool's ``kv_buffer`` is the MHA one of its layout without the leading
parts dim, one head wide and ``kv_cache_dim`` (kv_lora_rank + qk_rope_head_dim)
deep: ``[layers, size, 1, D]``, ``[size, layers, 1, D]``, ``[pages, layers, ps, 1,
D]``, its flat pages likewise (SGLang has no MLA ``page_head``). So it is that
buffer with a parts dim of 1 put in front (``latent=True``), and every layout,
flat order and copy below serves both. An fp8 cache is uint8 bytes on SGLang's side
(its ``store_dtype``) and float8 in kvcore's pool: the pool is seen through its
uint8 view, so copies move bytes.

A copy of n pages is one memmove per contiguous run of each page (no staging):
kvcore.tiers.transfer plans the runs from both sides' strides. A page of a pool in
the order its host layout matches (:data:`HOST_ORDERS`) is SGLang's page byte for
byte, part by part: one run per part, so two memmoves per MHA page (SGLang keeps K
and V in the two halves of ``kv_buffer``) and one per MLA page. ``layer_first`` and
a layer-major pool share ``2 x layers`` runs per page, whatever the pool's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.tiers.transfer import copy_rows, raw

if TYPE_CHECKING:
    import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
HOST_ORDERS = {
    "layer_first": "LPKTH",  # a page: per part and layer [ps, H, D]
    "page_first": "PKTLH",  # a page: per part [ps, L, H, D]
    "page_first_direct": "PKLTH",  # a page: per part [L, ps, H, D]
    "page_head": "PKHTL",  # a page: per part [H, ps, L, D]
}
"""The pool order (kvcore.layout) whose page is each host layout's page, run for run:
a part of a page-major one is one run on both sides (module docstring)."""


def host_pages(
    kv_buffer: torch.Tensor, layout: str, page_size: int, *, latent: bool = False
) -> torch.Tensor:
    """``kv_buffer`` of an SGLang host pool as ``[pages, layers, parts, ps, heads, d]``
    (an MHA pool's: parts 2; an MLA pool's, ``latent``: parts 1, heads 1). ValueError
    for a layout not in :data:`LAYOUTS` or a shape that does not fit it."""
    if latent:  # MLA's kv_buffer is MHA's of one part (module docstring)
        kv_buffer = kv_buffer.unsqueeze(0)
    if layout in ("layer_first", "page_first"):
        _check_dims(kv_buffer, 5, layout)
        size = kv_buffer.shape[2 if layout == "layer_first" else 1]  # tokens
        if size % page_size:
            raise ValueError(
                f"an SGLang host pool of {size} tokens is not whole pages of {page_size}"
            )
        num_pages = size // page_size
        if layout == "layer_first":  # [2, L, P*ps, H, D]
            parts, layers, _, heads, dim = kv_buffer.shape
            view = kv_buffer.view(parts, layers, num_pages, page_size, heads, dim)
            return view.permute(2, 1, 0, 3, 4, 5)
        parts, _, layers, heads, dim = kv_buffer.shape  # page_first: [2, P*ps, L, H, D]
        view = kv_buffer.view(parts, num_pages, page_size, layers, heads, dim)
        return view.permute(1, 3, 0, 2, 4, 5)
    if layout == "page_first_direct":  # [2, P, L, ps, H, D]
        _check_dims(kv_buffer, 6, layout)
        return kv_buffer.permute(1, 2, 0, 3, 4, 5)
    if layout == "page_head":  # [2, P, H, ps, L, D]
        _check_dims(kv_buffer, 6, layout)
        return kv_buffer.permute(1, 4, 0, 3, 2, 5)
    raise ValueError(f"SGLang host layout {layout!r} is not one of {', '.join(LAYOUTS)}")


def flat_page(page: torch.Tensor, layout: str) -> torch.Tensor:
    """One page ``[layers, parts, ps, heads, d]`` in the order of ``layout``'s flat page
    (SGLang's ``get_data_page(flat=True)``), as a contiguous 1-D tensor."""
    order = _FLAT_ORDER[layout]
    return page.permute(*order).contiguous().view(-1)


def unflat_page(data: torch.Tensor, layout: str, shape: torch.Size) -> torch.Tensor:
    """The inverse of :func:`flat_page`: ``data`` (``layout``'s flat page order) as a
    ``[layers, parts, ps, heads, d]`` view, for a page of ``shape`` (that shape)."""
    order = _FLAT_ORDER[layout]
    permuted = [shape[i] for i in order]
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return data.reshape(permuted).permute(*inverse)


def pool_pages(layer_views: list[torch.Tensor]) -> torch.Tensor:
    """kvcore's per-layer views (``Client.kv_caches``: ``[pages, parts, ps, heads, d]``
    each, layers at one stride of one region, in any physical order) as
    ``[pages, layers, parts, ps, heads, d]``, zero-copy; a float8 pool as its uint8
    bytes (SGLang's host pool holds fp8 as uint8)."""
    import torch

    first = raw(layer_views[0])
    step = raw(layer_views[1]).storage_offset() - first.storage_offset() if layer_views[1:] else 0
    if any(
        raw(view).storage_offset() != first.storage_offset() + i * step
        or view.stride() != layer_views[0].stride()
        for i, view in enumerate(layer_views)
    ):
        raise ValueError("kvcore's layer views are not one region, a layer stride apart")
    shape = (len(layer_views), *first.shape)
    full = torch.as_strided(first, shape, (step, *first.stride()), first.storage_offset())
    return full.permute(1, 0, 2, 3, 4, 5)


def copy_pages(
    dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor, src_pages: torch.Tensor
) -> None:
    """``dst[dst_pages[i]] = src[src_pages[i]]`` for every i, both ``[pages, ...]`` views
    of equal page shape and dtype (float8 as bytes), any strides. The page's axes are
    put in ``src``'s memory order on both sides first, so the axes contiguous on both
    merge into one run (kvcore.tiers.transfer.plan_rows): on the CPU one memmove per
    run, split over threads only above 1 MiB a thread (copy_rows)."""
    strides = list(zip(src.stride(), dst.stride(), strict=True))
    axes = sorted(range(1, src.dim()), key=lambda a: (-strides[a][0], -strides[a][1]))
    copy_rows(
        raw(dst).permute(0, *axes),
        dst_pages.tolist(),
        raw(src).permute(0, *axes),
        src_pages.tolist(),
    )


# [layers, parts, ps, heads, d] -> the flat page order of each layout
_FLAT_ORDER: dict[str, tuple[int, ...]] = {
    "layer_first": (1, 0, 2, 3, 4),  # [2, L, ps, H, D]
    "page_first": (1, 2, 0, 3, 4),  # [2, ps, L, H, D]
    "page_first_direct": (1, 0, 2, 3, 4),  # [2, L, ps, H, D]
    "page_head": (1, 3, 2, 0, 4),  # [2, H, ps, L, D]
}


def _check_dims(tensor: torch.Tensor, dims: int, layout: str) -> None:
    if tensor.dim() != dims:
        raise ValueError(f"an SGLang {layout} kv_buffer has {dims} dims, got {tensor.dim()}")
