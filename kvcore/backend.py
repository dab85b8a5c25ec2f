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
an out-of-range page index never reaches a kernel. The value checks (lengths,
page indices, slots) are a handful of vectorised tensor ops whose flags are read
back at once, so every public call synchronises with the device; a caller that
needs a sync-free path (CUDA graphs) validates once and calls the ``_`` methods.
Empty inputs (B = 0, total_q = 0, T = 0, N = 0) return without calling a kernel.

Backends are found through the entry-point group ``kvcore.backends``
(``name = "module:Class"``); :func:`get` instantiates one by name.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from kvcore.backend_checks import (
    check_cache,
    check_float,
    check_heads,
    check_index,
    check_scale,
    check_table,
    first_bad,
    raise_first,
)
from kvcore.errors import BadRequest, Unsupported

if TYPE_CHECKING:
    import torch

ENTRY_POINT_GROUP = "kvcore.backends"
MAX_HEAD_DIM = 256  # elements; the bound of Capabilities.head_dims = None
MAX_PAGE_SIZE = 128  # tokens; the bound of Capabilities.page_sizes = None


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend computes correctly; anything else raises Unsupported.

    ``head_dims`` / ``page_sizes`` of None mean "any" within 1..MAX_HEAD_DIM and
    1..MAX_PAGE_SIZE (elements and tokens). Frozen: a backend declares it once.
    """

    devices: frozenset[str]  # device types: "cpu", "cuda"
    dtypes: frozenset[str]  # "float16", "bfloat16", "float32"
    head_dims: frozenset[int] | None = None
    page_sizes: frozenset[int] | None = None

    def supports(self, device: str, dtype: str, head_dim: int, page_size: int) -> bool:
        return (
            device in self.devices
            and dtype in self.dtypes
            and self.supports_head_dim(head_dim)
            and self.supports_page_size(page_size)
        )

    def supports_head_dim(self, head_dim: int) -> bool:
        """Whether ``head_dim`` (elements) is declared."""
        if self.head_dims is None:
            return 1 <= head_dim <= MAX_HEAD_DIM
        return head_dim in self.head_dims

    def supports_page_size(self, page_size: int) -> bool:
        """Whether ``page_size`` (tokens per page) is declared."""
        if self.page_sizes is None:
            return 1 <= page_size <= MAX_PAGE_SIZE
        return page_size in self.page_sizes


class Backend(abc.ABC):
    """Paged-attention kernels over one layer's cache. Subclass per backend."""

    name: str
    capabilities: Capabilities

    # -- what a backend implements: inputs arrive validated -------------------------
    # (the public wrappers with the boundary checks follow below)

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

    # -- the public, validated operations -------------------------------------------
    # Each checks its inputs (one host<->device synchronisation: the value checks are
    # gathered into one flag vector read back once), then check_supported, then calls
    # the backend's ``_`` method. Index tensors (slots, tables, lengths, src/dst)
    # reach the ``_`` methods contiguous; float tensors keep their strides.

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Scatter ``key``/``value`` [T, Hkv, D] (cache dtype) into ``slots`` [T] int64.

        ``slot = page * page_size + offset`` (tokens); a negative slot is skipped.
        Non-negative slots must be < num_pages * page_size and distinct.
        Synchronises with the device (validation reads flags back).
        """
        import torch

        check_cache(kv_cache)
        _, _, page_size, hkv, d = kv_cache.shape
        check_float(key, "key", kv_cache, (None, hkv, d))
        check_float(value, "value", kv_cache, tuple(key.shape))
        slots = check_index(slots, "slots", kv_cache, torch.int64, (key.shape[0],))
        n_slots = kv_cache.shape[0] * page_size
        masked = torch.where(
            slots >= 0, slots, -1 - torch.arange(slots.numel(), device=slots.device)
        )
        ordered = masked.sort().values
        raise_first(
            [
                (slots >= n_slots).any(),
                (ordered[1:] == ordered[:-1]).any(),
            ],
            [
                lambda: (
                    f"slots must be < num_pages * page_size = {n_slots}; got {int(slots.max())}"
                ),
                lambda: "slots must not repeat a non-negative slot (the winner would be undefined)",
            ],
        )
        self.check_supported(kv_cache)
        if slots.numel() > 0:
            self._write_kv(kv_cache, key, value, slots)

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query token per sequence: query [B, Hq, D] -> out [B, Hq, D] (query dtype).

        ``block_table`` [B, max_pages] int32, ``seq_lens`` [B] int32 (tokens, >= 1,
        <= max_pages * page_size); only the first ceil(seq_lens[b] / page_size)
        entries of row b are read and must lie in [0, num_pages); padding may hold
        anything. ``scale`` multiplies q.k before the softmax. Hq must be a multiple
        of Hkv. Synchronises with the device.
        """
        import torch

        check_cache(kv_cache)
        check_float(query, "query", kv_cache, (None, None, kv_cache.shape[4]))
        check_heads(query, kv_cache)
        batch = query.shape[0]
        block_table, seq_lens = check_table(block_table, seq_lens, kv_cache, batch)
        check_scale(scale)
        self.check_supported(kv_cache)
        if batch == 0:
            return torch.empty_like(query)
        return self._decode(query, kv_cache, block_table, seq_lens, float(scale))

    def prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Varlen causal attention: query [total_q, Hq, D] -> out [total_q, Hq, D].

        ``cu_seqlens_q`` [B+1] int32 starts at 0, never decreases and ends at
        total_q; q_len[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b] must be
        <= seq_lens[b]. The q_len queries of b are its *last* q_len tokens (their
        K/V must already be written): query i of b attends tokens
        ``0 .. seq_lens[b] - q_len[b] + i`` (bottom-right aligned causal mask).
        Table rules as in :meth:`decode`. Synchronises with the device.
        """
        import torch

        check_cache(kv_cache)
        check_float(query, "query", kv_cache, (None, None, kv_cache.shape[4]))
        check_heads(query, kv_cache)
        total_q = query.shape[0]
        cu = check_index(cu_seqlens_q, "cu_seqlens_q", kv_cache, torch.int32, (None,))
        if cu.shape[0] < 1:
            raise BadRequest("cu_seqlens_q must hold B + 1 >= 1 entries")
        batch = cu.shape[0] - 1
        block_table, seq_lens = check_table(block_table, seq_lens, kv_cache, batch)
        check_scale(scale)
        q_lens = cu[1:].long() - cu[:-1].long()
        raise_first(
            [
                cu[0] != 0,
                cu[-1] != total_q,
                (q_lens < 0).any(),
                (q_lens > seq_lens.long()).any(),
            ],
            [
                lambda: f"cu_seqlens_q[0] must be 0, got {int(cu[0])}",
                lambda: f"cu_seqlens_q[-1] must equal total_q = {total_q}, got {int(cu[-1])}",
                lambda: f"cu_seqlens_q must not decrease: {cu.tolist()[:16]}",
                lambda: (
                    "each q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b] must be <= seq_lens[b]; "
                    f"first bad b = {int((q_lens > seq_lens.long()).nonzero()[0, 0])}"
                ),
            ],
        )
        self.check_supported(kv_cache)
        if total_q == 0:
            return torch.empty_like(query)
        return self._prefill(query, kv_cache, block_table, cu, seq_lens, float(scale))

    def copy_pages(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy page ``src[i]`` to page ``dst[i]`` (K and V), for copy-on-write.

        ``src``/``dst`` [N] int64 page indices in [0, num_pages); ``dst`` holds no
        duplicate and no page of ``src`` (so the copies are independent and may run
        in any order). Synchronises with the device.
        """
        import torch

        check_cache(kv_cache)
        src = check_index(src, "src", kv_cache, torch.int64, (None,))
        dst = check_index(dst, "dst", kv_cache, torch.int64, (src.shape[0],))
        num_pages = kv_cache.shape[0]
        ordered = dst.sort().values
        raise_first(
            [
                ((src < 0) | (src >= num_pages)).any(),
                ((dst < 0) | (dst >= num_pages)).any(),
                (ordered[1:] == ordered[:-1]).any(),
                torch.isin(dst, src).any(),
            ],
            [
                lambda: f"src pages must lie in [0, {num_pages}): {first_bad(src, num_pages)}",
                lambda: f"dst pages must lie in [0, {num_pages}): {first_bad(dst, num_pages)}",
                lambda: "dst must not repeat a page",
                lambda: "dst must not name a page that src also names",
            ],
        )
        self.check_supported(kv_cache)
        if src.numel() > 0:
            self._copy_pages(kv_cache, src, dst)

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
