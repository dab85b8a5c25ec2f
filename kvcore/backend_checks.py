"""Boundary checks of the kernel API (kvcore.backend): BadRequest for bad input.

Shape, dtype and device checks read no tensor data. Value checks (lengths, page
indices, slots) are vectorised and their flags are read back in one transfer by
:func:`raise_first`, so a validated call synchronises with the device once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcore.errors import BadRequest

if TYPE_CHECKING:
    import torch


def fmt_shape(pattern: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in pattern) + "]"


def check_tensor(
    t: object, name: str, kv_cache: torch.Tensor, pattern: tuple[int | None, ...]
) -> torch.Tensor:
    import torch

    if not isinstance(t, torch.Tensor):
        raise BadRequest(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(pattern) or any(
        want is not None and got != want for got, want in zip(t.shape, pattern, strict=True)
    ):
        raise BadRequest(f"{name} must have shape {fmt_shape(pattern)}, got {list(t.shape)}")
    if t.device != kv_cache.device:
        raise BadRequest(f"{name} is on {t.device}, kv_cache on {kv_cache.device}")
    return t


def check_cache(kv_cache: object) -> None:
    """kv_cache [num_pages >= 1, 2, page_size >= 1, Hkv >= 1, D >= 1], last dim contiguous."""
    import torch

    if not isinstance(kv_cache, torch.Tensor):
        raise BadRequest(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    shape = tuple(kv_cache.shape)
    if len(shape) != 5 or shape[1] != 2 or min(shape) < 1:
        raise BadRequest(
            f"kv_cache must have shape [num_pages, 2, page_size, num_kv_heads, head_dim] "
            f"with every dim >= 1, got {list(shape)}"
        )
    check_last_dim(kv_cache, "kv_cache")


def check_last_dim(t: torch.Tensor, name: str) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise BadRequest(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def check_float(
    t: object, name: str, kv_cache: torch.Tensor, pattern: tuple[int | None, ...]
) -> None:
    """A query/key/value tensor: shape, the cache's dtype and device, last dim contiguous."""
    t = check_tensor(t, name, kv_cache, pattern)
    if t.dtype != kv_cache.dtype:
        raise BadRequest(f"{name} has dtype {t.dtype}, kv_cache {kv_cache.dtype}: they must match")
    check_last_dim(t, name)


def check_heads(query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    hq, hkv = query.shape[1], kv_cache.shape[3]
    if hq < 1 or hq % hkv != 0:
        raise BadRequest(f"query heads ({hq}) must be a positive multiple of kv heads ({hkv})")


def check_index(
    t: object,
    name: str,
    kv_cache: torch.Tensor,
    dtype: torch.dtype,
    pattern: tuple[int | None, ...],
) -> torch.Tensor:
    """An index tensor: shape, exact integer dtype, device; returned contiguous."""
    t = check_tensor(t, name, kv_cache, pattern)
    if t.dtype != dtype:
        raise BadRequest(f"{name} must be {dtype}, got {t.dtype}")
    return t.contiguous()


def check_scale(scale: object) -> None:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise BadRequest(f"scale must be a finite float, got {scale!r}")


def check_table(
    block_table: object, seq_lens: object, kv_cache: torch.Tensor, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_table [B, max_pages] int32 and seq_lens [B] int32, values checked.

    Only the pages a sequence uses (the first ceil(seq_len / page_size) entries of
    its row) must be in [0, num_pages); the padding after them is never read.
    """
    import torch

    table = check_index(block_table, "block_table", kv_cache, torch.int32, (batch, None))
    lens = check_index(seq_lens, "seq_lens", kv_cache, torch.int32, (batch,))
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    max_pages = table.shape[1]
    lens64 = lens.long()
    used = (lens64 + page_size - 1) // page_size  # pages per sequence
    columns = torch.arange(max_pages, device=table.device)
    read = columns[None, :] < used[:, None]
    bad_page = read & ((table < 0) | (table >= num_pages))

    def page_message() -> str:
        b, j = (int(x) for x in bad_page.nonzero()[0])
        return (
            f"block_table[{b}, {j}] = {int(table[b, j])} is not a page in [0, {num_pages}) "
            f"(sequence {b} holds {int(lens64[b])} tokens = {int(used[b])} pages)"
        )

    raise_first(
        [(lens64 < 1).any(), (lens64 > max_pages * page_size).any(), bad_page.any()],
        [
            lambda: f"seq_lens must be >= 1, got {lens.tolist()[:16]}",
            lambda: (
                f"seq_lens must be <= max_pages * page_size = {max_pages * page_size} "
                f"(block_table has {max_pages} columns), got max {int(lens64.max())}"
            ),
            page_message,
        ],
    )
    return table, lens


def first_bad(pages: torch.Tensor, num_pages: int) -> str:
    i = int(((pages < 0) | (pages >= num_pages)).nonzero()[0, 0])
    return f"entry {i} is {int(pages[i])}"


def raise_first(flags: list[torch.Tensor], messages: list[Callable[[], str]]) -> None:
    """Read all violation flags back in one transfer; raise BadRequest for the first."""
    import torch

    assert len(flags) == len(messages), "one message per flag"
    for bad, message in zip(
        torch.stack([f.reshape(()) for f in flags]).tolist(), messages, strict=True
    ):
        if bad:
            raise BadRequest(message())
