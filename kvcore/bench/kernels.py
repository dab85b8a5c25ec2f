"""``kvcore bench kernels``: paged decode / prefill time and KV bandwidth per backend.

All figures of one run are measured in that run, on one device:

* ``copy_GBps``: a large device-to-device copy, counted as bytes read plus bytes
  written per second (the achievable memory bandwidth);
* per backend and operation: ``time_ms`` of the kernel alone (median of
  ``--repeats`` after ``--warmup``; CUDA events on a GPU, perf_counter on a CPU):
  the step's plan (``plan_decode`` / ``plan_prefill``: validation, its one device
  sync, the backend's precomputation) is made once, outside the timed loop, and
  reported apart as ``plan_ms``; ``kv_bytes`` (K and
  V of every context token, read once), ``GBps = kv_bytes / time``,
  ``bw_fraction = GBps / copy_GBps``, and ``paged_over_dense`` = time / time of
  torch SDPA on the same K/V laid out contiguously ([B, Hkv, ctx, D], GQA native);
* ``max_abs_err``: the paged output against that dense output, so a fast
  wrong kernel shows;
* ``orders``: per backend, decode and prefill on a layer of a pool of ``--layers``
  layers in each named order (kvcore.backend.NAMED_ORDERS: layer-major, page-major,
  head-outer, page-major head-outer) holding the same K/V, timed in interleaved
  rounds (one call per order per round), with each order's median ratio to
  layer-major (``over_layer_major``);
* ``features``: each attention variant (window, soft-cap, sinks, fp8 pages, MLA)
  per backend against the torch reference and dense tensors
  (kvcore/bench/kernel_features.py).

Decode: one query per sequence over ``--context`` tokens. Prefill: the last
``--prefill-q`` tokens of each sequence over the rest as a cached prefix
(bottom-right causal; dense uses ``causal_lower_right``). Pages of a sequence
are scattered over the pool in random order, as after real allocation churn.

One layer at one decode step (:func:`layer_decode_times`, on the CPU): one
backend ``decode`` call against one SDPA call over the same K/V laid out dense,
in paired rounds, rows of one length or ragged; ``kvcore bench e2e`` reports it
at the demo model's shapes (its ``layer`` figures).

Defaults: on CUDA the issue's shape (B=64, context 4096, Hq=32, Hkv=8, D=128,
bf16, page 16) and every installed backend that declares cuda; on a CPU a
scaled-down shape and the torch backend. Targets on H100/H200-class GPUs:
triton decode bw_fraction >= 0.80, cupy >= 0.70; paged_over_dense <= 1.10 for
triton decode and prefill and cupy decode (cupy prefill runs on CUDA cores and
torch is the oracle: reported, no target).

The file runs past ~400 lines on purpose: the backend figures and the one-layer
microbenchmark are measured on the same scattered pool and its dense reference
(:class:`_Data`, about a fifth of the file); split, one half would import the
other's internals.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvcore.bench.report import Figure, Target
from kvcore.layout import cdiv

if TYPE_CHECKING:
    import torch

    from kvcore.backend import Backend

# GPU targets (an H100/H200-class device; docs/benchmarks.md): decode bandwidth fraction
# per backend, and paged over dense time for the (backend, op) pairs built to match dense
# kernels (not the torch oracle, not CuPy's CUDA-core prefill).
GPU_BW_TARGETS = {"triton": 0.80, "cupy": 0.70}
GPU_PAGED_OVER_DENSE = 1.10
PAGED_OVER_DENSE_OPS = frozenset({("triton", "decode"), ("triton", "prefill"), ("cupy", "decode")})


def headline(record: dict[str, Any]) -> list[Figure]:
    """Per backend that ran and op: time, bandwidth fraction, paged over dense; the GPU
    targets only on a CUDA device (the CPU shape is scaled down and has none)."""
    gpu = str(record.get("device", "")).startswith("cuda")
    figures = [Figure("copy_GBps", "device copy bandwidth, GB/s")]
    for name, ops in record.get("backends", {}).items():
        if "error" in ops:
            figures.append(Figure(f"backends.{name}.error", f"{name}: not run"))
            continue
        for op in ops:
            key = f"backends.{name}.{op}"
            bw = GPU_BW_TARGETS.get(name) if gpu and op == "decode" else None
            held = gpu and (name, op) in PAGED_OVER_DENSE_OPS
            figures += [
                Figure(f"{key}.time_ms", f"{name} {op}: ms"),
                Figure(
                    f"{key}.bw_fraction",
                    f"{name} {op}: bandwidth / copy bandwidth",
                    None if bw is None else Target(">=", bw),
                ),
                Figure(
                    f"{key}.paged_over_dense",
                    f"{name} {op}: paged / dense time",
                    Target("<=", GPU_PAGED_OVER_DENSE) if held else None,
                ),
            ]
    for name, orders in record.get("orders", {}).items():
        for order, ops in orders.items():
            for op in ops:
                key = f"orders.{name}.{order}.{op}.over_layer_major"
                figures.append(Figure(key, f"{name} {op} on a {order} pool: / layer-major"))
    for feature, entry in record.get("features", {}).items():
        for name, ops in entry.items():
            if name == "dense_ms" or "error" in ops:
                continue
            note = " (interpreted: not a speed figure)" if ops.get("interpreted") else ""
            for op in ("decode", "prefill"):
                key = f"features.{feature}.{name}.{op}"
                figures += [
                    Figure(f"{key}.over_reference", f"{feature} {name} {op}: / reference{note}"),
                    Figure(
                        f"{key}.paged_over_dense", f"{feature} {name} {op}: paged / dense{note}"
                    ),
                ]
    return figures


HEADLINE = headline  # what `kvcore bench kernels` prints without --json


@dataclass(frozen=True, slots=True)
class Shape:
    batch: int
    context: int  # tokens per sequence
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # elements
    page_size: int  # tokens
    dtype: str
    prefill_q: int  # query tokens per sequence in prefill (<= context)


GPU_SHAPE = Shape(64, 4096, 32, 8, 128, 16, "bfloat16", 512)
CPU_SHAPE = Shape(4, 1024, 8, 2, 64, 16, "float32", 64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        action="append",
        default=None,
        metavar="NAME",
        help="backend to time (repeatable; default: torch on cpu, all on cuda)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    for name, help_text in (
        ("batch", "sequences"),
        ("context", "tokens per sequence"),
        ("hq", "query heads"),
        ("hkv", "kv heads"),
        ("head-dim", "elements"),
        ("page-size", "tokens per page"),
        ("prefill-q", "prefill queries"),
    ):
        parser.add_argument(
            f"--{name}", type=int, default=None, help=f"{help_text} (default: the shape set's)"
        )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="element type (default: the shape set's)",
    )
    parser.add_argument("--layers", type=int, default=4, help="layers of the order pools")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls (median)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvcore import backend as registry

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    shape = Shape(
        batch=args.batch or base.batch,
        context=args.context or base.context,
        num_q_heads=args.hq or base.num_q_heads,
        num_kv_heads=args.hkv or base.num_kv_heads,
        head_dim=args.head_dim or base.head_dim,
        page_size=args.page_size or base.page_size,
        dtype=args.dtype or base.dtype,
        prefill_q=min(args.prefill_q or base.prefill_q, args.context or base.context),
    )
    names = args.backend or (registry.available() if device.type == "cuda" else ["torch"])
    timer = _Timer(device, args.warmup, args.repeats)
    data = _Data.make(shape, device)

    copy_s = _copy_seconds(timer, data.kv_bytes, device)
    copy_gbps = 2 * _copy_bytes(data.kv_bytes) / copy_s / 1e9
    dense = {
        "decode": timer(lambda: data.dense_decode()),
        "prefill": timer(lambda: data.dense_prefill()),
    }
    result: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": asdict(shape),
        "kv_bytes": data.kv_bytes,
        "copy_GBps": copy_gbps,
        "dense_ms": {op: s * 1e3 for op, s in dense.items()},
        "backends": {},
    }
    for name in names:
        try:
            backend = registry.get(name)
            backend.check_supported(data.kv_cache)
        except Exception as exc:  # a backend that cannot run here is reported, not fatal
            result["backends"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        result["backends"][name] = {
            op: {
                **_figures(seconds, err, data.kv_bytes, copy_gbps, dense[op]),
                "plan_ms": plan_s * 1e3,
            }
            for op, (seconds, err, plan_s) in _time_backend(backend, data, timer).items()
        }
    result["orders"] = {
        name: _time_orders(registry.get(name), data, args.layers, timer)
        for name, ops in result["backends"].items()
        if "error" not in ops
    }
    from kvcore.bench import kernel_features

    dims = {
        "batch": shape.batch,
        "context": shape.context,
        "hq": shape.num_q_heads,
        "hkv": shape.num_kv_heads,
        "dim": shape.head_dim,
        "page": shape.page_size,
        "prefill_q": shape.prefill_q,
    }
    result["features"] = kernel_features.measure(names, dims, device, timer)
    return result


def _figures(
    seconds: float, err: float, kv_bytes: int, copy_gbps: float, dense_s: float
) -> dict[str, float]:
    gbps = kv_bytes / seconds / 1e9
    return {
        "time_ms": seconds * 1e3,
        "GBps": gbps,
        "bw_fraction": gbps / copy_gbps,
        "paged_over_dense": seconds / dense_s,
        "max_abs_err": err,
    }


def _time_backend(
    backend: Backend, data: _Data, timer: _Timer
) -> dict[str, tuple[float, float, float]]:
    """Per op: (kernel seconds, max abs error against dense, plan seconds)."""
    out: dict[str, tuple[float, float, float]] = {}
    decode = backend.plan_decode(data.kv_cache, data.block_table, data.seq_lens)
    prefill = backend.plan_prefill(
        data.kv_cache, data.block_table, data.cu_seqlens_q, data.seq_lens
    )
    ops: list[
        tuple[str, Callable[[], object], Callable[[], torch.Tensor], Callable[[], torch.Tensor]]
    ] = [
        (
            "decode",
            lambda: backend.plan_decode(data.kv_cache, data.block_table, data.seq_lens),
            lambda: backend.decode(decode, data.q_decode, data.kv_cache, data.scale),
            data.dense_decode,
        ),
        (
            "prefill",
            lambda: backend.plan_prefill(
                data.kv_cache, data.block_table, data.cu_seqlens_q, data.seq_lens
            ),
            lambda: backend.prefill(prefill, data.q_prefill, data.kv_cache, data.scale),
            data.dense_prefill,
        ),
    ]
    for op, plan, call, ref in ops:
        err = float((call().float() - ref().float()).abs().max())
        out[op] = (timer(call), err, timer(plan))
    return out


def _time_orders(
    backend: Backend, data: _Data, layers: int, timer: _Timer
) -> dict[str, dict[str, dict[str, float]]]:
    """Per named order and op: the median ``time_ms`` of one call and the median over
    rounds of its ratio to layer-major's call in the same round (interleaved, so drift
    of the machine hits every order alike). Every layer of each pool holds the same
    K/V; the middle layer is timed."""
    import torch

    from kvcore.backend import NAMED_ORDERS
    from kvcore.layout import KVLayout

    s = data.shape
    calls: dict[str, dict[str, Callable[[], object]]] = {}
    for order in NAMED_ORDERS:
        layout = KVLayout(
            layers, s.num_kv_heads, s.head_dim, s.page_size, s.dtype,
            data.kv_cache.shape[0], "kv", order,
        )  # fmt: skip
        pool = torch.empty(layout.total_bytes, dtype=torch.uint8, device=data.kv_cache.device)
        views = layout.layer_views(pool)
        for view in views:
            view.copy_(data.kv_cache)
        kv = views[layers // 2]
        decode = backend.plan_decode(kv, data.block_table, data.seq_lens)
        prefill = backend.plan_prefill(kv, data.block_table, data.cu_seqlens_q, data.seq_lens)
        calls[order] = {
            "decode": functools.partial(backend.decode, decode, data.q_decode, kv, data.scale),
            "prefill": functools.partial(backend.prefill, prefill, data.q_prefill, kv, data.scale),
        }
    one = _Timer(timer.device, 0, 1)
    samples: dict[str, dict[str, list[float]]] = {o: {"decode": [], "prefill": []} for o in calls}
    for _ in range(timer.warmup):
        for ops in calls.values():
            for fn in ops.values():
                fn()
    for _ in range(timer.repeats):
        for order, ops in calls.items():
            for op, fn in ops.items():
                samples[order][op].append(one(fn))
    base = samples[NAMED_ORDERS[0]]
    return {
        order: {
            op: {
                "time_ms": statistics.median(times) * 1e3,
                "over_layer_major": statistics.median(
                    t / b for t, b in zip(times, base[op], strict=True)
                ),
            }
            for op, times in ops.items()
        }
        for order, ops in samples.items()
    }


class _Timer:
    """Median seconds of ``repeats`` calls after ``warmup`` calls."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, max(0, warmup), max(1, repeats)

    def __call__(self, fn: Callable[[], object]) -> float:
        import torch

        for _ in range(self.warmup):
            fn()
        samples: list[float] = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)


