"""Boundary checks of the kernel API (kvcore.backend): BadRequest for bad input.
(Unsupported, for what a backend does not declare, is kvcore.backend's: it reads
the capabilities.)

Two kinds. Shape, dtype and device checks read no tensor data; the run methods
(``decode``/``prefill``/``write_kv``/``copy_pages`` of a plan) use only these.
Value checks (lengths, page indices, slots) are collected in a :class:`ValueChecks`
and raised in the order queued. On a device they are vectorised tensor expressions
read back in one transfer, together with whatever host copies the plan keeps, so
planning a step synchronises with the device once. On the host (``ValueChecks.host``:
CPU tensors, which have no transfer to save) the table and slot checks read the
tensors' own memory through numpy and their flags are Python bools: a few numpy
reductions instead of some forty torch dispatches of a few microseconds each, the
cost of a decode step's plan on a CPU. Both paths raise the same BadRequest for the
same input (the messages are built by the same code, from the tensors).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice, permutations
from typing import TYPE_CHECKING

from kvcore.errors import BadRequest
from kvcore.layout import AXES, cdiv

if TYPE_CHECKING:
    import torch


def fmt_shape(pattern: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in pattern) + "]"


def check_tensor(
    t: object, name: str, device: torch.device, pattern: tuple[int | None, ...]
) -> torch.Tensor:
    """A tensor of ``pattern`` (None: any size) on ``device``; reads no data."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise BadRequest(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shape = t.shape
    if len(shape) != len(pattern):
        raise BadRequest(f"{name} must have shape {fmt_shape(pattern)}, got {list(shape)}")
    for got, want in zip(shape, pattern, strict=True):  # a loop: run checks are per layer
        if want is not None and got != want:
            raise BadRequest(f"{name} must have shape {fmt_shape(pattern)}, got {list(shape)}")
    if t.device != device:
        raise BadRequest(f"{name} is on {t.device}, kv_cache on {device}")
    return t


