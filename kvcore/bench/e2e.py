"""``kvcore bench e2e``: transformers generate() with the kvcore cache vs DynamicCache.

Same run, same model (kvcore.demo_model, the demo model), same
prompts. A daemon is started with a host pool that fits the model (or
``--endpoint`` names one whose pool ``--pool`` fits it).

* Decode, two workloads, each run by three caches on the same prompts
  (bench/generation.py):
  DynamicCache, KVCoreCache and transformers' own paged cache (continuous
  batching: ``model.generate_batch`` with ``ContinuousBatchingConfig(page_size)``,
  the pool's page size, every prompt in one prefill batch):

  - even: ``--batch`` rows of ``--prompt-tokens`` tokens;
  - ragged: ``--ragged-batch`` rows whose lengths are spread evenly over
    ``--ragged-min .. --ragged-max`` tokens, left-padded for generate().

  ``--new-tokens`` greedy tokens per row. generate() runs stamp every step with
  a logits processor, continuous batching stamps every token; decode tokens/s
  is the tokens stamped after the last row's first token over the time from
  that stamp to the last (``rows * (steps - 1) / (last - first)``), so the
  prefill is excluded. Fresh prompts every repeat (no prefix hits). Each run's
  new tokens are compared row by row with DynamicCache's (``*_rows_equal`` of
  ``rows_compared``; ``*_tokens_match``: all equal). A left-padded DynamicCache
  row is not bit-identical to the row run alone, so on the ragged batch a near
  tie can flip a token there and not in the two paged caches (which read no
  padding); ``kvcore_rows_equal_hf_paged`` compares those two.
* Time to first token (TTFT): prompts of ``--ttft-tokens`` tokens whose leading
  ``--cached-fraction`` (rounded down to whole pages) was committed by an
  earlier request, against cold prompts of the same length, both through the
  kvcore cache; start of generate() to the first step's stamp.
* Per-layer decode (bench/kernels.py's :func:`~kvcore.bench.kernels.layer_decode_times`):
  one backend ``decode(plan, query, kv_cache, scale)`` call (the plan made once,
  outside the timed loop, as a model makes it once per step for all its layers)
  against one ``scaled_dot_product_attention`` call over dense K/V, at the demo
  model's heads and the even workload's batch and mean decode context
  (``prompt + new_tokens // 2``); the ragged batch's too, its SDPA masked as
  transformers masks a left-padded batch. Median over ``--layer-rounds`` paired
  rounds of ``--layer-calls`` calls, microseconds.

Each repeat runs every measurement back to back (paired: a change in machine
load hits both sides of a ratio alike); a ratio is the median over repeats of
the per-repeat ratio against DynamicCache, absolute figures are medians too.
Targets on CPU with the torch backend (:data:`TARGETS`): even decode >= 0.8,
ragged decode >= 0.85, TTFT cached/cold <= 0.5, decode layer / SDPA <= 2.0, and
kvcore ahead of transformers' paged cache on both workloads.
``--json`` prints the full record, otherwise a table of the headline figures.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvcore.bench import report
from kvcore.bench.generation import hf_paged_generate, rows_equal, timed_generate
from kvcore.bench.report import Figure

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from kvcore.client import Client
    from kvcore.demo_model import TinyLlama


@dataclass(frozen=True, slots=True)
class Target:
    """A bound on one top-level figure of the record: ``figure >= bound`` (at_least) or
    ``figure <= bound``."""

    key: str
    at_least: bool
    bound: float

    @property
    def name(self) -> str:
        return f"{self.key} {'>=' if self.at_least else '<='} {self.bound:g}"

    def met(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound


TARGETS = (
    Target("decode_tps_ratio", True, 0.8),
    Target("ragged_decode_tps_ratio", True, 0.85),
    Target("ttft_cached_ratio", False, 0.5),
    Target("decode_layer_over_sdpa", False, 2.0),
    Target("kvcore_over_hf_paged", True, 1.0),  # kvcore ahead of transformers' paged cache
    Target("ragged_kvcore_over_hf_paged", True, 1.0),
)
HEADLINE = (  # what `kvcore bench e2e` prints without --json (docs/benchmarks.md)
    *(Figure(t.key, target=report.Target(">=" if t.at_least else "<=", t.bound)) for t in TARGETS),
    Figure("hf_paged_decode_tps_ratio"),
    Figure("ragged_hf_paged_decode_tps_ratio"),
    Figure("decode_layer_us", "one decode layer, µs"),
    Figure("sdpa_layer_us", "SDPA on the same K/V, µs"),
    Figure("decode.kvcore_tokens_per_s", "even batch: kvcore tokens / s"),
    Figure("decode.dynamic_cache_tokens_per_s", "even batch: DynamicCache tokens / s"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="attach to this daemon instead of starting one")
    parser.add_argument("--pool", default="default", help="pool name (default: default)")
    parser.add_argument("--backend", default="torch", help="kernel backend (default: torch)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="model and cache element type",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--batch", type=int, default=1, help="rows of the even batch (default 1)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="even batch prompt length")
    parser.add_argument("--ragged-batch", type=int, default=8, help="rows of the ragged batch")
    parser.add_argument("--ragged-min", type=int, default=128, help="shortest ragged prompt")
    parser.add_argument("--ragged-max", type=int, default=384, help="longest ragged prompt")
    parser.add_argument(
        "--new-tokens", type=int, default=64, help="tokens generated per decode run"
    )
    parser.add_argument("--ttft-tokens", type=int, default=256, help="TTFT prompt length")
    parser.add_argument(
        "--cached-fraction",
        type=float,
        default=0.75,
        help="share of the TTFT prompt already cached (default 0.75)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="runs per figure (median)")
    parser.add_argument("--layer-calls", type=int, default=200, help="calls per timed round")
    parser.add_argument("--layer-rounds", type=int, default=15, help="rounds per layer figure")
    parser.add_argument("--hidden-size", type=int, help="model width (default: the demo model's)")
    parser.add_argument("--layers", type=int, help="model layers (default: the demo model's)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: steady on a busy machine)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The full record (without ``--json``, ``kvcore bench`` prints its HEADLINE)."""
    return measure(args)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model, start (or attach to) a daemon and measure: the full record."""
    import torch

    from kvcore.client import Client
    from kvcore.daemon_process import DaemonProcess

    torch.set_num_threads(args.threads)
    spec = _spec(args)
    model = spec.build(args.dtype)
    if args.endpoint:
        with Client.connect(args.endpoint, pool=args.pool, namespace="bench-e2e") as client:
            return _measure(args, spec, model, client)
    flag = spec.pool_flag(dtype=args.dtype, page_size=args.page_size, num_pages=4096)
    with DaemonProcess.private("--pool", flag) as daemon:
        client = Client.connect(daemon.endpoint, namespace="bench-e2e")
        try:
            return _measure(args, spec, model, client)
        finally:
            client.close()


# -- the workloads ---------------------------------------------------------------------


@dataclass(slots=True)
class Workload:
    """One decode workload and its per-repeat figures (appended by :func:`_measure`)."""

    lengths: list[int]  # prompt tokens per row
    dynamic: list[float] = field(default_factory=list)  # tokens/s per repeat
    kvcore: list[float] = field(default_factory=list)
    hf_paged: list[float] = field(default_factory=list)
    kvcore_equal: list[int] = field(default_factory=list)  # rows whose tokens == DynamicCache's
    hf_paged_equal: list[int] = field(default_factory=list)
    kvcore_equal_hf_paged: list[int] = field(default_factory=list)  # rows kvcore == hf paged

    @property
    def rows_compared(self) -> int:
        """Rows compared over all repeats."""
        return len(self.lengths) * len(self.dynamic)

    def ratio(self, figures: list[float]) -> float:
        """Median over repeats of ``figures`` / DynamicCache tokens/s."""
        return statistics.median(f / d for f, d in zip(figures, self.dynamic, strict=True))

    def record(self, new_tokens: int) -> dict[str, Any]:
        return {
            "kvcore_tokens_per_s": statistics.median(self.kvcore),
            "dynamic_cache_tokens_per_s": statistics.median(self.dynamic),
            "hf_paged_tokens_per_s": statistics.median(self.hf_paged),
            "kvcore_over_hf_paged": statistics.median(
                k / h for k, h in zip(self.kvcore, self.hf_paged, strict=True)
            ),
            "kvcore_tokens_match": sum(self.kvcore_equal) == self.rows_compared,
            "hf_paged_tokens_match": sum(self.hf_paged_equal) == self.rows_compared,
            "kvcore_rows_equal": sum(self.kvcore_equal),
            "hf_paged_rows_equal": sum(self.hf_paged_equal),
            "kvcore_rows_equal_hf_paged": sum(self.kvcore_equal_hf_paged),
            "rows_compared": self.rows_compared,
            "batch": len(self.lengths),
            "prompt_tokens": self.lengths if len(set(self.lengths)) > 1 else self.lengths[0],
            "new_tokens": new_tokens,
        }


def spread(low: int, high: int, count: int) -> list[int]:
    """``count`` lengths spread evenly over ``low .. high`` tokens, both ends included."""
    if count == 1:
        return [low]
    return [low + (high - low) * i // (count - 1) for i in range(count)]


# -- the measurement --------------------------------------------------------------------


def _spec(args: argparse.Namespace) -> TinyLlama:
    from kvcore.demo_model import TinyLlama

    spec = TinyLlama()
    if args.hidden_size:  # keep head_dim 64 and the 2:1 GQA ratio; MLP 2x wide
        heads = max(args.hidden_size // 64, 2)
        spec = replace(
            spec,
            hidden_size=args.hidden_size,
            num_heads=heads,
            num_kv_heads=max(heads // 2, 1),
            intermediate_size=2 * args.hidden_size,
        )
    if args.layers:
        spec = replace(spec, num_layers=args.layers)
    return spec


def _measure(
    args: argparse.Namespace, spec: TinyLlama, model: LlamaForCausalLM, client: Client
) -> dict[str, Any]:
    from transformers import DynamicCache

    from kvcore.demo_model import timed_greedy
    from kvcore.integrations.transformers import KVCoreCache

    page_size = client.layout.page_size
    seed = iter(range(10_000, 1_000_000))
    even = Workload([args.prompt_tokens] * args.batch)
    ragged = Workload(spread(args.ragged_min, args.ragged_max, args.ragged_batch))

    def decode(work: Workload) -> None:
        """One repeat of a workload: the same fresh prompts through the three caches."""
        rows = [spec.prompt(n, next(seed)) for n in work.lengths]
        dynamic = timed_generate(model, rows, args.new_tokens, DynamicCache())
        with KVCoreCache(client, model, backend=args.backend) as cache:
            kvcore = timed_generate(model, rows, args.new_tokens, cache)
        hf_paged = hf_paged_generate(model, rows, args.new_tokens, page_size)
        work.dynamic.append(dynamic.tokens_per_s)
        work.kvcore.append(kvcore.tokens_per_s)
        work.hf_paged.append(hf_paged.tokens_per_s)
        work.kvcore_equal.append(rows_equal(kvcore.tokens, dynamic.tokens))
        work.hf_paged_equal.append(rows_equal(hf_paged.tokens, dynamic.tokens))
        work.kvcore_equal_hf_paged.append(rows_equal(kvcore.tokens, hf_paged.tokens))

    num_cached = int(args.ttft_tokens * args.cached_fraction) // page_size * page_size

    def ttft(cached: bool) -> float:
        prompt = spec.prompt(args.ttft_tokens, next(seed))
        if cached:  # an earlier request commits the shared prefix (one extra token: full pages)
            with KVCoreCache(client, model, backend=args.backend) as cache:
                timed_greedy(model, [prompt[: num_cached + 1]], 1, cache)
        with KVCoreCache(client, model, backend=args.backend) as cache:
            _, stamps = timed_greedy(model, [prompt], 1, cache)
            assert cache.num_cached_tokens == (num_cached if cached else 0), cache.num_cached_tokens
        return stamps[1] - stamps[0]

    for work in (Workload(even.lengths), Workload(ragged.lengths)):
        decode(work)  # warm up every path on both shapes; figures discarded
    cold, warm = [], []
    for _ in range(args.repeats):
        decode(even)
        decode(ragged)
        cold.append(ttft(False))
        warm.append(ttft(True))
    layer = _layer_record(args, spec, page_size, even.lengths, ragged.lengths)
    return _record(args, spec, client, even, ragged, (cold, warm), layer, num_cached)


def _record(
    args: argparse.Namespace,
    spec: TinyLlama,
    client: Client,
    even: Workload,
    ragged: Workload,
    ttft: tuple[list[float], list[float]],
    layer: dict[str, Any],
    num_cached: int,
) -> dict[str, Any]:
    cold, warm = ttft
    even_record, ragged_record = even.record(args.new_tokens), ragged.record(args.new_tokens)
    record: dict[str, Any] = {
        "decode_tps_ratio": even.ratio(even.kvcore),
        "hf_paged_decode_tps_ratio": even.ratio(even.hf_paged),
        "ragged_decode_tps_ratio": ragged.ratio(ragged.kvcore),
        "ragged_hf_paged_decode_tps_ratio": ragged.ratio(ragged.hf_paged),
        "kvcore_over_hf_paged": even_record["kvcore_over_hf_paged"],
        "ragged_kvcore_over_hf_paged": ragged_record["kvcore_over_hf_paged"],
        "ttft_cached_ratio": statistics.median(w / c for w, c in zip(warm, cold, strict=True)),
        "decode_layer_us": layer["decode_us"],
        "sdpa_layer_us": layer["sdpa_us"],
        "decode_layer_over_sdpa": layer["decode_over_sdpa"],
        "decode": even_record,
        "ragged": ragged_record,
        "ttft": {
            "cached_ms": statistics.median(warm) * 1e3,
            "cold_ms": statistics.median(cold) * 1e3,
            "prompt_tokens": args.ttft_tokens,
            "cached_tokens": num_cached,
        },
        "layer": layer,
        "setup": {
            "backend": args.backend,
            "dtype": args.dtype,
            "page_size": client.layout.page_size,
            "threads": args.threads,
            "repeats": args.repeats,
            "model": (
                f"llama {spec.num_layers} layers, hidden {spec.hidden_size}, "
                f"{spec.num_heads} q / {spec.num_kv_heads} kv heads"
            ),
        },
        "pool_hit_rate": client.stats().hit_rate,
    }
    met = {t.name: t.met(record[t.key]) for t in TARGETS}
    record["targets"] = {name: "met" if ok else "not met" for name, ok in met.items()}
    record["targets_met"] = all(met.values())
    return record


def _layer_record(
    args: argparse.Namespace, spec: TinyLlama, page_size: int, even: list[int], ragged: list[int]
) -> dict[str, Any]:
    """One layer's decode against one SDPA call (bench/kernels.py's
    :func:`~kvcore.bench.kernels.layer_decode_times`) at the mean decode context of
    each workload: prompt + ``new_tokens // 2``."""
    from kvcore import backend as backends
    from kvcore.bench.kernels import Shape, layer_decode_times

    backend = backends.get(args.backend)
    mid = args.new_tokens // 2  # the mean context of a decode step is prompt + mid
    shapes = {"": [n + mid for n in even], "ragged_": [n + mid for n in ragged]}
    record: dict[str, Any] = {
        "api": "decode(plan, ...); plan_decode once, not timed",
        "backend": args.backend,
        "batch": len(even),
        "context": even[0] + mid,
        "ragged_context": shapes["ragged_"],
    }
    for prefix, lengths in shapes.items():
        shape = Shape(
            batch=len(lengths),
            context=max(lengths),
            num_q_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            page_size=page_size,
            dtype=args.dtype,
            prefill_q=1,  # not timed here
        )
        times = layer_decode_times(backend, shape, lengths, args.layer_calls, args.layer_rounds)
        record[f"{prefix}decode_us"] = times.decode_us
        record[f"{prefix}sdpa_us"] = times.sdpa_us
        record[f"{prefix}decode_over_sdpa"] = times.decode_over_sdpa
    return record
