"""Pages between vLLM's KV blocks and a kvcore pool: views and the one copy per layer.

Only torch here (no vLLM import), so the copy and the layout check are testable
without vLLM. Shapes use B = vLLM blocks, P = pool pages, N = tokens per block =
tokens per page, H = KV heads, D = head dim (elements; bytes for fp8).

vLLM (0.32) hands a connector each attention layer's cache as a tensor of
logical shape ``[B, H, N, C]``; what the last dimension means depends on the
attention backend:

* ``CPU_ATTN`` reads each (block, head) as ``[2, N, D]`` (all K rows, then all
  V rows; inside the K half the kernel packs its own order, which a page copy
  keeps byte for byte): :data:`KV_BLOCKS`;
* the GPU backends (FlashAttention, Triton, FlashInfer) split the last
  dimension: ``[..., :D]`` is K, ``[..., D:]`` is V: :data:`KV_LAST`;
* the MLA backends (``CPU_MLA``, ``AMX_MLA`` and the GPU ones named in
  :data:`BACKEND_LAYOUTS`) cache one latent vector per token: ``H`` = 1 and
  ``C`` = ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek), no V half:
  :data:`LATENT`, a pool of ``kind=latent``;
* any other backend is refused (:func:`head_layout`), never guessed.

:func:`block_view` turns each into kvcore's page order ``[B, parts, N, H, D]``
(a stride permutation, no copy), so one ``index_select`` and one
``index_copy_`` per layer move any set of pages either way; on the CPU,
:class:`PageCopy` moves runs of adjacent pages with one slice copy each instead
(torch's CPU ``index_copy_`` is far slower than a memcpy).

fp8: vLLM keeps an fp8 cache as ``uint8`` whatever the format; the format is
its ``kv_cache_dtype`` (:data:`FP8_CACHE_DTYPES`), the pool's dtype the matching
``float8_*``. The bytes are copied as they are (both sides viewed as uint8):
the per-layer k/v scales that decode them are part of the model's identity
(kvcore/integrations/identity.py), never of the page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from kvcore.errors import LayoutMismatch
from kvcore.layout import DTYPE_SIZES, KVLayout

HeadLayout = Literal["kv_blocks", "kv_last", "latent"]
KV_BLOCKS: HeadLayout = "kv_blocks"
KV_LAST: HeadLayout = "kv_last"
LATENT: HeadLayout = "latent"

BACKEND_LAYOUTS: dict[str, HeadLayout] = {
    "CPU_ATTN": KV_BLOCKS,
    "FLASH_ATTN": KV_LAST,
    "TRITON_ATTN": KV_LAST,
    "FLASHINFER": KV_LAST,
    # MLA: MLAAttentionSpec (one head, head_size_v 0) through vLLM's generic allocator;
    # none of these overrides customize_spec or the cache layouts it takes
    "CPU_MLA": LATENT,
    "AMX_MLA": LATENT,
    "TRITON_MLA": LATENT,
    "FLASHMLA": LATENT,
    "CUTLASS_MLA": LATENT,
    "FLASHINFER_MLA": LATENT,
    "FLASH_ATTN_MLA": LATENT,
}
"""``get_name()`` of each vLLM attention backend whose cache kvcore can read, and how
it reads the last dim (vLLM 0.32 has no API that says so: each one's ``forward``)."""

FP8_CACHE_DTYPES: dict[str, str] = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
"""vLLM's fp8 ``kv_cache_dtype`` values and the format of the bytes it stores. "fp8" is
e4m3 (OCP, ``float8_e4m3fn``) on CUDA and on the CPU backend (checked against the
bytes vLLM's CPU kernel writes: tests/test_vllm_pages.py). A platform whose fp8 is
"fnuz" (ROCm MI300: no pool dtype, and vLLM doubles its scales) is refused
(:func:`pool_dtype`)."""


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


def pool_dtype(cache_dtype: str, tensor_dtype: torch.dtype, *, fp8_fnuz: bool = False) -> str:
    """The pool dtype that holds vLLM's cache bytes: the ``float8_*`` format of an fp8
    ``cache_dtype`` (vLLM's ``cache_config.cache_dtype``), else the cache tensor's own
    dtype. LayoutMismatch for a cache no pool dtype holds (fp8 on a platform whose fp8
    is fnuz: ``fp8_fnuz``; packed or 4-bit formats such as ``fp8_per_token_head``)."""
    if cache_dtype in FP8_CACHE_DTYPES and not fp8_fnuz:
        return FP8_CACHE_DTYPES[cache_dtype]
    name = str(tensor_dtype).removeprefix("torch.")
    if cache_dtype in FP8_CACHE_DTYPES or name not in DTYPE_SIZES:
        fnuz = " (fnuz fp8 on this platform)" if fp8_fnuz else ""
        raise LayoutMismatch(
            f"kvcore pools hold no vLLM KV cache of kv_cache_dtype {cache_dtype!r}{fnuz} "
            f"(stored as {name}); supported: auto, float16, bfloat16, "
            f"{', '.join(FP8_CACHE_DTYPES)}"
        )
    return name


def block_view(cache: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    """vLLM's per-layer cache ``[B, H, N, C]`` as ``[B, parts, N, H, D]`` (same storage;
    an fp8 cache stays uint8): ``[B, 2, N, H, C/2]`` for K and V, ``[B, 1, N, 1, C]``
    for a latent cache. LayoutMismatch if the strides do not allow it (``kv_blocks``
    reads each (block, head) as one run of ``[N, C]``; ``kv_last`` and ``latent``
    need a contiguous last dim)."""
    blocks, heads, tokens, width = cache.shape
    runs = cache.stride(3) == 1 and (layout != KV_BLOCKS or cache.stride(2) == width)
    if not runs or (layout == LATENT and heads != 1):
        raise LayoutMismatch(
            f"vLLM's KV cache strides {tuple(cache.stride())} (shape {tuple(cache.shape)}) "
            f"do not fit the {layout} layout kvcore copies pages in"
        )
    if layout == LATENT:
        return cache.unsqueeze(3)  # its one head is the one part; the pool's head is 1
    dim = width // 2
    if layout == KV_BLOCKS:
        return cache.view(blocks, heads, 2, tokens, dim).permute(0, 2, 3, 1, 4)
    return cache.view(blocks, heads, tokens, 2, dim).permute(0, 3, 2, 1, 4)


def copy_pages(
    src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor
) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]`` for every i: one gather, one scatter.

    ``src`` ``[S, parts, N, H, D]`` and ``dst`` ``[T, parts, N, H, D]``: pages or
    blocks of one layer, any strides (views from :func:`block_view` or a pool's
    layer tensor), of one element size; 1-byte elements (fp8 pools, vLLM's uint8
    fp8 caches) are copied as uint8, byte for byte (torch's CPU float8 kernels are
    partial). They may live on different devices (the gathered pages move once).
    ``src_index`` and ``dst_index``: int64 ``[n]`` on ``src``'s / ``dst``'s device;
    ``dst_index`` has no repeats. Synchronous on the CPU; on a GPU the caller
    synchronises before it publishes ``dst`` (commit after write).
    """
    if src.element_size() == 1:
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    gathered = src.index_select(0, src_index)
    if gathered.device != dst.device:
        gathered = gathered.to(dst.device)
    dst.index_copy_(0, dst_index, gathered)


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, count)`` of each maximal run in which ``src[i]`` and
    ``dst[i]`` both go up by one: the pairs ``src[i] -> dst[i]`` as few slices."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@dataclass(frozen=True, slots=True)
class PageCopy:
    """One step's copies of one KV cache group, planned once and run on every layer:
    page ``src[i]`` of the source -> page ``dst[i]`` of the destination (``[*, parts,
    N, H, D]`` tensors as :func:`copy_pages` takes them; ``dst`` without repeats).

    Between two CPU tensors, one strided ``copy_`` per run of :func:`page_runs`
    (``runs``): torch's CPU ``index_copy_`` moves pages at about a tenth of a memcpy's
    bytes per second (it indexes element by element), a slice ``copy_`` at about a
    memcpy's, and a sequence's pages and a fresh request's blocks mostly come in runs;
    a page with no neighbour costs one ``copy_`` of its own (a few microseconds).
    Anywhere else (a GPU, or across devices): one gather and one scatter per layer
    (:func:`copy_pages`; ``src_index`` / ``dst_index`` on their tensors' devices).
    ``pages``: how many pages each layer copies."""

    pages: int
    runs: tuple[tuple[int, int, int], ...] = ()
    src_index: torch.Tensor | None = None
    dst_index: torch.Tensor | None = None

    @classmethod
    def plan(
        cls,
        src: Sequence[int],
        dst: Sequence[int],
        src_device: torch.device,
        dst_device: torch.device,
    ) -> PageCopy:
        if src_device.type == "cpu" and dst_device.type == "cpu":
            return cls(len(src), tuple(page_runs(src, dst)))
        return cls(
            len(src),
            src_index=torch.tensor(src, dtype=torch.int64, device=src_device),
            dst_index=torch.tensor(dst, dtype=torch.int64, device=dst_device),
        )

    def run(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy this plan's pages of one layer (bytes as they are: 1-byte elements as
        uint8, as :func:`copy_pages`). Synchronous on the CPU."""
        if self.src_index is not None:
            assert self.dst_index is not None
            copy_pages(src, self.src_index, dst, self.dst_index)
            return
        if src.element_size() == 1:
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)
        for s, d, n in self.runs:
            dst[d : d + n].copy_(src[s : s + n])


@dataclass(frozen=True, slots=True)
class VllmGeometry:
    """What vLLM's registered caches say about the model: counts in layers, heads,
    elements; ``block_size`` in tokens; ``dtype`` the pool dtype of the bytes
    (:func:`pool_dtype`); ``kind`` "kv" or "latent" (KVLayout's)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kind: str = "kv"

    @classmethod
    def of(
        cls,
        caches: list[torch.Tensor],
        layout: HeadLayout = KV_BLOCKS,
        cache_dtype: str = "auto",
        *,
        fp8_fnuz: bool = False,
    ) -> VllmGeometry:
        """From vLLM's per-layer caches ``[B, H, N, C]`` read in ``layout``, of vLLM's
        ``kv_cache_dtype`` ``cache_dtype`` (:func:`pool_dtype`). LayoutMismatch unless
        every layer has the first one's shape and dtype (one pool has one geometry:
        vLLM's ``kv_cache_dtype_skip_layers`` mixes dtypes)."""
        first = caches[0]
        dtype = pool_dtype(cache_dtype, first.dtype, fp8_fnuz=fp8_fnuz)
        for i, cache in enumerate(caches):
            if cache.shape[1:] != first.shape[1:] or cache.dtype != first.dtype:
                raise LayoutMismatch(
                    f"vLLM's KV cache of layer {i} ({cache.dtype}, {tuple(cache.shape)}) is "
                    f"not that of layer 0 ({first.dtype}, {tuple(first.shape)}): one "
                    f"kvcore pool holds layers of one shape and dtype"
                )
        _, heads, tokens, width = first.shape
        if layout == LATENT:
            return cls(len(caches), heads, width, tokens, dtype, "latent")
        return cls(len(caches), heads, width // 2, tokens, dtype, "kv")


def check_layout(
    pool: KVLayout,
    model: VllmGeometry,
    pool_name: str,
    order: str | None = None,
    shards: int = 1,
) -> None:
    """LayoutMismatch naming every field that differs and the ``--pool`` flag that fits,
    with ``order`` (the order matching vLLM's blocks, :mod:`.orders`) where one does and
    ``shards`` (pipeline stages) where over 1. ``model``: the geometry of a pool page,
    every KV head of the model (:mod:`.ranks`: each tensor-parallel rank copies its
    own). A pool of another order fits: its pages copy strided, never wrongly."""
    wanted = {
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "page_size": model.block_size,
        "dtype": model.dtype,
        "kind": model.kind,
    }
    have = pool.to_dict()
    wrong = [f"{k}: pool {have[k]}, vLLM {v}" for k, v in wanted.items() if have[k] != v]
    if wrong:
        extra = {"order": order, "shards": shards if shards > 1 else None}
        flag = ",".join(f"{k}={v}" for k, v in {**wanted, **extra}.items() if v)
        raise LayoutMismatch(
            f"kvcore pool {pool_name!r} does not fit vLLM's KV cache ({'; '.join(wrong)}; "
            f"page_size is vLLM's block_size, num_kv_heads every KV head of the model "
            f"whatever the tensor-parallel size); start the daemon with "
            f"`kvcore serve --pool name={pool_name},{flag},num_pages=<pages>`"
        )
