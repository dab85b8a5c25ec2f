"""Pages between vLLM's KV blocks and a kvcore pool: views and the one copy per layer.

Only torch here (no vLLM import), so the copy and the layout check are testable
without vLLM. Shapes use B = vLLM blocks, P = pool pages, N = tokens per block =
tokens per page, H = KV heads, D = head dim.

vLLM (0.32) hands a connector each attention layer's cache as a tensor of
logical shape ``[B, H, N, 2 * D]``; what the last dimension means depends on the
attention backend:

* ``CPU_ATTN`` reads each (block, head) as ``[2, N, D]`` (all K rows, then all
  V rows): :data:`KV_BLOCKS`;
* the GPU backends (FlashAttention, Triton, FlashInfer) split the last
  dimension: ``[..., :D]`` is K, ``[..., D:]`` is V: :data:`KV_LAST`;
* any other backend is refused (:func:`head_layout`), never guessed.

:func:`block_view` turns either into kvcore's page order ``[B, 2, N, H, D]``
(a stride permutation, no copy), so one ``index_select`` and one
``index_copy_`` per layer move any set of pages either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from kvcore.errors import LayoutMismatch
from kvcore.layout import KVLayout

HeadLayout = Literal["kv_blocks", "kv_last"]
KV_BLOCKS: HeadLayout = "kv_blocks"
KV_LAST: HeadLayout = "kv_last"


BACKEND_LAYOUTS: dict[str, HeadLayout] = {
    "CPU_ATTN": KV_BLOCKS,
    "FLASH_ATTN": KV_LAST,
    "TRITON_ATTN": KV_LAST,
    "FLASHINFER": KV_LAST,
}
"""``get_name()`` of each vLLM attention backend whose cache kvcore can read, and how
it reads the last dim (vLLM 0.32 has no API that says so: each one's ``forward``)."""


class AttentionBackend(Protocol):
    """What kvcore uses of a vLLM attention backend class."""

    @staticmethod
    def get_name() -> str: ...


def head_layout(backend: type[AttentionBackend]) -> HeadLayout:
    """How ``backend`` (the class vLLM gives each attention layer) reads the last dim
    of its per-layer cache. LayoutMismatch naming the backend if kvcore does not
    know it: a wrong guess would load K/V into the wrong rows."""
    name = backend.get_name()
    if name not in BACKEND_LAYOUTS:
        raise LayoutMismatch(
            f"kvcore does not know the KV cache layout of vLLM's attention backend {name!r} "
            f"({backend.__module__}.{backend.__qualname__}); known: "
            f"{', '.join(sorted(BACKEND_LAYOUTS))} (pick one with vLLM's attention_backend)"
        )
    return BACKEND_LAYOUTS[name]


def block_view(cache: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    """vLLM's per-layer cache ``[B, H, N, 2*D]`` as ``[B, 2, N, H, D]`` (same storage).
    LayoutMismatch if the strides do not allow it (``kv_blocks`` reads each (block,
    head) as one run of ``[N, 2*D]``; ``kv_last`` needs a contiguous last dim)."""
    blocks, heads, tokens, width = cache.shape
    dim = width // 2
    runs = cache.stride(3) == 1 and (layout == KV_LAST or cache.stride(2) == width)
    if not runs:
        raise LayoutMismatch(
            f"vLLM's KV cache strides {tuple(cache.stride())} (shape {tuple(cache.shape)}) "
            f"do not fit the {layout} layout kvcore copies pages in"
        )
    if layout == KV_BLOCKS:
        return cache.view(blocks, heads, 2, tokens, dim).permute(0, 2, 3, 1, 4)
    return cache.view(blocks, heads, tokens, 2, dim).permute(0, 3, 2, 1, 4)


def copy_pages(
    src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor
) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]`` for every i: one gather, one scatter.

    ``src`` ``[S, 2, N, H, D]`` and ``dst`` ``[T, 2, N, H, D]``: pages or blocks of one
    layer, any strides (views from :func:`block_view` or a pool's layer tensor),
    same dtype; they may live on different devices (the gathered pages move once).
    ``src_index`` and ``dst_index``: int64 ``[n]`` on ``src``'s / ``dst``'s device;
    ``dst_index`` has no repeats. Synchronous on the CPU; on a GPU the caller
    synchronises before it publishes ``dst`` (commit after write).
    """
    gathered = src.index_select(0, src_index)
    if gathered.device != dst.device:
        gathered = gathered.to(dst.device)
    dst.index_copy_(0, dst_index, gathered)


@dataclass(frozen=True, slots=True)
class VllmGeometry:
    """What vLLM's registered caches say about the model: counts in layers, heads,
    elements; ``block_size`` in tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def of(cls, caches: list[torch.Tensor]) -> VllmGeometry:
        """From vLLM's per-layer caches ``[B, H, N, 2*D]`` (all layers alike)."""
        first = caches[0]
        _, heads, tokens, width = first.shape
        return cls(len(caches), heads, width // 2, tokens, str(first.dtype).removeprefix("torch."))


def check_layout(pool: KVLayout, model: VllmGeometry, pool_name: str) -> None:
    """LayoutMismatch naming every field that differs and the ``--pool`` flag that fits."""
    wanted = {
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "page_size": model.block_size,
        "dtype": model.dtype,
    }
    have = pool.to_dict()
    wrong = [f"{k}: pool {have[k]}, vLLM {v}" for k, v in wanted.items() if have[k] != v]
    if wrong:
        flag = ",".join(f"{k}={v}" for k, v in wanted.items())
        raise LayoutMismatch(
            f"kvcore pool {pool_name!r} does not fit vLLM's KV cache ({'; '.join(wrong)}; "
            f"page_size is vLLM's block_size); start the daemon with "
            f"`kvcore serve --pool name={pool_name},{flag},num_pages=<pages>`"
        )
