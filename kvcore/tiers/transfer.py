"""Moving pages between a pool and a tier in bulk: whole runs of bytes, never one per byte.

A pool is seen as its rows (:meth:`KVLayout.pages_view`): ``[num_pages,
*stored_page_shape]``, row ``p`` being page ``p``'s elements in the pool's order. A
tier stores a page as its row's bytes, so a batch of ``n`` pages is one contiguous
tensor ``[n, *stored_page_shape]`` (a host tier's slots are one too)::

    pool   rows[page_ids[i]]       [num_pages, *stored_page_shape]   (the pool's strides)
             |  gather_pages                        ^  scatter_pages, promote_rows
             v                                      |
    batch  pages[i]                [n, *stored_page_shape]           (contiguous)

What one page's copy costs follows from the order. A row of a page-major pool
(``PLKTH``, ``PLHKT``) is one contiguous run; a row of a layer-major one (``LPKTH``,
``LPHKT``) is ``num_layers`` runs, one per layer, ``page_bytes_per_layer`` each
(:func:`plan_rows` finds them from the strides, for any order). On the CPU each run
is one ``memmove``, the pages split over torch's thread count (:func:`copy_rows`):
one memmove per page when page-major, one per page and layer when layer-major.
Between devices (a GPU pool) a copy is one ``index_select`` on the source's
device, one transfer, one ``index_copy_`` along the page axis on the target's.

Each page of a batch is ``page_bytes`` contiguous bytes, ready for a host slot, a
file or a store object (:func:`byte_view`); pages read back from a file or a store
object become a batch again by :func:`pages_from_bytes`. Page ids are pool page
indices (pages, not bytes); no Python loop runs per byte. The batch lives on the
pool's device unless ``device`` says otherwise.

Every copy moves bytes: a float8 tensor is copied through its uint8 view
(:func:`raw`), so fp8 pages (NaN and infinity patterns included) and latent pages
come back byte for byte, whatever torch implements for float8 on a device.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


def _check_rows(pool: torch.Tensor, other: torch.Tensor, what: str) -> None:
    """BadRequest unless ``other``'s rows are ``pool``'s: one row shape and dtype."""
    if pool.dim() < 2:
        raise BadRequest("a pool's rows are [num_pages, *stored_page_shape] (KVLayout.pages_view)")
    if other.dtype != pool.dtype or tuple(other.shape[1:]) != tuple(pool.shape[1:]):
        raise BadRequest(
            f"{what} must be {pool.dtype} [n, {', '.join(map(str, pool.shape[1:]))}], "
            f"got {other.dtype} {list(other.shape)}"
        )


# -- the plan of a row copy -------------------------------------------------------------

_MAX_RUNS = 512
"""Runs per row above which a CPU copy goes through torch instead (an order with the
page axis deep inside, whose runs are a few hundred bytes: one Python call each would
cost more than the bytes). Every order with the page axis first or second stays below."""


@dataclass(frozen=True, slots=True)
class RowPlan:
    """How a row copy between two tensors of rows splits into contiguous runs: each run
    is ``size`` bytes, at byte offsets ``offsets[j] = (in the target row, in the source
    row)``. ``runs`` is what one page's copy costs in memmoves."""

    size: int
    offsets: tuple[tuple[int, int], ...]

    @property
    def runs(self) -> int:
        return len(self.offsets)


def plan_rows(dst: torch.Tensor, src: torch.Tensor) -> RowPlan:
    """The runs that copy a row of ``src`` into a row of ``dst`` (one row shape and
    element size; any strides inside a row): the trailing axes contiguous in both
    make one run, the axes outside it are enumerated. A page-major pool's row and a
    batch's row share one run; a layer-major pool's row has one per layer."""
    size = dst.element_size()
    axes = [
        (n, a, b)
        for n, a, b in zip(dst.shape[1:], dst.stride()[1:], src.stride()[1:], strict=True)
        if n != 1  # an axis of one element has any stride
    ]
    run = 1
    while axes and axes[-1][1] == run and axes[-1][2] == run:
        run *= axes.pop()[0]
    offsets = [(0, 0)]
    for n, a, b in axes:  # outermost first: runs in memory order
        offsets = [(da + i * a, db + i * b) for da, db in offsets for i in range(n)]
    return RowPlan(run * size, tuple((da * size, db * size) for da, db in offsets))


# -- CPU copies: one memmove per run ----------------------------------------------------

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


@dataclass(frozen=True, slots=True)
class _Rows:
    """One side of a CPU row copy: the address of row 0 and the bytes between rows."""

    base: int
    stride: int


