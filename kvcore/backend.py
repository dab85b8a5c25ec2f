"""The kernel contract every backend plugin implements, and the registry.

All operations work on one layer's cache tensor::

    kv_cache  [num_pages, 2, page_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)

Kernels take strides: nothing beyond a contiguous last dim is assumed.
Page tables are int32 (``block_table [B, max_pages]``); slots are int64,
``slot = page * page_size + offset`` (tokens), and a negative slot is skipped.
Offsets inside kernels are computed in int64.

Plan once per step, run per layer (FlashInfer's plan/run split)::

    plan = backend.plan_decode(kv[0], block_table, seq_lens, slots=slots)   # one sync
    for layer in range(num_layers):
        backend.write_kv(plan.write, kv[layer], key, value)                 # no sync
        out = backend.decode(plan, query, kv[layer], scale)                 # no sync

* ``plan_decode`` / ``plan_prefill`` (and ``plan_write`` / ``plan_copy`` for a
  write or copy on its own) take the index tensors of a step, check their shapes,
  dtypes and devices, and their values (lengths, every page index a sequence
  uses, slots, copy pairs) with vectorised tensor ops whose flags are read back
  in *one* transfer, the only device synchronisation of the step. They raise
  :class:`~kvcore.errors.BadRequest` for bad input and
  :class:`~kvcore.errors.Unsupported` outside the backend's capabilities, and
  return an immutable plan: the validated index tensors (contiguous), host copies
  of the lengths, the geometry they were validated against (:class:`CacheSpec`)
  and whatever the backend precomputes (gather indices, split counts).
* ``decode`` / ``prefill`` / ``write_kv`` / ``copy_pages`` take a plan and one
  layer's tensors. They check shapes, dtypes and devices against the plan and
  read no tensor value, so a run never synchronises with the device
  (tests/test_backend_validation.py checks both). Any cache of the plan's geometry is valid (every layer of a pool), whatever
  its strides. An out-of-range page index never reaches a kernel.

Empty inputs (B = 0, total_q = 0, T = 0, N = 0) return without calling a kernel.

A backend subclasses :class:`Backend` and implements the protected hooks
(``_decode``, ``_prefill``, ``_write_kv``, ``_copy_pages``, and optionally the
``_prepare_*`` precomputations); only this base class calls them.

Backends are found through the entry-point group ``kvcore.backends``
(``name = "module:Class"``); :func:`get` instantiates one by name.

The file runs past ~400 lines on purpose: it is the whole contract a backend
author reads (the plans, and the base class that validates before every hook);
the value checks it runs live in kvcore.backend_checks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, TypeVar

from kvcore.backend_checks import (
    ValueChecks,
    check_cache,
    check_copies,
    check_cu_seqlens,
    check_float,
    check_heads,
    check_index,
    check_last_dim,
    check_scale,
    check_slots,
    check_table,
)
from kvcore.errors import BadRequest, Unsupported

if TYPE_CHECKING:
    import torch

ENTRY_POINT_GROUP = "kvcore.backends"
MAX_HEAD_DIM = 256  # elements; the bound of Capabilities.head_dims = None
MAX_PAGE_SIZE = 128  # tokens; the bound of Capabilities.page_sizes = None
_INF = float("inf")


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


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """The one-layer cache geometry a plan was validated against.

    Every layer of a pool has it, so one plan serves every layer. Strides are not
    part of it: a run accepts any view of this shape with a contiguous last dim.
    """

    num_pages: int
    page_size: int  # tokens per page
    num_kv_heads: int
    head_dim: int  # elements
    dtype: torch.dtype
    device: torch.device
    # (shape, dtype, device) of a cache of this geometry: a run compares one tuple
    key: tuple[tuple[int, ...], torch.dtype, torch.device] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.shape, self.dtype, self.device))

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> CacheSpec:
        num_pages, _, page_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(num_pages, page_size, num_kv_heads, head_dim, kv_cache.dtype, kv_cache.device)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_pages, 2, self.page_size, self.num_kv_heads, self.head_dim)

    def check(self, kv_cache: object) -> torch.Tensor:
        """BadRequest unless ``kv_cache`` has this geometry (reads no data)."""
        import torch

        if (
            isinstance(kv_cache, torch.Tensor)
            and (kv_cache.shape, kv_cache.dtype, kv_cache.device) == self.key
            and (kv_cache.stride(4) == 1 or self.head_dim == 1)
        ):
            return kv_cache  # the common (valid) case: one comparison
        if not isinstance(kv_cache, torch.Tensor):
            raise BadRequest(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        if (
            kv_cache.shape != self.shape
            or kv_cache.dtype != self.dtype
            or kv_cache.device != self.device
        ):
            raise BadRequest(
                f"kv_cache {list(kv_cache.shape)} {kv_cache.dtype} on {kv_cache.device} is not "
                f"the cache the plan was made for: {list(self.shape)} {self.dtype} on {self.device}"
            )
        check_last_dim(kv_cache, "kv_cache")
        return kv_cache

    def check_rows(self, t: object, name: str, rows: int | None, heads: int | None) -> torch.Tensor:
        """A query ([rows, Hq, D], Hq a positive multiple of Hkv: ``heads`` None) or a key/
        value ([rows, heads, D]) in this cache's dtype and device, last dim contiguous;
        ``rows`` None: any. Reads no data; the common (valid) case is one test."""
        import torch

        if isinstance(t, torch.Tensor) and (t.dtype, t.device) == self.key[1:]:
            shape = t.shape
            if (
                len(shape) == 3
                and (rows is None or shape[0] == rows)
                and shape[2] == self.head_dim
                and (shape[1] == heads if heads is not None else shape[1] % self.num_kv_heads == 0)
                and shape[1] > 0
                and (self.head_dim == 1 or t.stride(2) == 1)
            ):
                return t
        t = check_float(t, name, self.device, self.dtype, (rows, heads, self.head_dim))
        check_heads(t.shape[1], self.num_kv_heads)  # a query's heads (key/value passed above)
        raise AssertionError(f"{name}: the fast check refused what the full checks accept")


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Validated slots of a write: every non-negative slot < num_pages * page_size
    and distinct. ``prepared`` is the backend's own (opaque to callers)."""

    backend: str  # name of the backend that made it; only that backend runs it
    cache: CacheSpec
    slots: torch.Tensor  # [T] int64, contiguous; slot < 0 is skipped
    skips: bool  # some slot is negative
    prepared: object = None

    @property
    def num_tokens(self) -> int:
        return int(self.slots.shape[0])


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Validated copy-on-write pairs: pages in [0, num_pages), ``dst`` distinct and
    disjoint from ``src``, so the copies are independent and run in any order."""

    backend: str
    cache: CacheSpec
    src: torch.Tensor  # [N] int64 pages
    dst: torch.Tensor  # [N] int64 pages


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """What a decode and a prefill plan share: tables validated once for one step.

    Sequence b attends its ``seq_lens[b]`` tokens (>= 1), held in pages
    ``block_table[b, :ceil(seq_lens[b] / page_size)]``, each in [0, num_pages);
    the rest of the row is padding and is never read. ``write`` / ``copy`` are the
    step's own write and copy plans (validated in the same transfer), or None.
    Frozen: a plan is made by :class:`Backend` only, and any number of runs (every
    layer, any thread) read it.
    """

    backend: str  # name of the backend that made it; only that backend runs it
    cache: CacheSpec
    block_table: torch.Tensor  # [B, max_pages] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, tokens
    host_seq_lens: tuple[int, ...]  # seq_lens read back in the validating transfer
    write: WritePlan | None = field(default=None, kw_only=True)
    copy: CopyPlan | None = field(default=None, kw_only=True)
    prepared: object = field(default=None, kw_only=True)  # the backend's own

    @property
    def batch(self) -> int:
        return len(self.host_seq_lens)


@dataclass(frozen=True, slots=True)
class DecodePlan(AttentionPlan):
    """One query token per sequence, over the tables of :class:`AttentionPlan`."""

    @property
    def max_seq_len(self) -> int:
        """The longest sequence, in tokens (0 for an empty batch)."""
        return max(self.host_seq_lens, default=0)


@dataclass(frozen=True, slots=True)
class PrefillPlan(AttentionPlan):
    """Varlen causal queries over the tables of :class:`AttentionPlan`.

    The queries of sequence b are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of the
    query; they are its *last* q_len[b] <= seq_lens[b] tokens (bottom-right aligned):
    query i of b attends tokens ``0 .. seq_lens[b] - q_len[b] + i``.
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int32, from 0, non-decreasing
    host_cu_seqlens_q: tuple[int, ...]

    @property
    def total_q(self) -> int:
        """Query rows: cu_seqlens_q[-1]."""
        return self.host_cu_seqlens_q[-1]


