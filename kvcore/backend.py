"""The kernel API every backend plugin implements, and the registry.

All operations work on one layer's cache tensor::

    kv_cache  [num_pages, 2, page_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)

Kernels take strides: nothing beyond a contiguous last dim is assumed.
Page tables are int32 (``block_table [B, max_pages]``); slots are int64,
``slot = page * page_size + offset`` (tokens), and a negative slot is skipped.
Offsets inside kernels are computed in int64.

A backend subclasses :class:`Backend` and implements the ``_``-prefixed
methods. The public methods validate at the boundary (shapes, dtypes, devices,
int32 tables, page indices in range, the backend's declared capabilities) and
raise :class:`~kvcore.errors.BadRequest` or :class:`~kvcore.errors.Unsupported`;
an out-of-range page index never reaches a kernel.

Backends are found through the entry-point group ``kvcore.backends``
(``name = "module:Class"``); :func:`get` instantiates one by name.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from kvcore.errors import Unsupported

if TYPE_CHECKING:
    import torch

ENTRY_POINT_GROUP = "kvcore.backends"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend computes correctly; anything else raises Unsupported.

    ``head_dims`` / ``page_sizes`` of None mean "any" (within 1..256 and 1..128).
    """

    devices: frozenset[str]  # device types: "cpu", "cuda"
    dtypes: frozenset[str]  # "float16", "bfloat16", "float32"
    head_dims: frozenset[int] | None = None
    page_sizes: frozenset[int] | None = None

    def supports(self, device: str, dtype: str, head_dim: int, page_size: int) -> bool:
        return (
            device in self.devices
            and dtype in self.dtypes
            and (self.head_dims is None or head_dim in self.head_dims)
            and (self.page_sizes is None or page_size in self.page_sizes)
        )


class Backend(abc.ABC):
    """Paged-attention kernels over one layer's cache. Subclass per backend."""

    name: str
    capabilities: Capabilities

    # -- what a backend implements: inputs arrive validated -------------------------
    # (public wrappers with the boundary checks follow below)

    @abc.abstractmethod
    def _write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Scatter ``key``/``value`` [T, Hkv, D] into ``slots`` [T] int64; slot < 0 skipped."""

    @abc.abstractmethod
    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query token per sequence: query [B, Hq, D] -> out [B, Hq, D].

        Sequence b attends its ``seq_lens[b]`` tokens, held in pages
        ``block_table[b, :ceil(seq_lens[b] / page_size)]``.
        """

    @abc.abstractmethod
    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Varlen causal attention: query [total_q, Hq, D] -> out [total_q, Hq, D].

        The queries of sequence b are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
        and are its *last* q_len tokens (bottom-right aligned): query i of b
        attends tokens ``0 .. seq_lens[b] - q_len + i``.
        """

    @abc.abstractmethod
    def _copy_pages(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy page ``src[i]`` to page ``dst[i]`` (K and V), for copy-on-write."""

    def check_supported(self, kv_cache: torch.Tensor) -> None:
        """Unsupported unless the capabilities cover this cache's device, dtype and shape."""
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        page_size, head_dim = kv_cache.shape[2], kv_cache.shape[4]
        if not self.capabilities.supports(kv_cache.device.type, dtype, head_dim, page_size):
            raise Unsupported(
                f"backend {self.name!r} does not support device={kv_cache.device.type} "
                f"dtype={dtype} head_dim={head_dim} page_size={page_size}"
            )


def available() -> list[str]:
    """Names of the installed backends (entry points), whether or not they can load here."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def get(name: str) -> Backend:
    """Instantiate the backend registered under ``name``; Unsupported if absent or if its
    libraries are missing on this machine."""
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        raise Unsupported(f"no backend {name!r}; installed: {available()}")
    try:
        cls = matches[0].load()
    except ImportError as exc:
        raise Unsupported(f"backend {name!r} cannot load here: {exc}") from exc
    backend = cls()
    if not isinstance(backend, Backend):
        raise Unsupported(f"entry point {name!r} does not give a kvcore.backend.Backend")
    return backend