# -- one layer at one decode step (the layer figures of `kvcore bench e2e`) ---------------


@dataclass(frozen=True, slots=True)
class LayerTimes:
    """One layer's attention at one decode step: microseconds per call (medians)."""

    decode_us: float  # the backend's decode call
    sdpa_us: float  # one SDPA call over the same K/V laid out dense
    decode_over_sdpa: float  # median over paired rounds of the per-round ratio


def layer_decode_times(
    backend: Backend, shape: Shape, lengths: Sequence[int], calls: int, rounds: int
) -> LayerTimes:
    """One ``backend.decode`` call on the CPU against one SDPA call over the same K/V
    laid out dense (masked past each row's length when ``lengths`` differ), in paired
    rounds: ``calls`` decode calls, then ``calls`` SDPA calls, ``rounds`` times. The
    step's plan (validation, the one device sync) is made once, untimed, as a model
    makes it once per step for all its layers."""
    import torch

    data = _Data.make(shape, torch.device("cpu"), lengths)
    plan = backend.plan_decode(data.kv_cache, data.block_table, data.seq_lens)

    def decode() -> object:
        return backend.decode(plan, data.q_decode, data.kv_cache, data.scale)

    calls = max(1, calls)
    decode(), data.dense_decode()  # warm up
    decode_s: list[float] = []  # seconds per call, one entry per round
    sdpa_s: list[float] = []
    for _ in range(max(1, rounds)):
        for fn, samples in ((decode, decode_s), (data.dense_decode, sdpa_s)):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls)
    return LayerTimes(
        decode_us=statistics.median(decode_s) * 1e6,
        sdpa_us=statistics.median(sdpa_s) * 1e6,
        decode_over_sdpa=statistics.median(d / s for d, s in zip(decode_s, sdpa_s, strict=True)),
    )