def _memmove_rows(dst: _Rows, src: _Rows, pairs: Sequence[tuple[int, int]], plan: RowPlan) -> None:
    """For each ``(d, s)`` of ``pairs`` and run ``j`` of ``plan``: ``plan.size`` bytes
    from ``src`` row ``s`` + ``offsets[j][1]`` to ``dst`` row ``d`` + ``offsets[j][0]``.
    ctypes.memmove releases the GIL while it copies."""
    memmove = ctypes.memmove
    size = plan.size
    if plan.runs == 1:
        ((dst_at, src_at),) = plan.offsets
        dst_base, src_base = dst.base + dst_at, src.base + src_at
        for d, s in pairs:
            memmove(dst_base + d * dst.stride, src_base + s * src.stride, size)
        return
    for d, s in pairs:
        dst_row, src_row = dst.base + d * dst.stride, src.base + s * src.stride
        for dst_at, src_at in plan.offsets:
            memmove(dst_row + dst_at, src_row + src_at, size)


def _memmove_split(dst: _Rows, src: _Rows, pairs: list[tuple[int, int]], plan: RowPlan) -> None:
    """:func:`_memmove_rows`, the pairs split over up to torch.get_num_threads()
    threads (this one included) when there are at least ``_SPLIT_BYTES`` per thread."""
    import torch

    parts = min(torch.get_num_threads(), len(pairs) * plan.runs * plan.size // _SPLIT_BYTES)
    if parts <= 1:
        _memmove_rows(dst, src, pairs, plan)
        return
    cut = [len(pairs) * i // parts for i in range(parts + 1)]
    futures = [
        _executor().submit(_memmove_rows, dst, src, pairs[cut[i] : cut[i + 1]], plan)
        for i in range(1, parts)
    ]
    _memmove_rows(dst, src, pairs[: cut[1]], plan)
    for future in futures:
        future.result()


def _cpu_copy(
    dst: torch.Tensor, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]
) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` on the CPU, rows in range (callers check:
    the copies are raw). One ``memmove`` per run of :func:`plan_rows`, the pages split
    over torch.get_num_threads() threads as a plain ``copy_`` of the same bytes is. Not
    torch ``copy_`` per page (~3 µs of dispatch per call, and each an OpenMP parallel
    region whose barrier waits for a thread the OS has descheduled: 64 of them ran 3x
    slower than one plain copy on a loaded 2-core machine), nor CPU ``index_copy_``,
    which indexes element by element. Rows of too many short runs (:data:`_MAX_RUNS`)
    take one torch ``copy_`` per page."""
    if not len(dst_rows):
        return
    plan = plan_rows(dst, src)
    if plan.runs > _MAX_RUNS:
        for d, s in zip(dst_rows, src_rows, strict=True):
            raw(dst[d]).copy_(raw(src[s]))
        return
    size = dst.element_size()
    _memmove_split(
        _Rows(dst.data_ptr(), dst.stride(0) * size),
        _Rows(src.data_ptr(), src.stride(0) * size),
        list(zip(dst_rows, src_rows, strict=True)),
        plan,
    )


def _select(src: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``src[rows]`` as a fresh contiguous batch: one ``index_select`` along the page
    axis on ``src``'s device (any strides: an order's rows), float8 as bytes."""
    import torch

    index = torch.tensor(list(rows), dtype=torch.int64, device=src.device)
    return torch.index_select(raw(src), 0, index).view(src.dtype)


def _index_copy(dst: torch.Tensor, rows: Sequence[int], batch: torch.Tensor) -> None:
    """``dst[rows[i]] = batch[i]``: one ``index_copy_`` along the page axis on ``dst``'s
    device (any strides), float8 as bytes; ``batch`` already there."""
    import torch

    index = torch.tensor(list(rows), dtype=torch.int64, device=dst.device)
    raw(dst).index_copy_(0, index, raw(batch))


def _indexed_copy(
    dst: torch.Tensor, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]
) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` across devices: one gather on ``src``'s
    device (memmoves into a fresh batch on the CPU, :func:`_select` elsewhere), one
    transfer, then memmoves into a CPU ``dst`` or :func:`_index_copy` on another
    device's."""
    import torch

    if src.device.type == "cpu":
        batch = torch.empty((len(src_rows), *src.shape[1:]), dtype=src.dtype)
        _cpu_copy(batch, range(len(src_rows)), src, src_rows)
    else:
        batch = _select(src, src_rows)
    if dst.device.type == "cpu":
        _cpu_copy(dst, dst_rows, batch.cpu(), range(len(batch)))  # D2H: waits for the copy
    else:  # H2D: queued on the stream before the index_copy_ that reads it
        _index_copy(dst, dst_rows, batch.to(dst.device, non_blocking=True))


def copy_rows(
    dst: torch.Tensor, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]
) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for each i, byte for byte: the one mover
    under every other. ``dst`` and ``src`` are tensors of rows of one row shape and
    dtype (a pool's :meth:`~KVLayout.pages_view`, a batch, a host tier's slots), any
    strides, any devices; rows in range and ``dst_rows`` distinct (callers check).
    Both on the CPU: one memmove per run (:func:`plan_rows`); otherwise
    :func:`_indexed_copy`."""
    assert len(dst_rows) == len(src_rows), "copy_rows needs one source row per target row"
    if dst.device.type == src.device.type == "cpu":
        _cpu_copy(dst, dst_rows, src, src_rows)
    elif len(dst_rows):
        _indexed_copy(dst, dst_rows, src, src_rows)


# -- pool <-> batch ---------------------------------------------------------------------


def gather_pages(
    pool: torch.Tensor,
    page_ids: Sequence[int] | torch.Tensor,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Copy pool pages ``page_ids`` out of the pool's rows ``pool`` (KVLayout.pages_view):
    ``[n, *stored_page_shape]``, contiguous, on ``device`` (default: the pool's)."""
    import torch

    _check_rows(pool, pool, "pool")
    index = _index(page_ids, pool.shape[0], pool.device)
    rows = index.tolist()
    if pool.device.type == "cpu":
        out = torch.empty((len(rows), *pool.shape[1:]), dtype=pool.dtype)
        _cpu_copy(out, range(len(rows)), pool, rows)
    else:
        out = _select(pool, rows)
    return out if device is None else out.to(device)


