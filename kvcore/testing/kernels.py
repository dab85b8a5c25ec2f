"""The kernel conformance suite: hold any backend to the torch oracle.

Each property below is a hypothesis test over :mod:`kvcore.testing.kernel_cases`
(shapes from the backend's capabilities and the profile)::

    from kvcore.testing.kernels import Suite
    Suite("triton", device="cpu", profile="quick").run_all()   # {name: None | error}

or one property at a time with ``Suite.run(name)``. ``kvcore conformance`` and
the pytest plugin (:mod:`kvcore.testing.pytest_plugin`) are thin wrappers.

Properties (all compare with ``kernel_cases.tolerance``: the bound of
:func:`kvcore.testing.tolerance.attention` on each case's own tensors):

* decode / prefill equal the oracle, on NaN-poisoned caches (unused slots of
  referenced pages, spare pages, padding of strided layouts, the other layers of
  a pool) with distinct, shared and repeated pages and garbage in the padding of
  the block table; caches are dense, K/V-split, padded, or a layer of a real pool
  in a drawn order (``KVLayout.order``: layer- or page-major, head-outer, any
  permutation; only the declared ones for a backend with ``Capabilities.orders``);
* decode is invariant under a permutation of the pool's pages and under a
  change of page size;
* write_kv then prefill / decode equals dense causal attention (SDPA on
  contiguous K/V, GQA by repeat_interleave); write_kv stores exactly, skips
  negative slots and writes nothing else of the cache's storage;
* copy_pages copies exactly and touches nothing else of the storage;
* the last query of a prefill equals decode;
* one plan serves every layer: a plan made with one cache runs on another cache
  of the same geometry (other strides, other values) as that cache's own plan;
* out-of-range pages and slots raise BadRequest when planned; undeclared dtype /
  head dim / page size / pool order raise Unsupported when planned (an undeclared
  order also when run, the message naming it);
* one property per feature of the contract (``feature_fp8``, ``feature_window``,
  ``feature_soft_cap``, ``feature_sinks``, ``feature_mla``; the family lives in
  :mod:`kvcore.testing.kernel_features`): a declared feature equals the oracle,
  and the oracle equals dense attention over the dequantized cache; an
  undeclared one raises Unsupported in every plan that needs it.

Every call goes through the public plan/run API (``plan_decode`` then
``decode(plan, ...)``, etc.), as an engine makes it.

The file runs past ~400 lines on purpose: it is the suite, one method per
property above, each read as its statement; the shapes and cases it draws live
in kernel_cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore import backend as registry
from kvcore.backend import ALL_ORDERS, Backend
from kvcore.backend_checks import view_order
from kvcore.errors import BadRequest, KVCoreError, Unsupported
from kvcore.layout import KVLayout
from kvcore.testing import kernel_cases as kc
from kvcore.testing.kernel_cases import Built, Case
from kvcore.testing.kernel_features import FEATURE_PROPERTIES, run_feature
from kvcore.testing.tolerance import assert_close

PROPERTIES: tuple[str, ...] = (
    "decode_matches_oracle",
    "prefill_matches_oracle",
    "prefill_last_token_is_decode",
    "decode_invariant_under_page_permutation",
    "decode_invariant_under_page_size",
    "write_then_attend_is_dense_attention",
    "copy_pages_is_exact",
    "one_plan_serves_every_layer",
    "out_of_range_pages_rejected",
    "unsupported_raises",
    *FEATURE_PROPERTIES,
)


def dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA on contiguous K/V of one sequence, bottom-right causal, fp32 out.

    query [Lq, Hq, D], key/value [Lk, Hkv, D]; GQA by repeat_interleave of K/V heads.
    """
    lq, hq, _ = query.shape
    lk, hkv, _ = key.shape
    k = key.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    v = value.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1), k, v, attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


def decode_of(backend: Backend, t: Built, query: torch.Tensor | None = None) -> torch.Tensor:
    """Plan and run ``backend``'s decode of a built case (``query`` defaults to its own)."""
    plan = backend.plan_decode(t.kv_cache, t.block_table, t.seq_lens)
    return backend.decode(plan, t.decode_query if query is None else query, t.kv_cache, t.scale)