def check_cache(kv_cache: object) -> torch.Tensor:
    """kv_cache [num_pages >= 1, 2, page_size >= 1, Hkv >= 1, D >= 1] or a latent (MLA)
    pool's layer [num_pages >= 1, 1, page_size >= 1, 1, D >= 1], last dim contiguous.
    (Whether the backend computes on a latent or fp8 cache is its capabilities'.)"""
    import torch

    if not isinstance(kv_cache, torch.Tensor):
        raise BadRequest(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    shape = tuple(kv_cache.shape)
    latent = len(shape) == 5 and shape[1] == 1 and shape[3] == 1
    if len(shape) != 5 or (shape[1] != 2 and not latent) or min(shape) < 1:
        raise BadRequest(
            f"kv_cache must have shape [num_pages, 2, page_size, num_kv_heads, head_dim] "
            f"(latent: [num_pages, 1, page_size, 1, head_dim]) with every dim >= 1, "
            f"got {list(shape)}"
        )
    check_last_dim(kv_cache, "kv_cache")
    return kv_cache


def check_last_dim(t: torch.Tensor, name: str) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise BadRequest(f"{name} must have a contiguous last dim, got strides {t.stride()}")


# -- pool orders: which KVLayout.order a layer view's strides come from ----------------

NAMED_ORDERS: tuple[str, ...] = (AXES, "PLKTH", "LPHKT", "PLHKT")
"""The orders kvcore names (kvcore/layout.py): layer-major, page-major, head-outer, and
page-major head-outer; listed first wherever a view fits several orders."""
ALL_ORDERS: tuple[str, ...] = (
    *NAMED_ORDERS,
    *("".join(p) for p in permutations(AXES) if "".join(p) not in NAMED_ORDERS),
)
"""Every permutation of :data:`kvcore.layout.AXES`: the 24 pool orders."""


def fits_order(order: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a layer view of ``shape`` [P, K, T, H, D] and ``strides`` (elements) is
    one layer of a pool of ``order`` with some number of layers: from the innermost
    axis out, each axis longer than 1 steps over exactly the axes inside it, except
    that the first one outside ``L`` steps over a whole number (>= 1) of layers.
    Axes of length 1 never move an address, so their strides are not compared; D is
    contiguous (checked apart). A padded slice fits no order."""
    sizes = dict(zip("PKTH", shape[:4], strict=True))
    steps = dict(zip("PKTH", strides[:4], strict=True))
    step = shape[4]  # elements inside the current axis
    layers_inside = False  # L lies between the current axis and the ones already seen
    for axis in reversed(order):
        if axis == "L":
            layers_inside = True
            continue
        size, stride = sizes[axis], steps[axis]
        if size > 1:
            if layers_inside:  # the layers' extent: a multiple of one layer's block
                if stride < step or stride % step:
                    return False
                step, layers_inside = stride, False
            elif stride != step:
                return False
        step *= size
    return True


@functools.lru_cache(maxsize=256)
def view_order(shape: tuple[int, ...], strides: tuple[int, ...]) -> str | None:
    """The pool order a layer view's strides come from (the first of
    :data:`ALL_ORDERS` that fits; several fit where axes have length 1 or a pool
    one layer), or None: strides no pool gives (a slice of a padded tensor)."""
    return next((o for o in ALL_ORDERS if fits_order(o, shape, strides)), None)


@functools.lru_cache(maxsize=256)
def fits_orders(orders: frozenset[str], shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether the view fits one of ``orders`` (a geometry's constant: cached, so a
    run's check is one lookup)."""
    return any(fits_order(o, shape, strides) for o in orders)


def check_float(
    t: object,
    name: str,
    device: torch.device,
    dtype: torch.dtype | None,
    pattern: tuple[int | None, ...],
) -> torch.Tensor:
    """A query/key/value tensor: shape, the cache's dtype (None, for an fp8 cache: float16,
    bfloat16 or float32) and device, last dim contiguous."""
    import torch

    t = check_tensor(t, name, device, pattern)
    if dtype is None:
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise BadRequest(
                f"{name} has dtype {t.dtype}; on an fp8 cache it must be float16, bfloat16 "
                "or float32"
            )
    elif t.dtype != dtype:
        raise BadRequest(f"{name} has dtype {t.dtype}, kv_cache {dtype}: they must match")
    check_last_dim(t, name)
    return t


def check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise BadRequest(
            f"query heads ({num_q_heads}) must be a positive multiple of kv heads ({num_kv_heads})"
        )


def check_index(
    t: object,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    pattern: tuple[int | None, ...],
) -> torch.Tensor:
    """An index tensor: shape, exact integer dtype, device; returned contiguous."""
    t = check_tensor(t, name, device, pattern)
    if t.dtype != dtype:
        raise BadRequest(f"{name} must be {dtype}, got {t.dtype}")
    return t.contiguous()


def check_scale(scale: object, name: str = "scale", *, positive: bool = False) -> float:
    """A finite host float (``positive``: also > 0, as fp8 scales must be)."""
    if (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not math.isfinite(scale)
        or (positive and scale <= 0)
    ):
        what = "a finite float > 0" if positive else "a finite float"
        raise BadRequest(f"{name} must be {what}, got {scale!r}")
    return float(scale)


def check_sinks(sinks: object, num_q_heads: int, device: torch.device) -> torch.Tensor:
    """sinks [Hq] float32 on the cache's device, one logit per query head (no data read)."""
    import torch

    if sinks is None:
        raise BadRequest("the plan has Attention(sinks=True): the run needs sinks [Hq] float32")
    sinks = check_tensor(sinks, "sinks", device, (num_q_heads,))
    if sinks.dtype != torch.float32:
        raise BadRequest(f"sinks must be torch.float32, got {sinks.dtype}")
    return sinks


@dataclass(slots=True)
class ValueChecks:
    """Violation flags (True = bad) with their messages, and integer values for the
    host, read back in one transfer by :meth:`run`. A flag is a Python bool (known on
    the host) or a 0-dim or 1-element bool tensor; a fetched value is a list of ints
    or an int tensor. Messages are built only for the first violation (they may read
    tensor values: that costs a second transfer on an error path only).

    ``host``: the checked tensors are CPU tensors, so the checks may read them
    directly (:func:`check_table` and :func:`check_slots` then queue bools and lists);
    the order of the flags, hence the error raised, is the same on both paths."""

    host: bool = False
    flags: list[torch.Tensor | bool] = field(default_factory=list)
    messages: list[Callable[[], str]] = field(default_factory=list)
    fetches: list[torch.Tensor | list[int]] = field(default_factory=list)

    def check(self, bad: torch.Tensor | bool, message: Callable[[], str]) -> None:
        self.flags.append(bad if isinstance(bad, bool) else bad.reshape(1))
        self.messages.append(message)

    def fetch(self, values: torch.Tensor | list[int]) -> int:
        """Queue int values for the host (a CPU tensor is read now: no transfer to
        save); their index in :meth:`run`'s result."""
        if not isinstance(values, list):
            values = values.reshape(-1)
            if values.device.type == "cpu":
                values = values.tolist()
        self.fetches.append(values)
        return len(self.fetches) - 1

    def run(self) -> list[list[int]]:
        """Read everything back at once; BadRequest for the first flag set, else the
        host copies of the fetched values, in the order queued."""
        import torch

        parts = [f.long() for f in self.flags if not isinstance(f, bool)]
        parts += [v.long() for v in self.fetches if not isinstance(v, list)]
        read = iter(torch.cat(parts).tolist() if parts else ())  # the one transfer
        for bad, message in zip(self.flags, self.messages, strict=True):
            if bad if isinstance(bad, bool) else next(read):
                raise BadRequest(message())
        return [v if isinstance(v, list) else list(islice(read, v.numel())) for v in self.fetches]


HOST_LIST_MAX = 4096  # elements: up to this many, host checks read a tensor with one tolist()


def host_bounds(values: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a contiguous CPU integer tensor of rank 1 or 2; (0, -1) when empty.

    Small tensors (<= :data:`HOST_LIST_MAX` elements: a step's tables and slots) are
    read with one ``tolist()`` and Python's min/max, large ones with numpy's
    reductions: between a model's layers every call runs with cold caches and costs
    some microseconds, a numpy reduction as much as a torch op."""
    if values.numel() == 0:
        return 0, -1
    if values.numel() > HOST_LIST_MAX:
        flat = values.numpy()
        return int(flat.min()), int(flat.max())
    host = values.tolist()
    if values.dim() == 1:
        return min(host), max(host)
    return min(map(min, host)), max(map(max, host))


def check_table(
    checks: ValueChecks,
    block_table: object,
    seq_lens: object,
    kv_cache: torch.Tensor,
    batch: int | None,
    window_left: int = -1,
    cu_seqlens_q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_table [B, max_pages] int32 and seq_lens [B] int32; queues their value checks.

    Only the pages a sequence reads (the first ceil(seq_len / page_size) entries of
    its row; with ``window_left`` >= 0 not those before its first query's window,
    floor(max(0, first query position - window_left) / page_size)) must be in
    [0, num_pages); the others are never read. The first query sits at
    seq_len - q_len (prefill: q_len from ``cu_seqlens_q``, shape-checked) or at
    seq_len - 1 (decode: ``cu_seqlens_q`` None). ``batch`` None takes B from the table.
    """
    import torch

    dev = kv_cache.device
    table = check_index(block_table, "block_table", dev, torch.int32, (batch, None))
    lens = check_index(seq_lens, "seq_lens", dev, torch.int32, (table.shape[0],))
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    max_pages = table.shape[1]
    capacity = max_pages * page_size  # tokens a row can hold; int32 lens never exceed 2**31

    def bad_pages() -> torch.Tensor:
        """[B, max_pages] bool: the entries a sequence reads that are not pages."""
        # column j of row b is read iff its first token j * page_size < seq_lens[b]
        first_token = torch.arange(0, capacity, page_size, device=dev)
        read = first_token < lens[:, None]
        if window_left >= 0:  # ... and its last token (j + 1) * page_size - 1 >= window start
            q_lens = (
                1 if cu_seqlens_q is None else cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
            )
            start = (lens.long() - q_lens - window_left).clamp(min=0)
            read &= first_token + page_size > start[:, None]
        return read & ((table < 0) | (table >= num_pages))

    def page_message(bad: torch.Tensor) -> str:
        b, j = (int(x) for x in bad.nonzero()[0])
        n = int(lens[b])
        return (
            f"block_table[{b}, {j}] = {int(table[b, j])} is not a page in [0, {num_pages}) "
            f"(sequence {b} holds {n} tokens = {cdiv(n, page_size)} pages)"
        )

    def short_message() -> str:
        return f"seq_lens must be >= 1, got {lens.tolist()[:16]}"

    def long_message() -> str:
        return (
            f"seq_lens must be <= max_pages * page_size = {capacity} "
            f"(block_table has {max_pages} columns), got max {int(lens.max())}"
        )

    longest = min(capacity, 2**31 - 1)
    if checks.host:  # a table whose every entry is a page needs no mask (engines pad with 0)
        host_lens = lens.tolist()
        checks.check(min(host_lens, default=1) < 1, short_message)
        checks.check(max(host_lens, default=0) > longest, long_message)
        low, high = host_bounds(table)
        if low < 0 or high >= num_pages:
            host_bad = bad_pages()
            checks.check(bool(host_bad.any()), lambda: page_message(host_bad))
        return table, lens
    bad = bad_pages()
    checks.check((lens < 1).any(), short_message)
    checks.check((lens > longest).any(), long_message)
    checks.check(bad.any(), lambda: page_message(bad))
    return table, lens


def check_cu_seqlens(checks: ValueChecks, cu: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Queue the value checks of cu_seqlens_q [B + 1] int32 (already shape-checked): it
    starts at 0, never decreases, and each q_len = cu[b+1] - cu[b] is <= seq_lens[b]."""
    q_lens = cu[1:].long() - cu[:-1].long()
    checks.check(cu[0] != 0, lambda: f"cu_seqlens_q[0] must be 0, got {int(cu[0])}")
    checks.check((q_lens < 0).any(), lambda: f"cu_seqlens_q must not decrease: {cu.tolist()[:16]}")
    checks.check(
        (q_lens > seq_lens.long()).any(),
        lambda: (
            "each q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b] must be <= seq_lens[b]; "
            f"first bad b = {int((q_lens > seq_lens.long()).nonzero()[0, 0])}"
        ),
    )


def check_slots(
    checks: ValueChecks, slots: object, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """slots [T] int64: each < num_pages * page_size; non-negative ones distinct. Returns
    them and the index, in ``checks.run()``'s result, of [1 if some slot is negative
    (skipped) else 0]."""
    import torch

    slots = check_index(slots, "slots", kv_cache.device, torch.int64, (None,))
    n_slots = kv_cache.shape[0] * kv_cache.shape[2]

    def max_message() -> str:
        return f"slots must be < num_pages * page_size = {n_slots}; got {int(slots.max())}"

    def repeat_message() -> str:
        return "slots must not repeat a non-negative slot (the winner would be undefined)"

    if checks.host:
        low, high = host_bounds(slots)
        checks.check(high >= n_slots, max_message)
        if slots.numel() <= HOST_LIST_MAX:
            real = [s for s in slots.tolist() if s >= 0] if low < 0 else slots.tolist()
            repeats = len(set(real)) < len(real)
        else:
            import numpy as np

            values = slots.numpy()
            ordered = np.sort(values if low >= 0 else values[values >= 0])
            repeats = bool((ordered[1:] == ordered[:-1]).any())
        checks.check(repeats, repeat_message)
        return slots, checks.fetch([int(low < 0)])
    # negative slots become distinct negatives, so only repeated real slots collide
    masked = torch.where(slots >= 0, slots, -1 - torch.arange(slots.numel(), device=slots.device))
    ordered_t = masked.sort().values
    checks.check((slots >= n_slots).any(), max_message)
    checks.check((ordered_t[1:] == ordered_t[:-1]).any(), repeat_message)
    return slots, checks.fetch((slots < 0).any())


def check_copies(
    checks: ValueChecks, src: object, dst: object, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """src/dst [N] int64 pages in [0, num_pages); dst distinct and disjoint from src."""
    import torch

    dev = kv_cache.device
    src = check_index(src, "src", dev, torch.int64, (None,))
    dst = check_index(dst, "dst", dev, torch.int64, (src.shape[0],))
    num_pages = kv_cache.shape[0]
    ordered = dst.sort().values
    checks.check(
        ((src < 0) | (src >= num_pages)).any(),
        lambda: f"src pages must lie in [0, {num_pages}): {first_bad(src, num_pages)}",
    )
    checks.check(
        ((dst < 0) | (dst >= num_pages)).any(),
        lambda: f"dst pages must lie in [0, {num_pages}): {first_bad(dst, num_pages)}",
    )
    checks.check((ordered[1:] == ordered[:-1]).any(), lambda: "dst must not repeat a page")
    checks.check(torch.isin(dst, src).any(), lambda: "dst must not name a page that src also names")
    return src, dst


def first_bad(pages: torch.Tensor, num_pages: int) -> str:
    i = int(((pages < 0) | (pages >= num_pages)).nonzero()[0, 0])
    return f"entry {i} is {int(pages[i])}"
