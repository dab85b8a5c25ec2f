"""KVLayout: the shape of one KV page pool.

One pool is one allocation holding every layer. Its five outer axes are layer
``L``, page ``P``, part ``K``, token ``T`` and head ``H``; the element dim ``D``
(``head_dim``) is always innermost. ``order`` names their physical order,
outermost first, as vLLM's KVCacheLayout names a cache's stride permutation::

    "LPKTH" (layer-major, the identity): [num_layers][num_pages][parts][page_size][heads][D]
    "PLKTH" (page-major): one page's bytes, all layers, are one run
    "LPHKT" / "PLHKT" (head-outer): a page's block per layer is [heads][parts][tokens][D],
                vLLM's CPU attention block; a tensor-parallel rank's head range is a run
    "PLHKT" (page-major head-outer) is the default: docs/architecture.md says why

Whatever the order, one layer view is the logical ``[num_pages, parts, page_size,
num_kv_heads, head_dim]`` with the order's strides (zero-copy), and a page's stored
bytes (what tiers and stores keep) are its elements in the pool's order with the
page axis dropped: :attr:`KVLayout.stored_page_shape`.

A page's ``kind`` says what ``parts`` holds:

* ``"kv"`` (parts = 2): K and V side by side (index 0 is K, 1 is V), the last dim
  contiguous; FlashInfer's NHD paged layout and vLLM's Triton layout;
* ``"latent"`` (parts = 1, ``num_kv_heads`` = 1): MLA's one cached vector per token,
  ``head_dim`` = ``kv_lora_rank + qk_rope_head_dim`` elements (DeepSeek: 512 + 64),
  no V half.

Dtypes are the 2- and 4-byte floats and the 1-byte ``float8_e4m3fn`` /
``float8_e5m2``. An fp8 page holds the engine's quantized bytes as they are: the
scales that turn them into K/V belong to the model part of the key space
(kvcore/integrations/identity.py), never to the page.
Page ``p`` means the same page index in every layer. A slot is
``page * page_size + offset`` (tokens); page ids and page counts are in pages,
``page_size`` in tokens, byte counts in bytes.

This module imports no torch: :meth:`KVLayout.layer_views` imports it on call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcore.errors import BadRequest

if TYPE_CHECKING:
    import torch

DTYPE_SIZES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
KINDS: dict[str, int] = {"kv": 2, "latent": 1}
"""Page kinds and the parts each holds per token and head (K and V; one latent vector)."""
MAX_PAGES = 1 << 31  # page ids are int32 in block tables
AXES = "LPKTH"
"""The logical outer axes: layer, page, part, token, head (the element dim follows)."""
DEFAULT_ORDER = "PLHKT"
"""A new pool's order: page-major (a tier moves a page in one copy) and head-outer
(vLLM's CPU block, and one run per page and layer for a tensor-parallel rank's
heads); docs/architecture.md, "Which order a new pool gets"."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, exactly (no float): ``a`` >= 0, ``b`` >= 1, same unit.

    Pages for tokens (``cdiv(tokens, page_size)``), blocks or splits for tokens,
    CTAs for threads: every count of whole units that must cover ``a``.
    """
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of one pool. Immutable; validated on construction (BadRequest)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    dtype: str  # one of DTYPE_SIZES
    num_pages: int
    kind: str = "kv"  # one of KINDS
    order: str = DEFAULT_ORDER  # a permutation of AXES, outermost first

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadRequest(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.num_pages > MAX_PAGES:
            raise BadRequest(f"KVLayout.num_pages must be <= {MAX_PAGES}, got {self.num_pages}")
        if self.dtype not in DTYPE_SIZES:
            raise BadRequest(
                f"KVLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}"
            )
        if self.kind not in KINDS:
            raise BadRequest(f"KVLayout.kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if not isinstance(self.order, str) or sorted(self.order) != sorted(AXES):
            raise BadRequest(
                f"KVLayout.order is a permutation of {AXES!r} (layer, page, part, token, "
                f"head; outermost first), got {self.order!r}"
            )
        if self.kind == "latent" and self.num_kv_heads != 1:
            raise BadRequest(
                "a latent (MLA) layout has num_kv_heads=1 and head_dim = kv_lora_rank + "
                f"qk_rope_head_dim, got num_kv_heads={self.num_kv_heads}"
            )

    @property
    def dtype_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def parts(self) -> int:
        """Vectors per token and head: 2 (K and V) or 1 (a latent vector)."""
        return KINDS[self.kind]

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """Shape of one page in one layer: [parts, page_size, num_kv_heads, head_dim]."""
        return (self.parts, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one layer's cache: [num_pages, parts, page_size, num_kv_heads, head_dim]."""
        return (self.num_pages, *self.page_shape)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Each axis of :data:`AXES` and its length."""
        return {
            "L": self.num_layers,
            "P": self.num_pages,
            "K": self.parts,
            "T": self.page_size,
            "H": self.num_kv_heads,
        }

    @property
    def physical_shape(self) -> tuple[int, ...]:
        """The pool as a dense array in its order: the five axes, then head_dim."""
        sizes = self.axis_sizes
        return (*(sizes[a] for a in self.order), self.head_dim)

    @property
    def stored_page_shape(self) -> tuple[int, ...]:
        """One page's elements in the pool's order, page axis dropped: the shape of a
        page in a tier or store entry (``[num_layers, *page_shape]`` when layer-major)."""
        sizes = self.axis_sizes
        return (*(sizes[a] for a in self.order if a != "P"), self.head_dim)

    @property
    def page_major(self) -> bool:
        """True if each page's bytes, all layers, are one contiguous run."""
        return self.order[0] == "P"

    @property
    def strides(self) -> dict[str, int]:
        """Element stride of each axis of :data:`AXES` and of ``"D"`` (1)."""
        sizes = self.axis_sizes
        out = {"D": 1}
        step = self.head_dim
        for axis in reversed(self.order):
            out[axis] = step
            step *= sizes[axis]
        return out

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers (the unit a byte budget buys)."""
        return self.num_layers * self.page_bytes_per_layer

    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes of one page in one layer."""
        return self.parts * self.page_size * self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's cache."""
        return self.num_pages * self.page_bytes_per_layer

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool (all layers, all pages)."""
        return self.num_layers * self.layer_bytes

    @property
    def token_capacity(self) -> int:
        """Tokens the pool holds when every page is full."""
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
        return cdiv(num_tokens, self.page_size)

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: str,
        kind: str = "kv",
        order: str = DEFAULT_ORDER,
    ) -> KVLayout:
        """The largest pool that fits ``budget_bytes``; BadRequest if not even one page fits."""
        probe = cls(num_layers, num_kv_heads, head_dim, page_size, dtype, 1, kind, order)
        num_pages = min(budget_bytes // probe.page_bytes, MAX_PAGES)
        if num_pages < 1:
            raise BadRequest(
                f"a budget of {budget_bytes} bytes holds no page of {probe.page_bytes} bytes"
            )
        return cls(num_layers, num_kv_heads, head_dim, page_size, dtype, num_pages, kind, order)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "dtype": self.dtype,
            "num_pages": self.num_pages,
            "kind": self.kind,
            "order": self.order,
        }

    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def layer_views(self, pool: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer views of a pool tensor, zero-copy.

        ``pool`` is any tensor over the pool's bytes: a flat uint8 tensor of
        ``total_bytes`` bytes, or a tensor of this layout's dtype with
        ``total_bytes / dtype_size`` elements. Each view has :attr:`layer_shape`
        and the strides of :attr:`order` (contiguous only when layer-major).
        """
        logical = self._physical(pool).permute(*(self.order.index(a) for a in AXES), 5)
        return list(logical.unbind(0))

    def pages_view(self, pool: torch.Tensor) -> torch.Tensor:
        """The pool as ``[num_pages, *stored_page_shape]``, zero-copy: row p is page p's
        elements in the pool's order. Gathering rows moves one run per page when
        :attr:`page_major`, one per layer and page when layer-major."""
        return self._physical(pool).movedim(self.order.index("P"), 0)

    def _physical(self, pool: torch.Tensor) -> torch.Tensor:
        import torch

        if not pool.is_contiguous():  # a reshape would copy: views of a copy write nothing
            raise BadRequest(f"a pool tensor must be contiguous, got strides {pool.stride()}")
        flat = pool.view(-1)
        if flat.dtype == torch.uint8:
            flat = flat.view(self.torch_dtype())
        if flat.dtype != self.torch_dtype() or flat.numel() * self.dtype_size != self.total_bytes:
            raise BadRequest(
                f"pool tensor ({flat.dtype}, {flat.numel()} elements) does not match {self}"
            )
        return flat.view(self.physical_shape)