def prefill_of(backend: Backend, t: Built) -> torch.Tensor:
    """Plan and run ``backend``'s prefill of a built case."""
    plan = backend.plan_prefill(t.kv_cache, t.block_table, t.cu_seqlens_q, t.seq_lens)
    return backend.prefill(plan, t.prefill_query, t.kv_cache, t.scale)


class Suite:
    """The conformance properties for one backend on one device.

    ``backend`` is a registered name or an instance; the oracle is always
    :class:`kvcore_torch.TorchBackend` on the same device.
    """

    def __init__(
        self, backend: str | Backend, device: str = "cpu", profile: str | None = None
    ) -> None:
        self.backend = registry.get(backend) if isinstance(backend, str) else backend
        self.oracle = registry.get("torch")
        self.device = torch.device(device)
        self.profile = kc.profile(profile)
        caps = self.backend.capabilities
        if self.device.type not in caps.devices:
            raise Unsupported(f"backend {self.backend.name!r} does not declare {self.device.type}")
        if not kc.dtypes(caps):
            raise Unsupported(f"backend {self.backend.name!r} declares none of {kc.DTYPES}")

    # -- running ------------------------------------------------------------------

    def run(self, name: str) -> str | None:
        """Run one property; raises (AssertionError with the falsifying case) on failure.
        A feature property returns whether it checked the feature ("declared: ...") or
        its refusal ("not declared: ..."); the others return None."""
        if name not in PROPERTIES:
            raise ValueError(f"unknown property {name!r}; one of {PROPERTIES}")
        if name in FEATURE_PROPERTIES:
            return run_feature(self, FEATURE_PROPERTIES[name])
        method: Callable[[], None] = getattr(self, name)
        method()
        return None

    def run_all(self) -> dict[str, BaseException | None]:
        """Every property; the error of each that failed, None for each that passed."""
        results: dict[str, BaseException | None] = {}
        for name in PROPERTIES:
            try:
                self.run(name)
                results[name] = None
            except Exception as exc:
                results[name] = exc
        return results

    def given(self, strategy: st.SearchStrategy[Any], check: Callable[[Any], None]) -> None:
        """Run ``check`` on ``profile.examples`` draws of ``strategy`` (deadline off)."""
        wrapped = settings(
            max_examples=self.profile.examples,
            deadline=None,
            database=None,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.filter_too_much,
                HealthCheck.large_base_example,
            ],
        )(given(strategy)(check))
        wrapped()

    def _cases(self, **kwargs: Any) -> st.SearchStrategy[Case]:
        return kc.case_st(self.profile, self.backend.capabilities, **kwargs)

    def _close(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        case: Case,
        what: str,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        itself: bool = False,
        same_qk: bool = False,
    ) -> None:
        """``actual`` within the derived bound of ``expected``: two fp32 computations of
        ``query`` over ``kv_cache``, the second by the oracle or densely, or (``itself``)
        by this backend again (kernel_cases.tolerance)."""
        dev = self.device.type
        bound = kc.tolerance(
            self.backend.name, dev, case, query, kv_cache, itself=itself, same_qk=same_qk
        )
        assert_close(actual, expected, bound, f"{self.backend.name}: {what} for {case}")

    # -- properties against the oracle ---------------------------------------------

    def decode_matches_oracle(self) -> None:
        def check(case: Case) -> None:
            t = kc.build(case, self.device)
            got, want = decode_of(self.backend, t), decode_of(self.oracle, t)
            self._close(got, want, case, "decode", t.decode_query, t.kv_cache)

        self.given(self._cases(), check)

    def prefill_matches_oracle(self) -> None:
        def check(case: Case) -> None:
            t = kc.build(case, self.device)
            got, want = prefill_of(self.backend, t), prefill_of(self.oracle, t)
            self._close(got, want, case, "prefill", t.prefill_query, t.kv_cache)

        self.given(self._cases(), check)

    def prefill_last_token_is_decode(self) -> None:
        def check(case: Case) -> None:
            t = kc.build(case, self.device)
            prefill = prefill_of(self.backend, t)
            last = t.cu_seqlens_q[1:].long() - 1
            decode = decode_of(self.backend, t, t.prefill_query[last])
            what, query = "prefill's last token vs decode", t.prefill_query[last]
            self._close(prefill[last], decode, case, what, query, t.kv_cache, itself=True)

        self.given(self._cases(), check)

    # -- invariances ----------------------------------------------------------------

    def decode_invariant_under_page_permutation(self) -> None:
        def check(case: Case) -> None:
            t = kc.build(case, self.device)
            num_pages = t.kv_cache.shape[0]
            perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(case.seed))
            perm = perm.to(self.device)
            moved = kc.empty_cache(case, num_pages, self.device)
            moved[perm] = t.kv_cache  # page p now lives at perm[p]
            used = torch.arange(t.block_table.shape[1], device=self.device)[None, :] < (
                (t.seq_lens[:, None].long() + case.page_size - 1) // case.page_size
            )
            table = torch.where(used, perm[t.block_table.long().clamp(0, num_pages - 1)], -1)
            before = decode_of(self.backend, t)
            moved_t = Built(
                **{**_fields(t), "kv_cache": moved, "block_table": table.to(torch.int32)}
            )
            after = decode_of(self.backend, moved_t)
            what = "decode after a page permutation"
            self._close(
                after, before, case, what, t.decode_query, t.kv_cache, itself=True, same_qk=True
            )

        self.given(self._cases(), check)

    def decode_invariant_under_page_size(self) -> None:
        sizes = kc.page_sizes(self.profile, self.backend.capabilities)

        @st.composite
        def pair(draw: st.DrawFn) -> tuple[Case, int]:
            case = draw(self._cases(table_modes=("distinct",)))
            return case, draw(st.sampled_from(sizes))

        def check(drawn: tuple[Case, int]) -> None:
            case, other = drawn
            gen = torch.Generator().manual_seed(case.seed)
            dtype = getattr(torch, case.dtype)
            h, d = case.num_kv_heads, case.head_dim
            kvs = [torch.randn(n, 2, h, d, generator=gen).to(dtype) for n in case.seq_lens]
            query = torch.randn(len(kvs), case.num_q_heads, d, generator=gen).to(dtype)
            seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=self.device)
            outs, caches = [], []
            for ps in (case.page_size, other):
                paged = Case(**{**_fields(case), "page_size": ps})
                table, num_pages = kc.block_table(paged, gen)
                cache = kc.empty_cache(paged, num_pages, self.device)
                for b, kv in enumerate(kvs):
                    slots = kc.token_slots(table[b], kv.shape[0], ps).to(self.device)
                    cache[slots // ps, :, slots % ps] = kv.to(self.device)
                plan = self.backend.plan_decode(cache, table.to(self.device), seq_lens)
                outs.append(self.backend.decode(plan, query.to(self.device), cache, case.scale))
                caches.append(cache)
            what = f"decode at page size {other}"
            self._close(outs[1], outs[0], case, what, query, caches[0], itself=True, same_qk=True)

        self.given(pair(), check)

    # -- write, then attend ---------------------------------------------------------

    def write_then_attend_is_dense_attention(self) -> None:
        def check(case: Case) -> None:
            gen = torch.Generator().manual_seed(case.seed)
            table, num_pages = kc.block_table(case, gen)
            cache = kc.empty_cache(case, num_pages, self.device)
            key, value = self._write_scattered(case, gen, cache, kc.used_slots(case, table))
            query, cu, expected = _dense_reference(case, gen, key, value)
            seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=self.device)
            query = query.to(self.device)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=self.device)
            table_d = table.to(self.device)
            plan = self.backend.plan_prefill(cache, table_d, cu_t, seq_lens)
            out = self.backend.prefill(plan, query, cache, case.scale)
            self._close(out.cpu(), expected, case, "prefill vs dense SDPA", query, cache)
            last = cu_t[1:].long() - 1
            dec_plan = self.backend.plan_decode(cache, table_d, seq_lens)
            dec = self.backend.decode(dec_plan, query[last], cache, case.scale)
            want = expected[last.cpu()]
            self._close(dec.cpu(), want, case, "decode vs dense SDPA", query[last], cache)

        # distinct pages: shared pages would make two sequences write one slot
        self.given(self._cases(table_modes=("distinct",)), check)

    def _write_scattered(
        self, case: Case, gen: torch.Generator, cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """write_kv random K/V rows [len(slots), Hkv, D] into ``slots`` of the NaN
        ``cache``, with skipped rows (slot -1, NaN payload) interleaved and the write
        order shuffled; assert each row is stored exactly and nothing else written.
        Returns the rows (key, value), on the CPU, in ``slots``' order."""
        dtype = getattr(torch, case.dtype)
        h, d = case.num_kv_heads, case.head_dim
        total = slots.numel()
        key = torch.randn(total, h, d, generator=gen).to(dtype)
        value = torch.randn(total, h, d, generator=gen).to(dtype)
        skip = total // 3
        all_slots = torch.cat([slots, torch.full((skip,), -1, dtype=torch.int64)])
        nan = torch.full((skip, h, d), float("nan"), dtype=dtype)
        order = torch.randperm(total + skip, generator=gen)
        write = self.backend.plan_write(cache, all_slots[order].to(self.device))
        self.backend.write_kv(
            write,
            cache,
            torch.cat([key, nan])[order].to(self.device),
            torch.cat([value, nan])[order].to(self.device),
        )
        page = (slots // case.page_size).to(self.device)
        off = (slots % case.page_size).to(self.device)
        assert torch.equal(cache[page, 0, off].cpu(), key), f"write_kv K differs for {case}"
        assert torch.equal(cache[page, 1, off].cpu(), value), f"write_kv V differs for {case}"
        written = 2 * total * h * d
        kept = int((~kc.whole_storage(cache).isnan()).sum())
        assert kept == written, f"write_kv wrote elsewhere: {case}"
        return key, value

    def copy_pages_is_exact(self) -> None:
        @st.composite
        def copies(draw: st.DrawFn) -> tuple[Case, int, int]:
            case = draw(self._cases())
            num_pages = draw(st.integers(2, 24))
            return case, num_pages, draw(st.integers(0, num_pages // 2))

        def check(drawn: tuple[Case, int, int]) -> None:
            case, num_pages, n = drawn
            gen = torch.Generator().manual_seed(case.seed)
            cache = kc.empty_cache(case, num_pages, self.device)
            cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
            perm = torch.randperm(num_pages, generator=gen)
            dst = perm[:n]
            rest = perm[n:]
            src = rest[torch.randint(0, rest.numel(), (n,), generator=gen)]  # may repeat
            expected = cache.clone()
            expected[dst.to(self.device)] = cache[src.to(self.device)]
            plan = self.backend.plan_copy(cache, src.to(self.device), dst.to(self.device))
            self.backend.copy_pages(plan, cache)
            assert torch.equal(cache, expected), f"copy_pages differs for {case} {src=} {dst=}"
            outside = int((~kc.whole_storage(cache).isnan()).sum()) - cache.numel()
            assert outside == 0, f"copy_pages wrote outside the cache for {case} {src=} {dst=}"

        self.given(copies(), check)

    # -- one plan, many layers --------------------------------------------------------

    def one_plan_serves_every_layer(self) -> None:
        @st.composite
        def pair(draw: st.DrawFn) -> tuple[Case, tuple[str, str]]:
            return draw(self._cases()), draw(kc.layout_st(self.backend.capabilities))

        def check(drawn: tuple[Case, tuple[str, str]]) -> None:
            case, (layout, order) = drawn
            t = kc.build(case, self.device)
            # another layer: the same geometry, other strides, other values (NaN kept)
            other = kc.empty_cache(
                Case(**{**_fields(case), "layout": layout, "order": order}),
                t.kv_cache.shape[0],
                self.device,
            )
            other.copy_(t.kv_cache * 0.5)
            layer = Built(**{**_fields(t), "kv_cache": other})
            plan = self.backend.plan_decode(t.kv_cache, t.block_table, t.seq_lens)
            got = self.backend.decode(plan, t.decode_query, other, t.scale)
            want = decode_of(self.backend, layer)
            layout = f"{layout} {order}" if layout == "pool" else layout
            what = f"decode on a {layout} layer"
            self._close(got, want, case, what, t.decode_query, other, itself=True, same_qk=True)
            pplan = self.backend.plan_prefill(t.kv_cache, t.block_table, t.cu_seqlens_q, t.seq_lens)
            got = self.backend.prefill(pplan, t.prefill_query, other, t.scale)
            want = prefill_of(self.backend, layer)
            what = f"prefill on a {layout} layer"
            self._close(got, want, case, what, t.prefill_query, other, itself=True, same_qk=True)

        self.given(pair(), check)

    # -- errors ---------------------------------------------------------------------

    def out_of_range_pages_rejected(self) -> None:
        @st.composite
        def bad(draw: st.DrawFn) -> tuple[Case, int, int]:
            case = draw(self._cases())
            b = draw(st.integers(0, len(case.seq_lens) - 1))
            return case, b, draw(st.integers(0, case.pages_of(case.seq_lens[b]) - 1))

        def check(drawn: tuple[Case, int, int]) -> None:
            case, b, j = drawn
            t = kc.build(case, self.device)
            backend, kv = self.backend, t.kv_cache
            num_pages = kv.shape[0]
            for value in (-1, num_pages, 2**31 - 1):
                table = t.block_table.clone()
                table[b, j] = value
                _expect(BadRequest, backend.plan_decode, (kv, table, t.seq_lens))
                _expect(BadRequest, backend.plan_prefill, (kv, table, t.cu_seqlens_q, t.seq_lens))
            slots = torch.tensor([num_pages * case.page_size], device=self.device)
            _expect(BadRequest, backend.plan_write, (kv, slots))
            _expect(
                BadRequest,
                backend.plan_decode,
                (kv, t.block_table, t.seq_lens),
                "for slots in the step plan",
                slots=slots,
            )
            pages = torch.tensor([num_pages], device=self.device)
            zero = torch.tensor([0], device=self.device)
            _expect(BadRequest, backend.plan_copy, (kv, pages, zero))
            _expect(BadRequest, backend.plan_copy, (kv, zero, pages))
            _expect(
                BadRequest,
                backend.plan_decode,
                (kv, t.block_table, t.seq_lens),
                "for copies in the step plan",
                copies=(pages, zero),
            )

        self.given(bad(), check)

    def unsupported_raises(self) -> None:
        caps = self.backend.capabilities
        dtype, head_dim = kc.dtypes(caps)[0], kc.head_dims(self.profile, caps)[0]
        page_size = kc.page_sizes(self.profile, caps)[0]
        undeclared: list[tuple[str, int, int]] = []
        if "float64" not in caps.dtypes:
            undeclared.append(("float64", head_dim, page_size))
        bad_d = [d for d in (24, 48, 72, 257) if not caps.supports_head_dim(d)]
        bad_ps = [p for p in (6, 9, 129) if not caps.supports_page_size(p)]
        undeclared += [(dtype, d, page_size) for d in bad_d[:1]]
        undeclared += [(dtype, head_dim, p) for p in bad_ps[:1]]
        for dt, d, ps in undeclared:
            what = f"for dtype={dt} head_dim={d} page_size={ps}"
            dev, torch_dtype = self.device, getattr(torch, dt)
            cache = torch.zeros(2, 2, ps, 1, d, dtype=torch_dtype, device=dev)
            table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
            lens = torch.ones(1, dtype=torch.int32, device=dev)
            cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
            slot = torch.zeros(1, dtype=torch.int64, device=dev)
            backend = self.backend
            _expect(Unsupported, backend.plan_decode, (cache, table, lens), what)
            _expect(Unsupported, backend.plan_prefill, (cache, table, cu, lens), what)
            _expect(Unsupported, backend.plan_write, (cache, slot), what)
            _expect(Unsupported, backend.plan_copy, (cache, slot, slot + 1), what)
        if caps.orders is not None:
            self._undeclared_orders_raise(dtype, head_dim, page_size)

    def _undeclared_orders_raise(self, dtype: str, head_dim: int, page_size: int) -> None:
        """A layer of a pool in an order the backend does not declare: Unsupported naming
        the order from every plan, and from every run of a plan made on a declared one."""
        declared = self.backend.capabilities.orders
        assert declared is not None, "only for backends that declare orders"
        caps, dev, backend = self.backend.capabilities, self.device, self.backend
        # every axis longer than 1 (page size too), so the view has exactly one order
        page_size = min([p for p in kc.page_sizes(self.profile, caps) if p > 1] or [page_size])

        def layer(order: str) -> torch.Tensor:
            layout = KVLayout(kc.POOL_LAYERS, 2, head_dim, page_size, dtype, 2, "kv", order)
            return kc.pool_layer(layout, dev).zero_()

        refused = [o for o in ALL_ORDERS if not caps.supports_strides(*_geometry(layer(o)))]
        if not refused:
            return
        good, bad = layer(sorted(declared)[0]), layer(refused[0])
        order = view_order(*_geometry(bad)) or refused[0]  # what the message names
        table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        lens = torch.ones(1, dtype=torch.int32, device=dev)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        slot = torch.zeros(1, dtype=torch.int64, device=dev)
        query = torch.zeros(1, 2, head_dim, dtype=good.dtype, device=dev)
        rows = torch.zeros(1, 2, head_dim, dtype=good.dtype, device=dev)
        decode = backend.plan_decode(good, table, lens)
        prefill = backend.plan_prefill(good, table, cu, lens)
        write, copy = backend.plan_write(good, slot), backend.plan_copy(good, slot, slot + 1)
        calls: list[tuple[str, Callable[[], object]]] = [
            ("plan_decode", lambda: backend.plan_decode(bad, table, lens)),
            ("plan_prefill", lambda: backend.plan_prefill(bad, table, cu, lens)),
            ("plan_write", lambda: backend.plan_write(bad, slot)),
            ("plan_copy", lambda: backend.plan_copy(bad, slot, slot + 1)),
            ("decode", lambda: backend.decode(decode, query, bad, 1.0)),
            ("prefill", lambda: backend.prefill(prefill, query, bad, 1.0)),
            ("write_kv", lambda: backend.write_kv(write, bad, rows, rows)),
            ("copy_pages", lambda: backend.copy_pages(copy, bad)),
        ]
        for name, call in calls:
            try:
                call()
            except Unsupported as exc:
                assert order in str(exc), f"{backend.name}.{name}: {exc} does not name {order!r}"
                continue
            raise AssertionError(f"{backend.name}.{name} ran on order {order!r}, not declared")


def _dense_reference(
    case: Case, gen: torch.Generator, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Random queries for ``case``'s sequences, whose K/V are the rows of ``key`` and
    ``value`` in sequence order: (queries [total_q, Hq, D], cu_seqlens_q, the dense
    attention of each over its own K/V, in the case's dtype), all on the CPU."""
    dtype = getattr(torch, case.dtype)
    queries, expected, start = [], [], 0
    cu = [0]
    for q_len, n in zip(case.q_lens, case.seq_lens, strict=True):
        q = torch.randn(q_len, case.num_q_heads, case.head_dim, generator=gen).to(dtype)
        ref = dense_attention(q, key[start : start + n], value[start : start + n], case.scale)
        queries.append(q)
        expected.append(ref.to(dtype))
        start += n
        cu.append(cu[-1] + q_len)
    return torch.cat(queries), cu, torch.cat(expected)


def _expect(
    error: type[KVCoreError],
    call: Callable[..., object],
    args: tuple[Any, ...],
    what: str = "",
    **kwargs: Any,
) -> None:
    """Assert that ``call(*args, **kwargs)`` raises ``error``."""
    try:
        call(*args, **kwargs)
    except error:
        return
    raise AssertionError(f"expected {error.__name__} {what}".rstrip())


def _geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(t.shape), t.stride()


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in type(obj).__dataclass_fields__}