def scatter_pages(
    pool: torch.Tensor, page_ids: Sequence[int] | torch.Tensor, pages: torch.Tensor
) -> None:
    """Write ``pages`` ``[n, *stored_page_shape]`` into pool pages ``page_ids`` of the
    pool's rows ``pool`` (KVLayout.pages_view). ``page_ids`` must be distinct."""
    _check_rows(pool, pages, "pages")
    index = _index(page_ids, pool.shape[0], pool.device)
    if len(pages) != index.numel():
        raise BadRequest(f"{index.numel()} page ids for {len(pages)} pages")
    ordered = index.sort().values
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise BadRequest("page ids of one scatter must be distinct")
    copy_rows(pool, index.tolist(), pages, range(len(pages)))


def take_rows(store: torch.Tensor, rows: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """``out[i] = store[rows[i]]`` for each i; returns ``out[: len(rows)]``. Both are
    contiguous CPU tensors of one dtype and row shape, ``rows`` in range and ``out``
    at least ``len(rows)`` rows (callers check). One memmove per row."""
    assert store.is_contiguous() and out.is_contiguous(), "take_rows of a strided tensor"
    assert store.dtype == out.dtype and store.shape[1:] == out.shape[1:] and len(out) >= len(rows)
    assert store.device.type == out.device.type == "cpu", "take_rows on the CPU only"
    assert not rows or 0 <= min(rows) <= max(rows) < len(store), "a row out of range"
    _cpu_copy(out, range(len(rows)), store, rows)
    return out[: len(rows)]


def _check_transfer(
    pool: torch.Tensor, page_ids: Sequence[int], store: torch.Tensor, rows: Sequence[int]
) -> None:
    _check_rows(pool, store, "store")
    if page_ids and (min(page_ids) < 0 or max(page_ids) >= len(pool)):
        raise BadRequest(f"page ids must be in [0, {len(pool)})")
    if rows and (min(rows) < 0 or max(rows) >= len(store)):
        raise BadRequest(f"rows must be in [0, {len(store)})")
    if len(rows) != len(page_ids):
        raise BadRequest("a transfer needs one pool page per row")


def promote_rows(
    pool: torch.Tensor, page_ids: Sequence[int], store: torch.Tensor, rows: Sequence[int]
) -> None:
    """Copy ``store[rows[i]]`` into pool page ``page_ids[i]`` of the pool's rows ``pool``
    (KVLayout.pages_view), with no staging batch on a CPU pool: each byte copied once,
    one memmove per page when page-major. ``store`` is ``[rows, *stored_page_shape]``
    of the pool's dtype (a host tier's slots); ``page_ids`` distinct."""
    _check_transfer(pool, page_ids, store, rows)
    copy_rows(pool, page_ids, store, rows)


def spill_rows(
    pool: torch.Tensor, page_ids: Sequence[int], store: torch.Tensor, rows: Sequence[int]
) -> None:
    """Copy pool page ``page_ids[i]`` of the pool's rows ``pool`` into ``store[rows[i]]``:
    :func:`promote_rows` the other way, each byte copied once on the CPU (a GPU pool's
    pages gathered on the GPU, one transfer). ``rows`` distinct."""
    _check_transfer(pool, page_ids, store, rows)
    copy_rows(store, rows, pool, page_ids)


# -- batch <-> bytes --------------------------------------------------------------------


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
    after page, each in its stored form) as a batch ``[count, *stored_page_shape]`` of
    the layout's dtype on the CPU, zero-copy: the batch keeps ``buffer`` alive.

    ``buffer`` may be longer (room for pages whose read then failed). A batch of no
    pages is a fresh empty tensor that holds none of ``buffer``: torch.frombuffer
    refuses an empty buffer, and a miss must not pin the scratch of failed reads."""
    import torch

    shape = (count, *layout.stored_page_shape)
    if count == 0:
        return torch.empty(shape, dtype=layout.torch_dtype())
    size = count * layout.page_bytes
    assert len(buffer) >= size, f"{count} pages need {size} bytes, the buffer has {len(buffer)}"
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=size)
    return flat.view(layout.torch_dtype()).view(shape)