def _copy_bytes(kv_bytes: int) -> int:
    """Size of the copy that measures bandwidth: at least 256 MiB, so caches do not help."""
    return max(256 << 20, kv_bytes)


def _copy_seconds(timer: _Timer, kv_bytes: int, device: torch.device) -> float:
    import torch

    n = _copy_bytes(kv_bytes)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


@dataclass(slots=True)
class _Data:
    """Paged and dense copies of the same K/V, and the queries. Rows are
    ``shape.context`` tokens long, or as long as ``lengths`` says (decode only:
    the dense side is then masked past each row's length, as transformers masks a
    padded batch); a row's pages are scattered over the pool in random order."""

    shape: Shape
    kv_cache: torch.Tensor  # [num_pages, 2, page_size, Hkv, D]
    block_table: torch.Tensor  # [B, pages per sequence] int32
    seq_lens: torch.Tensor  # [B] int32, tokens
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    dense_k: torch.Tensor  # [B, Hkv, ctx, D]
    dense_v: torch.Tensor
    mask: torch.Tensor | None  # [B, 1, 1, ctx] bool, a row's tokens; None: every row is full
    q_decode: torch.Tensor  # [B, Hq, D]
    q_prefill: torch.Tensor  # [B * prefill_q, Hq, D]
    kv_bytes: int  # K and V of every row's tokens

    @classmethod
    def make(cls, s: Shape, device: torch.device, lengths: Sequence[int] = ()) -> _Data:
        """Random data of shape ``s``; ``lengths``: tokens per row, the longest
        ``s.context`` (default: every row ``s.context``)."""
        import torch

        lens = list(lengths) or [s.context] * s.batch
        assert len(lens) == s.batch and max(lens) == s.context, f"{lens} for {s}"
        dtype = getattr(torch, s.dtype)
        per_seq = cdiv(s.context, s.page_size)
        num_pages = s.batch * per_seq
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(size, generator=gen, device=device, dtype=dtype)

        kv = randn(num_pages, 2, s.page_size, s.num_kv_heads, s.head_dim)
        perm = torch.randperm(num_pages, generator=gen, device=device)
        table = perm.view(s.batch, per_seq).to(torch.int32)
        tokens = kv[table.long()]  # [B, per_seq, 2, page, Hkv, D]
        tokens = tokens.permute(0, 2, 4, 1, 3, 5).reshape(
            s.batch, 2, s.num_kv_heads, per_seq * s.page_size, s.head_dim
        )[:, :, :, : s.context]
        hq, d = s.num_q_heads, s.head_dim
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        valid = torch.arange(s.context, device=device) < seq_lens[:, None]  # [B, ctx]
        return cls(
            shape=s,
            kv_cache=kv,
            block_table=table,
            seq_lens=seq_lens,
            cu_seqlens_q=torch.arange(s.batch + 1, dtype=torch.int32, device=device) * s.prefill_q,
            dense_k=tokens[:, 0].contiguous(),
            dense_v=tokens[:, 1].contiguous(),
            mask=None if min(lens) == s.context else valid[:, None, None, :],
            q_decode=randn(s.batch, hq, d),
            q_prefill=randn(s.batch * s.prefill_q, hq, d),
            kv_bytes=2 * sum(lens) * s.num_kv_heads * d * kv.element_size(),
        )

    @property
    def scale(self) -> float:
        return float(self.shape.head_dim**-0.5)

    def dense_decode(self) -> torch.Tensor:
        """SDPA over contiguous K/V, masked past a ragged row's length: [B, Hq, 1, D] ->
        [B, Hq, D]."""
        import torch.nn.functional as F

        q = self.q_decode.unsqueeze(2)
        out = F.scaled_dot_product_attention(
            q, self.dense_k, self.dense_v, attn_mask=self.mask, scale=self.scale, enable_gqa=True
        )
        return out.squeeze(2)

    def dense_prefill(self) -> torch.Tensor:
        """SDPA, bottom-right causal, over contiguous K/V -> [B * prefill_q, Hq, D]."""
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        s = self.shape
        assert self.mask is None, "dense_prefill: rows of one length only"
        q = self.q_prefill.view(s.batch, s.prefill_q, s.num_q_heads, s.head_dim).transpose(1, 2)
        mask = causal_lower_right(s.prefill_q, s.context)
        out = F.scaled_dot_product_attention(
            q, self.dense_k, self.dense_v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(-1, s.num_q_heads, s.head_dim)
