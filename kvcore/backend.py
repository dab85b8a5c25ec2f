"""The kernel contract every backend plugin implements, and the registry.

All operations work on one layer's cache tensor::

    kv_cache  [num_pages, 2, page_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
    kv_cache  [num_pages, 1, page_size, 1, head_dim]              (latent: MLA's one vector)

in float16/bfloat16/float32, or in float8_e4m3fn/float8_e5m2 holding ``x / scale``
(runs take the per-layer ``k_scale``/``v_scale``; a query and an output are in a
float dtype). What attention computes beyond full causal softmax is a plan option,
:class:`Attention` (a sliding window, a logit soft cap, per-head sinks, MLA's
``v_head_dim``). A backend declares the features it computes in
``Capabilities.features`` (:data:`FEATURES`); a plan needing another raises
:class:`~kvcore.errors.Unsupported` naming it. kvcore_torch defines the numerics.

Kernels take strides: nothing beyond a contiguous last dim is assumed. A pool's
order (``KVLayout.order``: layer-major, page-major, head-outer) reaches a kernel
only as the strides of its layer views, so an order is a view, never a branch; a
backend whose kernels read only some orders declares them
(``Capabilities.orders``) and is refused the others with Unsupported naming the
order, in the plan and in the run.
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
  in *one* transfer, the only device synchronisation of the step (CPU tensors,
  which have no transfer to save, are read directly: see kvcore.backend_checks).
  They raise :class:`~kvcore.errors.BadRequest` for bad input and
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
``_prepare_*`` precomputations); only this base class calls them. A hook receives
only the keywords its call needs, so a backend that declares no feature keeps the
plain signatures: ``k_scale=``/``v_scale=`` (floats) on fp8 caches (backends with
"fp8") and ``sinks=`` ([Hq] float32) when ``plan.attention.sinks`` (backends with
"sinks"); latent writes go to ``_write_latent`` (backends with "mla").

Backends are found through the entry-point group ``kvcore.backends``
(``name = "module:Class"``); :func:`get` instantiates one by name.

Plugins import this module (with kvcore.layout and kvcore.errors), never
kvcore.backend_checks: what they share with the checks is re-exported here
(:data:`HOST_LIST_MAX`, up to which a step's CPU index tensors are read as Python
lists; a backend's own host path takes the same bound). docs/architecture.md
states the rule; tests/test_imports.py checks it.

The file runs past ~400 lines on purpose: it is the whole contract a backend
author reads (the plans, and the base class that validates before every hook);
the value checks it runs live in kvcore.backend_checks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TypeVar

from kvcore.backend_checks import ALL_ORDERS as ALL_ORDERS  # for plugins' declarations
from kvcore.backend_checks import HOST_LIST_MAX as HOST_LIST_MAX  # for plugins' host paths
from kvcore.backend_checks import NAMED_ORDERS as NAMED_ORDERS
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
    check_sinks,
    check_slots,
    check_table,
    fits_orders,
    view_order,
)
from kvcore.errors import BadRequest, Unsupported

if TYPE_CHECKING:
    import torch

ENTRY_POINT_GROUP = "kvcore.backends"
MAX_HEAD_DIM = 256  # elements; the bound of Capabilities.head_dims = None
MAX_LATENT_DIM = 1024  # elements; the same bound for a latent cache (DeepSeek's is 576)
MAX_PAGE_SIZE = 128  # tokens; the bound of Capabilities.page_sizes = None
FEATURES = frozenset({"fp8", "window", "soft_cap", "sinks", "mla"})
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # largest finite values
_INF = float("inf")
_NONE: dict[str, Any] = {}  # the hook keywords of a plain run (unpacked, never written)
_ROW_DTYPES = frozenset({"torch.float16", "torch.bfloat16", "torch.float32"})  # of fp8 caches


@dataclass(frozen=True, slots=True)
class Attention:
    """What a step's attention computes beyond full causal softmax (a plan option).

    A query at absolute position p (decode: seq_len - 1; prefill query i of
    sequence b: seq_len[b] - q_len[b] + i) attends keys j with
    ``max(0, p - window_left) <= j <= p``; ``window_left`` -1 means no window
    (tokens). Logits are ``scale * q.k``, then, when ``logits_soft_cap`` > 0,
    ``cap * tanh(logits / cap)``, then masked. With ``sinks`` a run takes one
    logit per query head that joins the softmax denominator only (no value row)::

        out = sum_j exp(l_j - m) v_j / (exp(s_h - m) + sum_j exp(l_j - m)),
        m = max(max_j l_j, s_h)

    ``v_head_dim`` (latent caches only, and required there): K is the whole latent
    vector [D], V its first ``v_head_dim`` elements; the query is MLA's absorbed
    query [rows, Hq, D], the output [rows, Hq, v_head_dim].
    """

    window_left: int = -1
    logits_soft_cap: float = 0.0
    sinks: bool = False
    v_head_dim: int | None = None

    def features(self) -> frozenset[str]:
        """The :data:`FEATURES` these options need (a latent cache adds "mla")."""
        need = set()
        if self.window_left >= 0:
            need.add("window")
        if self.logits_soft_cap > 0:
            need.add("soft_cap")
        if self.sinks:
            need.add("sinks")
        return frozenset(need)

    def check(self, head_dim: int, latent: bool) -> None:
        """BadRequest unless these options are valid for a cache of ``head_dim`` elements
        (``latent``: a latent cache, which requires ``v_head_dim`` in (0, head_dim])."""
        w, cap, vd = self.window_left, self.logits_soft_cap, self.v_head_dim
        if type(w) is not int or w < -1:
            raise BadRequest(f"window_left must be an int >= -1 (tokens; -1: none), got {w!r}")
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 <= cap < _INF:
            raise BadRequest(f"logits_soft_cap must be a finite float >= 0, got {cap!r}")
        if type(self.sinks) is not bool:
            raise BadRequest(f"sinks must be a bool, got {self.sinks!r}")
        if not latent and vd is not None:
            raise BadRequest(f"v_head_dim={vd!r} is for latent (MLA) caches only")
        if latent and (type(vd) is not int or not 0 < vd <= head_dim):
            raise BadRequest(
                f"a latent cache needs v_head_dim, an int in (0, head_dim = {head_dim}], got {vd!r}"
            )


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend computes correctly; anything else raises Unsupported.

    ``head_dims`` / ``page_sizes`` of None mean "any" within 1..MAX_HEAD_DIM (a
    latent cache: 1..MAX_LATENT_DIM) and 1..MAX_PAGE_SIZE (elements and tokens).
    ``features`` (a subset of :data:`FEATURES`) are the :class:`Attention` options
    and caches computed beyond full causal attention over a float kv cache: "fp8"
    (float8 caches; their dtypes go in ``dtypes`` too), "window", "soft_cap",
    "sinks", "mla" (latent caches). ``orders`` (permutations of
    :data:`kvcore.layout.AXES`, e.g. ``{"LPKTH"}``) are the pool orders whose layer
    views the kernels read: a cache whose strides fit none of them (as
    :func:`kvcore.backend_checks.fits_order` says) raises Unsupported naming its
    order, in the plan and in the run. None (the default): any strides with a
    contiguous last dim, every order and slices no pool gives included. Frozen: a
    backend declares it once.
    """

    devices: frozenset[str]  # device types: "cpu", "cuda"
    dtypes: frozenset[str]  # "float16", "bfloat16", "float32", "float8_e4m3fn", ...
    head_dims: frozenset[int] | None = None
    page_sizes: frozenset[int] | None = None
    features: frozenset[str] = frozenset()
    orders: frozenset[str] | None = None

    def __post_init__(self) -> None:
        bad = sorted(set(self.orders or ()) - set(ALL_ORDERS))
        if bad:
            raise ValueError(f"Capabilities.orders are permutations of LPKTH, got {bad}")

    def supports(
        self, device: str, dtype: str, head_dim: int, page_size: int, latent: bool = False
    ) -> bool:
        return (
            device in self.devices
            and dtype in self.dtypes
            and self.supports_head_dim(head_dim, latent)
            and self.supports_page_size(page_size)
        )

    def supports_head_dim(self, head_dim: int, latent: bool = False) -> bool:
        """Whether ``head_dim`` (elements) is declared (for a latent cache: ``latent``)."""
        if self.head_dims is None:
            return 1 <= head_dim <= (MAX_LATENT_DIM if latent else MAX_HEAD_DIM)
        return head_dim in self.head_dims

    def supports_page_size(self, page_size: int) -> bool:
        """Whether ``page_size`` (tokens per page) is declared."""
        if self.page_sizes is None:
            return 1 <= page_size <= MAX_PAGE_SIZE
        return page_size in self.page_sizes

    def supports_strides(self, shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
        """Whether a layer view of ``shape`` and ``strides`` fits a declared order."""
        return self.orders is None or fits_orders(self.orders, shape, strides)


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """The one-layer cache geometry a plan was validated against.

    Every layer of a pool has it, so one plan serves every layer. Strides are not
    part of it: a run accepts any view of this shape with a contiguous last dim.
    ``parts`` is 2 (K, V) or 1 (a latent cache: one head, one vector per token).
    """

    num_pages: int
    page_size: int  # tokens per page
    num_kv_heads: int
    head_dim: int  # elements
    dtype: torch.dtype
    device: torch.device
    parts: int = 2
    # (shape, dtype, device) of a cache of this geometry: a run compares one tuple
    key: tuple[tuple[int, ...], torch.dtype, torch.device] = field(init=False, compare=False)
    fp8: bool = field(init=False, compare=False)  # a float8 cache: rows are another float

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.shape, self.dtype, self.device))
        object.__setattr__(self, "fp8", str(self.dtype).removeprefix("torch.") in FP8_MAX)

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> CacheSpec:
        num_pages, parts, page_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(
            num_pages, page_size, num_kv_heads, head_dim, kv_cache.dtype, kv_cache.device, parts
        )

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_pages, self.parts, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def latent(self) -> bool:
        return self.parts == 1

    @property
    def dtype_name(self) -> str:
        """ "float16", "float8_e4m3fn", ...: the dtype as Capabilities names it."""
        return str(self.dtype).removeprefix("torch.")

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
        value ([rows, heads, D]) in this cache's dtype (of an fp8 cache: float16,
        bfloat16 or float32) and device, last dim contiguous; ``rows`` None: any.
        Reads no data; the common (valid) case is one test."""
        import torch

        if isinstance(t, torch.Tensor) and (
            (t.dtype, t.device) == self.key[1:]
            or (self.fp8 and str(t.dtype) in _ROW_DTYPES and t.device == self.device)
        ):
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
        pattern = (rows, heads, self.head_dim)
        t = check_float(t, name, self.device, None if self.fp8 else self.dtype, pattern)
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
    the rest of the row is padding and is never read. With a window
    (``attention.window_left >= 0``) the pages before
    :meth:`first_page` are not read either (a hybrid engine may have released
    them: they may hold -1 or anything). ``write`` / ``copy`` are the step's own
    write and copy plans (validated in the same transfer), or None. Frozen: a plan
    is made by :class:`Backend` only, and any number of runs (every layer, any
    thread) read it.
    """

    backend: str  # name of the backend that made it; only that backend runs it
    cache: CacheSpec
    block_table: torch.Tensor  # [B, max_pages] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, tokens
    host_seq_lens: tuple[int, ...]  # seq_lens read back in the validating transfer
    write: WritePlan | None = field(default=None, kw_only=True)
    copy: CopyPlan | None = field(default=None, kw_only=True)
    prepared: object = field(default=None, kw_only=True)  # the backend's own
    attention: Attention = field(default=Attention(), kw_only=True)  # validated options

    @property
    def batch(self) -> int:
        return len(self.host_seq_lens)

    def first_page(self, b: int) -> int:
        """The first block-table column sequence ``b`` reads: 0 without a window, else
        floor(max(0, first query position - window_left) / page_size) (host values)."""
        w = self.attention.window_left
        if w < 0:
            return 0
        first_query = self.host_seq_lens[b] - self.q_len(b)  # its position, in tokens
        return max(0, first_query - w) // self.cache.page_size

    def q_len(self, b: int) -> int:
        """Queries of sequence ``b``: 1 for decode (overridden by prefill)."""
        return 1


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

    def q_len(self, b: int) -> int:
        return self.host_cu_seqlens_q[b + 1] - self.host_cu_seqlens_q[b]


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
        attention: Attention | None = None,
    ) -> DecodePlan:
        """Validate a decode step: ``block_table`` [B, max_pages] int32, ``seq_lens``
        [B] int32 (tokens, >= 1, <= max_pages * page_size), the entries of row b a
        sequence reads (columns :meth:`AttentionPlan.first_page` to
        ceil(seq_lens[b] / page_size) - 1) in [0, num_pages).

        ``kv_cache`` is any layer's cache (its geometry, dtype and device are read,
        not its values). ``slots`` / ``copies`` add the step's write and copy-on-write
        plans (see :meth:`plan_write`, :meth:`plan_copy`) to the same transfer.
        ``attention``: the options (:class:`Attention`; BadRequest if invalid,
        Unsupported if they need an undeclared feature). Synchronises with the
        device once.
        """
        spec = self._spec(kv_cache)
        options = self._options(spec, attention)
        checks = ValueChecks(host=spec.device.type == "cpu")
        table, lens = check_table(
            checks, block_table, seq_lens, kv_cache, None, options.window_left
        )
        at = checks.fetch(lens)
        side = _Side(checks, kv_cache, slots, copies)
        host = checks.run()
        write, copy = self._write_plan(side, spec, kv_cache, host), side.copy_plan(self, spec)
        plan = DecodePlan(
            self.name, spec, table, lens, tuple(host[at]), write=write, copy=copy, attention=options
        )
        return _prepared(plan, self._prepare_decode(plan, kv_cache))

    def plan_prefill(
        self,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        slots: torch.Tensor | None = None,
        copies: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention: Attention | None = None,
    ) -> PrefillPlan:
        """Validate a prefill step: ``cu_seqlens_q`` [B+1] int32 starts at 0, never
        decreases; q_len[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b] <= seq_lens[b]; the
        query of the run has cu_seqlens_q[-1] rows. Tables, ``slots``, ``copies`` and
        ``attention`` as in :meth:`plan_decode`. Synchronises with the device once.
        """
        import torch

        spec = self._spec(kv_cache)
        options = self._options(spec, attention)
        checks = ValueChecks(host=spec.device.type == "cpu")
        cu = check_index(cu_seqlens_q, "cu_seqlens_q", spec.device, torch.int32, (None,))
        if cu.shape[0] < 1:
            raise BadRequest("cu_seqlens_q must hold B + 1 >= 1 entries")
        table, lens = check_table(
            checks, block_table, seq_lens, kv_cache, cu.shape[0] - 1, options.window_left, cu
        )
        check_cu_seqlens(checks, cu, lens)
        at_lens, at_cu = checks.fetch(lens), checks.fetch(cu)
        side = _Side(checks, kv_cache, slots, copies)
        host = checks.run()
        write, copy = self._write_plan(side, spec, kv_cache, host), side.copy_plan(self, spec)
        host_lens, host_cu = tuple(host[at_lens]), tuple(host[at_cu])
        plan = PrefillPlan(
            self.name,
            spec,
            table,
            lens,
            host_lens,
            cu,
            host_cu,
            write=write,
            copy=copy,
            attention=options,
        )
        return _prepared(plan, self._prepare_prefill(plan, kv_cache))

    def plan_write(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> WritePlan:
        """Validate ``slots`` [T] int64 on their own: non-negative slots must be
        < num_pages * page_size and distinct; negative ones are skipped.
        Synchronises with the device once."""
        spec = self._spec(kv_cache)
        checks = ValueChecks(host=spec.device.type == "cpu")
        side = _Side(checks, kv_cache, slots, None)
        plan = self._write_plan(side, spec, kv_cache, checks.run())
        assert plan is not None
        return plan

    def plan_copy(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> CopyPlan:
        """Validate copy-on-write pairs on their own: ``src``/``dst`` [N] int64 pages in
        [0, num_pages); ``dst`` holds no duplicate and no page of ``src``.
        Synchronises with the device once."""
        spec = self._spec(kv_cache)
        checks = ValueChecks(host=spec.device.type == "cpu")
        side = _Side(checks, kv_cache, None, (src, dst))
        checks.run()
        plan = side.copy_plan(self, spec)
        assert plan is not None
        return plan

    # -- run: per layer, shape/dtype/device checks only, never a sync -----------------

    def decode(
        self,
        plan: DecodePlan,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [B, Hq, D] (cache dtype; of an fp8 cache any float dtype; Hq a multiple
        of Hkv) -> out [B, Hq, Dv] (query dtype; Dv = D, or ``v_head_dim`` on a latent
        cache): softmax(scale * q.k) v over each sequence's tokens of ``kv_cache``, with
        the plan's :class:`Attention` options. ``k_scale``/``v_scale``: what an fp8
        cache's K/V are multiplied by on load (ignored on other caches; a latent cache
        uses ``k_scale`` for its one vector). ``sinks`` [Hq] float32 when the plan's
        ``attention.sinks``, else None."""
        if type(plan) is not DecodePlan or plan.backend != self.name:
            plan = self._own(plan, DecodePlan)
        spec = plan.cache
        kv_cache = spec.check(kv_cache)
        if self.capabilities.orders is not None:
            self._check_order(kv_cache)
        query = spec.check_rows(query, "query", len(plan.host_seq_lens), None)
        if type(scale) is not float or not -_INF < scale < _INF:
            scale = check_scale(scale)
        extra = _NONE
        if spec.fp8 or plan.attention.sinks or sinks is not None:  # else the plain run
            extra = self._run_extra(plan, query, k_scale, v_scale, sinks)
        if not plan.host_seq_lens:
            return query.new_empty(_out_shape(plan, query))
        return self._decode(plan, query, kv_cache, scale, **extra)

    def prefill(
        self,
        plan: PrefillPlan,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [total_q, Hq, D] -> out [total_q, Hq, Dv]: bottom-right aligned causal
        attention of each sequence's queries (see :class:`PrefillPlan`); K/V of the
        queried tokens must already be written. Keywords as in :meth:`decode`."""
        spec = self._own(plan, PrefillPlan).cache
        kv_cache = spec.check(kv_cache)
        if self.capabilities.orders is not None:
            self._check_order(kv_cache)
        query = spec.check_rows(query, "query", None, None)
        if query.shape[0] != plan.total_q:
            raise BadRequest(
                f"query has {query.shape[0]} rows; it must have the plan's "
                f"total_q = cu_seqlens_q[-1] = {plan.total_q}"
            )
        scale = check_scale(scale)
        extra = self._run_extra(plan, query, k_scale, v_scale, sinks)
        if plan.total_q == 0:
            return query.new_empty(_out_shape(plan, query))
        return self._prefill(plan, query, kv_cache, scale, **extra)

    def write_kv(
        self,
        plan: WritePlan,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Scatter ``key``/``value`` [T, Hkv, D] (cache dtype; of an fp8 cache any float
        dtype, stored as ``x / scale`` saturated to the format's largest finite value)
        into the plan's slots. A latent cache takes ``write_kv(plan, kv_cache, latent,
        None)``: ``latent`` [T, 1, D] goes to part 0 (quantized with ``k_scale``)."""
        if type(plan) is not WritePlan or plan.backend != self.name:
            plan = self._own(plan, WritePlan)
        spec = plan.cache
        kv_cache = spec.check(kv_cache)
        if self.capabilities.orders is not None:
            self._check_order(kv_cache)
        key = spec.check_rows(key, "key", plan.num_tokens, spec.num_kv_heads)
        scales: dict[str, float] = {}
        if spec.fp8:
            scales = {"k_scale": check_scale(k_scale, "k_scale", positive=True)}
            if not spec.latent:
                scales["v_scale"] = check_scale(v_scale, "v_scale", positive=True)
        if spec.latent:
            if value is not None:
                raise BadRequest("a latent cache holds one vector per token: pass value=None")
            if plan.num_tokens > 0:
                self._write_latent(plan, kv_cache, key, **scales)
            return
        value = spec.check_rows(value, "value", plan.num_tokens, spec.num_kv_heads)
        if plan.num_tokens > 0:
            self._write_kv(plan, kv_cache, key, value, **scales)

    def copy_pages(self, plan: CopyPlan, kv_cache: torch.Tensor) -> None:
        """Copy page ``src[i]`` to page ``dst[i]`` (K and V) of ``kv_cache``."""
        spec = self._own(plan, CopyPlan).cache
        kv_cache = spec.check(kv_cache)
        if self.capabilities.orders is not None:
            self._check_order(kv_cache)
        if plan.src.shape[0] > 0:
            self._copy_pages(plan, kv_cache)

    def check_supported(self, kv_cache: torch.Tensor, attention: Attention | None = None) -> None:
        """Unsupported unless the capabilities cover this cache's device, dtype and shape
        and the features it and ``attention`` need; BadRequest for invalid options."""
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        page_size, head_dim, latent = kv_cache.shape[2], kv_cache.shape[4], kv_cache.shape[1] == 1
        need: set[str] = set()
        if attention is not None:
            attention.check(head_dim, latent)
            need |= attention.features()
        if dtype in FP8_MAX:
            need.add("fp8")
        if latent:
            need.add("mla")
        missing = sorted(need - self.capabilities.features)
        if missing:
            raise Unsupported(
                f"backend {self.name!r} does not declare feature {', '.join(missing)} "
                f"(kv_cache dtype={dtype} kind={'latent' if latent else 'kv'}; it declares "
                f"{sorted(self.capabilities.features)})"
            )
        if not self.capabilities.supports(kv_cache.device.type, dtype, head_dim, page_size, latent):
            raise Unsupported(
                f"backend {self.name!r} does not support device={kv_cache.device.type} "
                f"dtype={dtype} head_dim={head_dim} page_size={page_size}"
            )
        self._check_order(kv_cache)

    def _check_order(self, kv_cache: torch.Tensor) -> None:
        """Unsupported unless ``kv_cache``'s strides fit a declared pool order (the
        message names the order they do fit). A geometry's constant: cached."""
        shape, strides = tuple(kv_cache.shape), kv_cache.stride()
        if self.capabilities.supports_strides(shape, strides):
            return
        order = view_order(shape, strides)
        what = f"pool order {order!r}" if order else "strides that are no pool order"
        raise Unsupported(
            f"backend {self.name!r} does not support {what} (a layer view {list(shape)} "
            f"with strides {strides}); it declares orders {sorted(self.capabilities.orders or ())}"
        )

    # -- what a backend implements; called only by the methods above -----------------
    # Inputs arrive checked: the plan's tables are valid, kv_cache has its geometry,
    # query/key/value have the shapes, dtype and device stated above; none is empty.
    # Keywords only where the call needs them (see the module docstring): a backend
    # declaring "fp8" adds ``*, k_scale: float, v_scale: float`` to _decode, _prefill
    # and _write_kv; one declaring "sinks" adds ``sinks: torch.Tensor`` to _decode and
    # _prefill; one declaring "mla" overrides _write_latent.

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

    def _write_latent(
        self, plan: WritePlan, kv_cache: torch.Tensor, latent: torch.Tensor, **scales: float
    ) -> None:
        """Store ``latent`` [T, 1, D] rows in part 0 at the plan's slots (``k_scale=`` on
        fp8 caches). Called only for backends that declare "mla"."""
        raise AssertionError(f"backend {self.name!r} declares 'mla' without _write_latent")

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
        is read: an undeclared device, meta included, never runs a check).

        What they accept depends on the cache's shape, dtype and device (and a
        contiguous last dim) only, so each backend instance (whose capabilities may be
        its own) remembers the specs of the geometries it accepted: a step's plan on a
        known geometry is one dict lookup."""
        import torch

        specs: dict[object, CacheSpec] = self.__dict__.setdefault("_specs", {})
        if isinstance(kv_cache, torch.Tensor):
            key = (kv_cache.shape, kv_cache.dtype, kv_cache.device)
            spec = specs.get(key)
            if spec is not None and (kv_cache.stride(4) == 1 or spec.head_dim == 1):
                if self.capabilities.orders is not None:  # strides are no part of the key
                    self._check_order(kv_cache)
                return spec
        cache = check_cache(kv_cache)
        self.check_supported(cache)
        if len(specs) >= 64:  # a bound, whatever geometries a caller tries
            specs.clear()
        spec = specs[(cache.shape, cache.dtype, cache.device)] = CacheSpec.of(cache)
        return spec

    def _options(self, spec: CacheSpec, attention: object) -> Attention:
        """The attention options of a plan: BadRequest if invalid for ``spec``,
        Unsupported if they need a feature the backend does not declare."""
        if attention is None:
            attention = Attention()
        if not isinstance(attention, Attention):
            raise BadRequest(f"attention must be an Attention, got {type(attention).__name__}")
        attention.check(spec.head_dim, spec.latent)
        missing = sorted(attention.features() - self.capabilities.features)
        if missing:
            raise Unsupported(
                f"backend {self.name!r} does not declare feature {', '.join(missing)} "
                f"(asked by {attention}; it declares {sorted(self.capabilities.features)})"
            )
        return attention

    def _run_extra(
        self,
        plan: AttentionPlan,
        query: torch.Tensor,
        k_scale: float,
        v_scale: float,
        sinks: torch.Tensor | None,
    ) -> dict[str, Any]:
        """The hook keywords of a decode or prefill run (shape checks only): the scales
        on an fp8 cache, the sinks when the plan asks for them."""
        spec = plan.cache
        extra: dict[str, Any] = {}
        if spec.fp8:
            extra["k_scale"] = check_scale(k_scale, "k_scale", positive=True)
            extra["v_scale"] = check_scale(v_scale, "v_scale", positive=True)
        if plan.attention.sinks:
            extra["sinks"] = check_sinks(sinks, query.shape[1], spec.device)
        elif sinks is not None:
            raise BadRequest("sinks given to a plan made without Attention(sinks=True)")
        return extra

    def _write_plan(
        self, side: _Side, spec: CacheSpec, kv_cache: torch.Tensor, host: list[list[int]]
    ) -> WritePlan | None:
        if side.slots is None:
            return None
        plan = WritePlan(self.name, spec, side.slots, bool(host[side.at_skips][0]))
        return _prepared(plan, self._prepare_write(plan, kv_cache))

    def _own(self, plan: object, kind: type[P]) -> P:
        if not isinstance(plan, kind):
            raise BadRequest(f"expected a {kind.__name__}, got {type(plan).__name__}")
        if plan.backend != self.name:
            raise BadRequest(f"a plan of backend {plan.backend!r} given to {self.name!r}")
        return plan


def _prepared(plan: P, prepared: object) -> P:
    """``plan`` holding the backend's precomputation (None: none). Set in place, before
    the plan is returned to anyone: ``dataclasses.replace`` would rebuild it per step."""
    if prepared is not None:
        object.__setattr__(plan, "prepared", prepared)
    return plan


def _out_shape(plan: AttentionPlan, query: torch.Tensor) -> tuple[int, int, int]:
    """[rows, Hq, Dv]: Dv is the plan's v_head_dim on a latent cache, else D."""
    rows, heads, head_dim = query.shape
    return (rows, heads, plan.attention.v_head_dim or head_dim)


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
            self.slots, self.at_skips = check_slots(checks, slots, kv_cache)
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
