"""Moving pages between a pool and a tier in bulk: whole-chunk copies, never one per byte.

A pool is seen per layer (KVLayout.layer_views): ``L`` tensors
``[num_pages, parts, page_size, H, D]``. A tier stores whole pages across layers,
so a batch of ``n`` pages is one tensor, page-major::

    pool   views[l][page_ids[i]]        for l in 0..L-1   (L tensors, one per layer)
             |  gather_pages: L index_select           ^  scatter_pages: L index_copy_ (GPU)
             v                                          |
    batch  pages[i, l]                  [n, L, parts, page_size, H, D]  (contiguous)

Each page of the batch is then ``page_bytes`` contiguous bytes, ready for a
host slot, a file or a store object (:func:`byte_view`); pages read back from a
file or a store object become a batch again by :func:`pages_from_bytes`. :func:`promote_rows` writes rows of a
tier's own page store (the host tier's slots) straight into pool pages. Page ids are pool page indices (pages,
not bytes); no Python loop runs per byte. The batch lives on the
pool's device unless ``device`` says otherwise.

Copies into a CPU pool (scatter, promotion) are one ``memmove`` per page and
layer, the pages split over torch's thread count (:func:`_copy_rows`); on a GPU,
one ``index_copy_`` per layer.

Every copy moves bytes: a float8 tensor is copied through its uint8 view
(:func:`raw`), so fp8 pages (NaN and infinity patterns included) and latent pages
come back byte for byte, whatever torch implements for float8 on a device.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
        if (
            view.dim() != 5
            or view.shape != first.shape
            or view.dtype != first.dtype
            or view.device != first.device
        ):
            raise BadRequest(
                "layer views must all be [num_pages, parts, page_size, H, D] of one dtype"
                " on one device"
            )


def gather_pages(
    views: Sequence[torch.Tensor],
    page_ids: Sequence[int] | torch.Tensor,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Copy pool pages ``page_ids`` out of every layer: ``[n, L, parts, page_size, H, D]``,
    contiguous, on ``device`` (default: the pool's). One index_select per layer (on
    the CPU the fresh batch's page faults cost more than these copies)."""
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


_SPLIT_BYTES = 1 << 20
"""Bytes below which a CPU page copy stays on the calling thread (a thread's
hand-off costs about what copying this much does)."""
_workers: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, pool)


def _executor() -> ThreadPoolExecutor:
    """This process's copy threads (made again in a forked child, whose copy of
    the parent's pool has no threads)."""
    global _workers
    if _workers is None or _workers[0] != os.getpid():
        _workers = (os.getpid(), ThreadPoolExecutor(thread_name_prefix="kvcore-copy"))
    return _workers[1]


def _memmove_pages(
    bases: list[int],
    page_stride: int,
    pairs: Sequence[tuple[int, int]],
    batch: int,
    strides: tuple[int, int],
    size: int,
) -> None:
    """For each ``(page, row)`` and layer ``l``: ``size`` bytes from the batch at
    ``batch + row * strides[0] + l * strides[1]`` to the pool at ``bases[l] + page *
    page_stride``. Addresses and strides in bytes; ctypes.memmove releases the GIL
    while it copies."""
    memmove = ctypes.memmove
    row_stride, layer_stride = strides
    for page, row in pairs:
        offset = page * page_stride
        start = batch + row * row_stride
        for base in bases:
            memmove(base + offset, start, size)
            start += layer_stride