Plan = DecodePlan | PrefillPlan | WritePlan | CopyPlan
P = TypeVar("P", DecodePlan, PrefillPlan, WritePlan, CopyPlan)


class Backend(abc.ABC):
    """Paged-attention kernels over one layer's cache. Subclass per backend."""

    name: str
    capabilities: Capabilities

    # -- plan: once per step, validates values (one device sync) ---------------------

    def plan_decode(
        self,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        slots: torch.Tensor | None = None,
        copies: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> DecodePlan:
        """Validate a decode step: ``block_table`` [B, max_pages] int32, ``seq_lens``
        [B] int32 (tokens, >= 1, <= max_pages * page_size), only the first
        ceil(seq_lens[b] / page_size) entries of row b read and in [0, num_pages).

        ``kv_cache`` is any layer's cache (its geometry, dtype and device are read,
        not its values). ``slots`` / ``copies`` add the step's write and copy-on-write
        plans (see :meth:`plan_write`, :meth:`plan_copy`) to the same transfer.
        Synchronises with the device once.
        """
        spec = self._spec(kv_cache)
        checks = ValueChecks()
        table, lens = check_table(checks, block_table, seq_lens, kv_cache, None)
        at = checks.fetch(lens)
        side = _Side(checks, kv_cache, slots, copies)
        host = checks.run()
        write, copy = self._write_plan(side, spec, kv_cache, host), side.copy_plan(self, spec)
        plan = DecodePlan(self.name, spec, table, lens, tuple(host[at]), write=write, copy=copy)
        prepared = self._prepare_decode(plan, kv_cache)
        return plan if prepared is None else replace(plan, prepared=prepared)

    def plan_prefill(
        self,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        slots: torch.Tensor | None = None,
        copies: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PrefillPlan:
        """Validate a prefill step: ``cu_seqlens_q`` [B+1] int32 starts at 0, never
        decreases; q_len[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b] <= seq_lens[b]; the
        query of the run has cu_seqlens_q[-1] rows. Tables, ``slots`` and ``copies``
        as in :meth:`plan_decode`. Synchronises with the device once.
        """
        import torch

        spec = self._spec(kv_cache)
        checks = ValueChecks()
        cu = check_index(cu_seqlens_q, "cu_seqlens_q", spec.device, torch.int32, (None,))
        if cu.shape[0] < 1:
            raise BadRequest("cu_seqlens_q must hold B + 1 >= 1 entries")
        table, lens = check_table(checks, block_table, seq_lens, kv_cache, cu.shape[0] - 1)
        check_cu_seqlens(checks, cu, lens)
        at_lens, at_cu = checks.fetch(lens), checks.fetch(cu)
        side = _Side(checks, kv_cache, slots, copies)
        host = checks.run()
        write, copy = self._write_plan(side, spec, kv_cache, host), side.copy_plan(self, spec)
        host_lens, host_cu = tuple(host[at_lens]), tuple(host[at_cu])
        plan = PrefillPlan(
            self.name, spec, table, lens, host_lens, cu, host_cu, write=write, copy=copy
        )
        prepared = self._prepare_prefill(plan, kv_cache)
        return plan if prepared is None else replace(plan, prepared=prepared)

    def plan_write(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> WritePlan:
        """Validate ``slots`` [T] int64 on their own: non-negative slots must be
        < num_pages * page_size and distinct; negative ones are skipped.
        Synchronises with the device once."""
        spec = self._spec(kv_cache)
        checks = ValueChecks()
        side = _Side(checks, kv_cache, slots, None)
        plan = self._write_plan(side, spec, kv_cache, checks.run())
        assert plan is not None
        return plan

    def plan_copy(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> CopyPlan:
        """Validate copy-on-write pairs on their own: ``src``/``dst`` [N] int64 pages in
        [0, num_pages); ``dst`` holds no duplicate and no page of ``src``.
        Synchronises with the device once."""
        spec = self._spec(kv_cache)
        checks = ValueChecks()
        side = _Side(checks, kv_cache, None, (src, dst))
        checks.run()
        plan = side.copy_plan(self, spec)
        assert plan is not None
        return plan

    # -- run: per layer, shape/dtype/device checks only, never a sync -----------------

    def decode(
        self, plan: DecodePlan, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """query [B, Hq, D] (cache dtype, Hq a multiple of Hkv) -> out [B, Hq, D] (query
        dtype): softmax(scale * q.k) v over each sequence's tokens of ``kv_cache``."""
        if type(plan) is not DecodePlan or plan.backend != self.name:
            plan = self._own(plan, DecodePlan)
        spec = plan.cache
        kv_cache = spec.check(kv_cache)
        query = spec.check_rows(query, "query", len(plan.host_seq_lens), None)
        if type(scale) is not float or not -_INF < scale < _INF:
            scale = check_scale(scale)
        if not plan.host_seq_lens:
            return query.new_empty(query.shape)
        return self._decode(plan, query, kv_cache, scale)

    def prefill(
        self, plan: PrefillPlan, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """query [total_q, Hq, D] -> out [total_q, Hq, D]: bottom-right aligned causal
        attention of each sequence's queries (see :class:`PrefillPlan`); K/V of the
        queried tokens must already be written."""
        spec = self._own(plan, PrefillPlan).cache
        kv_cache = spec.check(kv_cache)
        query = spec.check_rows(query, "query", None, None)
        if query.shape[0] != plan.total_q:
            raise BadRequest(
                f"query has {query.shape[0]} rows; it must have the plan's "
                f"total_q = cu_seqlens_q[-1] = {plan.total_q}"
            )
        scale = check_scale(scale)
        if plan.total_q == 0:
            return query.new_empty(query.shape)
        return self._prefill(plan, query, kv_cache, scale)

    def write_kv(
        self, plan: WritePlan, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Scatter ``key``/``value`` [T, Hkv, D] (cache dtype) into the plan's slots."""
        if type(plan) is not WritePlan or plan.backend != self.name:
            plan = self._own(plan, WritePlan)
        spec = plan.cache
        kv_cache = spec.check(kv_cache)
        key = spec.check_rows(key, "key", plan.num_tokens, spec.num_kv_heads)
        value = spec.check_rows(value, "value", plan.num_tokens, spec.num_kv_heads)
        if plan.num_tokens > 0:
            self._write_kv(plan, kv_cache, key, value)

    def copy_pages(self, plan: CopyPlan, kv_cache: torch.Tensor) -> None:
        """Copy page ``src[i]`` to page ``dst[i]`` (K and V) of ``kv_cache``."""
        spec = self._own(plan, CopyPlan).cache
        kv_cache = spec.check(kv_cache)
        if plan.src.shape[0] > 0:
            self._copy_pages(plan, kv_cache)

    def check_supported(self, kv_cache: torch.Tensor) -> None:
        """Unsupported unless the capabilities cover this cache's device, dtype and shape."""
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        page_size, head_dim = kv_cache.shape[2], kv_cache.shape[4]
        if not self.capabilities.supports(kv_cache.device.type, dtype, head_dim, page_size):
            raise Unsupported(
                f"backend {self.name!r} does not support device={kv_cache.device.type} "
                f"dtype={dtype} head_dim={head_dim} page_size={page_size}"
            )

    # -- what a backend implements; called only by the methods above -----------------
    # Inputs arrive checked: the plan's tables are valid, kv_cache has its geometry,
    # query/key/value have the shapes, dtype and device stated above; none is empty.

    @abc.abstractmethod
    def _decode(
        self, plan: DecodePlan, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def _prefill(
        self, plan: PrefillPlan, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def _write_kv(
        self, plan: WritePlan, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None: ...

    @abc.abstractmethod
    def _copy_pages(self, plan: CopyPlan, kv_cache: torch.Tensor) -> None: ...

    def _prepare_decode(self, plan: DecodePlan, kv_cache: torch.Tensor) -> object:
        """Precomputation stored as ``plan.prepared`` (host work; no sync). None: none."""
        return None

    def _prepare_prefill(self, plan: PrefillPlan, kv_cache: torch.Tensor) -> object:
        return None

    def _prepare_write(self, plan: WritePlan, kv_cache: torch.Tensor) -> object:
        return None

    # -- helpers ---------------------------------------------------------------------

    def _spec(self, kv_cache: object) -> CacheSpec:
        """Shape checks of the planning cache, then the capabilities (before any value
        is read: an undeclared device, meta included, never runs a check)."""
        cache = check_cache(kv_cache)
        self.check_supported(cache)
        return CacheSpec.of(cache)

    def _write_plan(
        self, side: _Side, spec: CacheSpec, kv_cache: torch.Tensor, host: list[list[int]]
    ) -> WritePlan | None:
        if side.slots is None:
            return None
        plan = WritePlan(self.name, spec, side.slots, bool(host[side.at_skips][0]))
        prepared = self._prepare_write(plan, kv_cache)
        return plan if prepared is None else replace(plan, prepared=prepared)

    def _own(self, plan: object, kind: type[P]) -> P:
        if not isinstance(plan, kind):
            raise BadRequest(f"expected a {kind.__name__}, got {type(plan).__name__}")
        if plan.backend != self.name:
            raise BadRequest(f"a plan of backend {plan.backend!r} given to {self.name!r}")
        return plan


class _Side:
    """The write and copy-on-write parts of a step plan: their checks join the step's
    transfer; the plans are built from its result."""

    def __init__(
        self,
        checks: ValueChecks,
        kv_cache: torch.Tensor,
        slots: object | None,
        copies: tuple[object, object] | None,
    ) -> None:
        self.slots: torch.Tensor | None = None
        self.copies: tuple[torch.Tensor, torch.Tensor] | None = None
        self.at_skips = -1
        if slots is not None:
            self.slots = check_slots(checks, slots, kv_cache)
            self.at_skips = checks.fetch((self.slots < 0).any())
        if copies is not None:
            if not isinstance(copies, tuple) or len(copies) != 2:
                raise BadRequest("copies must be a (src, dst) pair of tensors")
            self.copies = check_copies(checks, copies[0], copies[1], kv_cache)

    def copy_plan(self, backend: Backend, spec: CacheSpec) -> CopyPlan | None:
        if self.copies is None:
            return None
        return CopyPlan(backend.name, spec, *self.copies)


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
