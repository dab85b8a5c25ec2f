"""Moving pages between a pool and a tier in bulk: one indexed copy per layer.

A pool is seen per layer (KVLayout.layer_views): ``L`` tensors
``[num_pages, parts, page_size, H, D]``. A tier stores whole pages across layers,
so a batch of ``n`` pages is one tensor, page-major::

    pool   views[l][page_ids[i]]        for l in 0..L-1   (L tensors, one per layer)
             |  gather_pages: L index_select           ^  scatter_pages: L index_copy_
             v                                          |
    batch  pages[i, l]                  [n, L, parts, page_size, H, D]  (contiguous)

Each page of the batch is then ``page_bytes`` contiguous bytes, ready for a
host slot, a file or a store object (:func:`byte_view`); pages read back from a
file or a store object become a batch again by :func:`pages_from_bytes`. :func:`promote_rows` writes rows of a
tier's own page store (the host tier's slots) straight into pool pages. Page ids are pool page indices (pages,
not bytes); no Python loop runs per page or per byte. The batch lives on the
pool's device unless ``device`` says otherwise.

Every copy moves bytes: a float8 tensor is copied through its uint8 view
(:func:`raw`), so fp8 pages (NaN and infinity patterns included) and latent pages
come back byte for byte, whatever torch implements for float8 on a device.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.errors import BadRequest

if TYPE_CHECKING:
    import torch

    from kvcore.layout import KVLayout


def _index(
    page_ids: Sequence[int] | torch.Tensor, num_pages: int, device: torch.device
) -> torch.Tensor:
    import torch

    index = torch.as_tensor(page_ids, dtype=torch.int64).reshape(-1).to(device)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_pages):
        raise BadRequest(f"page ids must be in [0, {num_pages})")
    return index


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or for a float8 tensor its uint8 view (same shape, same bytes,
    zero-copy). Copies go through it: torch has no CPU ``index_copy_`` for float8, and
    a copy of uint8 elements is a copy of the bytes."""
    import torch

    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor.view(torch.uint8)
    return tensor


def _check_views(views: Sequence[torch.Tensor]) -> None:
    if not views:
        raise BadRequest("a pool has at least one layer view")
    first = views[0]
    for view in views:
        if view.dim() != 5 or view.shape != first.shape or view.dtype != first.dtype:
            raise BadRequest(
                "layer views must all be [num_pages, parts, page_size, H, D] of one dtype"
            )


def gather_pages(
    views: Sequence[torch.Tensor],
    page_ids: Sequence[int] | torch.Tensor,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Copy pool pages ``page_ids`` out of every layer: ``[n, L, parts, page_size, H, D]``,
    contiguous, on ``device`` (default: the pool's). One index_select per layer."""
    import torch

    _check_views(views)
    first = views[0]
    index = _index(page_ids, first.shape[0], first.device)
    out = torch.empty(
        (index.numel(), len(views), *first.shape[1:]), dtype=first.dtype, device=first.device
    )
    for layer, view in enumerate(views):
        torch.index_select(raw(view), 0, index, out=raw(out[:, layer]))
    return out if device is None else out.to(device)


def scatter_pages(
    views: Sequence[torch.Tensor], page_ids: Sequence[int] | torch.Tensor, pages: torch.Tensor
) -> None:
    """Write ``pages`` ``[n, L, parts, page_size, H, D]`` into pool pages ``page_ids`` of
    every layer (one device transfer, then one index_copy_ per layer). ``page_ids``
    must be distinct."""
    _check_views(views)
    first = views[0]
    index = _index(page_ids, first.shape[0], first.device)
    expected = (index.numel(), len(views), *first.shape[1:])
    if tuple(pages.shape) != expected or pages.dtype != first.dtype:
        raise BadRequest(
            f"pages must be {first.dtype} {list(expected)}, got {pages.dtype} {list(pages.shape)}"
        )
    ordered = index.sort().values
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise BadRequest("page ids of one scatter must be distinct")
    pages = pages.to(first.device, non_blocking=True)
    if first.device.type == "cpu":
        _copy_rows(views, index.tolist(), pages, range(len(pages)))
        return
    for layer, view in enumerate(views):
        raw(view).index_copy_(0, index, raw(pages[:, layer]))


def _copy_rows(
    views: Sequence[torch.Tensor], page_ids: Sequence[int], pages: torch.Tensor, rows: Sequence[int]
) -> None:
    """``views[l][page_ids[i]] = pages[rows[i], l]`` on the CPU: one memcpy-like copy_
    per page and layer. (CPU ``index_copy_`` indexes element by element and ran 3x
    slower than these copies for 64 pages of 1 MiB; on a GPU it is one kernel per layer.)"""
    for page, row in zip(page_ids, rows, strict=True):
        source = pages[row]
        for layer, view in enumerate(views):
            raw(view[page]).copy_(raw(source[layer]))


def promote_rows(
    views: Sequence[torch.Tensor],
    page_ids: Sequence[int],
    store: torch.Tensor,
    rows: Sequence[int],
) -> None:
    """Copy ``store[rows[i]]`` (``[L, parts, page_size, H, D]`` each) into pool pages
    ``page_ids[i]`` of every layer: one copy of each byte on a CPU pool (no staging
    batch); on another device, one gather on the host, one transfer, one
    ``index_copy_`` per layer."""
    import torch

    _check_views(views)
    if views[0].device.type == "cpu":
        _copy_rows(views, page_ids, store, rows)
        return
    index = torch.tensor(list(rows), dtype=torch.int64)
    scatter_pages(views, page_ids, store.index_select(0, index))  # index_select: any dtype


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview, zero-copy.

    The view does not keep ``tensor`` alive: the caller holds the tensor while
    it uses the view."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "byte_view of a strided tensor"
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(bytearray())
    chars = (ctypes.c_char * size).from_address(tensor.data_ptr())
    return memoryview(chars).cast("B")


def pages_from_bytes(buffer: bytearray, count: int, layout: KVLayout) -> torch.Tensor:
    """The first ``count`` pages of ``buffer`` (``layout.page_bytes`` bytes each, page
    after page) as a batch ``[count, L, parts, page_size, H, D]`` of the layout's dtype on
    the CPU, zero-copy: the batch keeps ``buffer`` alive.

    ``buffer`` may be longer (room for pages whose read then failed). A batch of no
    pages is a fresh empty tensor that holds none of ``buffer``: torch.frombuffer
    refuses an empty buffer, and a miss must not pin the scratch of failed reads."""
    import torch

    shape = (count, layout.num_layers, *layout.page_shape)
    if count == 0:
        return torch.empty(shape, dtype=layout.torch_dtype())
    size = count * layout.page_bytes
    assert len(buffer) >= size, f"{count} pages need {size} bytes, the buffer has {len(buffer)}"
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=size)
    return flat.view(layout.torch_dtype()).view(shape)