def _memmove_split(
    bases: list[int],
    page_stride: int,
    pairs: list[tuple[int, int]],
    batch: int,
    strides: tuple[int, int],
    size: int,
) -> None:
    """:func:`_memmove_pages`, the pairs split over up to torch.get_num_threads()
    threads (this one included) when there are at least ``_SPLIT_BYTES`` per thread."""
    import torch

    parts = min(torch.get_num_threads(), len(pairs) * len(bases) * size // _SPLIT_BYTES)
    if parts <= 1:
        _memmove_pages(bases, page_stride, pairs, batch, strides, size)
        return
    cut = [len(pairs) * i // parts for i in range(parts + 1)]
    futures = [
        _executor().submit(
            _memmove_pages, bases, page_stride, pairs[cut[i] : cut[i + 1]], batch, strides, size
        )
        for i in range(1, parts)
    ]
    _memmove_pages(bases, page_stride, pairs[: cut[1]], batch, strides, size)
    for future in futures:
        future.result()


def _copy_rows(
    views: Sequence[torch.Tensor], page_ids: Sequence[int], pages: torch.Tensor, rows: Sequence[int]
) -> None:
    """``views[l][page_ids[i]] = pages[rows[i], l]`` for every layer ``l``, on the CPU.
    Page ids and rows must be in range (callers check: the copies are raw).

    One ``memmove`` per page and layer (a page's layer chunk is contiguous on both
    sides), the pages split over torch.get_num_threads() threads as a plain
    ``copy_`` of the same bytes is. Not torch ``copy_`` per page and layer (~3 µs of
    dispatch per call, 1,024 calls for 64 pages of 16 layers), nor one strided
    ``copy_`` per page: each is an OpenMP parallel region whose barrier waits for a
    thread the OS has descheduled, which made 64 of them 3x slower than one plain
    copy on a loaded 2-core machine; nor CPU ``index_copy_``, which indexes element
    by element. Views or pages not contiguous page by page take one torch ``copy_``
    per page and layer."""
    first = views[0]
    if all(view.is_contiguous() for view in views) and (
        not len(pages) or pages[0, 0].is_contiguous()
    ):
        size = first.element_size()
        _memmove_split(
            [view.data_ptr() for view in views],
            first.stride(0) * size,
            list(zip(page_ids, rows, strict=True)),
            pages.data_ptr(),
            (pages.stride(0) * pages.element_size(), pages.stride(1) * pages.element_size()),
            first[0].numel() * size,
        )
        return
    for page, row in zip(page_ids, rows, strict=True):
        source = pages[row]
        for layer, view in enumerate(views):
            raw(view[page]).copy_(raw(source[layer]))


def take_rows(store: torch.Tensor, rows: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """``out[i] = store[rows[i]]`` for each i; returns ``out[: len(rows)]``. Both are
    contiguous CPU tensors of one dtype and row shape, ``rows`` in range and ``out``
    at least ``len(rows)`` rows (callers check). One memmove per row, split over
    threads as :func:`_copy_rows` (torch's ``index_select`` is an OpenMP region per
    call, slow under load)."""
    assert store.is_contiguous() and out.is_contiguous(), "take_rows of a strided tensor"
    assert store.dtype == out.dtype and store.shape[1:] == out.shape[1:] and len(out) >= len(rows)
    assert store.device.type == out.device.type == "cpu", "take_rows on the CPU only"
    assert not rows or 0 <= min(rows) <= max(rows) < len(store), "a row out of range"
    size = store[0].numel() * store.element_size() if len(store) else 0
    pairs = list(enumerate(rows))
    _memmove_split([out.data_ptr()], size, pairs, store.data_ptr(), (size, 0), size)
    return out[: len(rows)]


def promote_rows(
    views: Sequence[torch.Tensor],
    page_ids: Sequence[int],
    store: torch.Tensor,
    rows: Sequence[int],
) -> None:
    """Copy ``store[rows[i]]`` (``[L, parts, page_size, H, D]`` each) into pool pages
    ``page_ids[i]`` of every layer: one copy of each byte on a CPU pool (no staging
    batch); on another device, one gather on the host, one transfer, one
    ``index_copy_`` per layer. ``store`` is ``[rows, L, parts, page_size, H, D]`` of the
    views' dtype; ``page_ids`` are pool pages, ``rows`` rows of ``store``."""
    import torch

    _check_views(views)
    first = views[0]
    if store.dtype != first.dtype or tuple(store.shape[1:]) != (len(views), *first.shape[1:]):
        raise BadRequest(
            f"store must be {first.dtype} [rows, {len(views)}, *page], got {store.dtype}"
        )
    if page_ids and (min(page_ids) < 0 or max(page_ids) >= first.shape[0]):
        raise BadRequest(f"page ids must be in [0, {first.shape[0]})")
    if rows and (min(rows) < 0 or max(rows) >= len(store)):
        raise BadRequest(f"rows must be in [0, {len(store)})")
    if len(rows) != len(page_ids):
        raise BadRequest("promote_rows needs one pool page per row")
    if first.device.type == "cpu" and store.device.type == "cpu":
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
