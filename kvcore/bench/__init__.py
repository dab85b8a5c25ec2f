"""``kvcore bench NAME``: one module per benchmark, each with ``add_arguments``
and ``run(args) -> dict`` (a flat-ish JSON object of figures).

``--json`` prints that object; otherwise the module's ``HEADLINE`` figures (a
tuple of :class:`~kvcore.bench.report.Figure`, or a function of the record
returning one) are shown with their targets, met or not (kvcore/bench/report.py).
Either way, a required target missed (correctness: the outputs it compares
differ) makes the command exit 1, naming it on stderr.
Ratios are measured against a baseline run in the same process, never against a
number recorded elsewhere. Modules not named in :data:`BENCHMARKS` are helpers
(report, simulate, chat_trace, block_trace, block_workloads, minimal_cache,
generation, ...).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from kvcore.bench.report import print_report, unmet

BENCHMARKS: dict[str, str] = {
    "capacity": "pool capacity: contiguous vs paged vs paged + shared prefix cache",
    "ops": "in-process Manager throughput on the capacity trace",
    "rpc": "daemon round-trip latency against a raw ZeroMQ echo",
    "kernels": "paged decode/prefill time and bandwidth per backend",
    "e2e": "transformers generate() with the kvcore cache vs DynamicCache",
    "load": "N client processes of random operations with page markers (clobbers, p99, RSS)",
    "vllm": "two vLLM instances sharing kvcore: shared prefix, no hit, RAG, chat; vLLM's prefix cache on and off",
    "tiers": "hit rates with host/disk tiers below the pool; promotion bandwidth; remote fetch",
    "trace": "hit rates on a request trace per eviction policy, beside LRU and the offline optimum",
    "sglang": "SGLang's HiCache storage calls on kvcore vs a plain host store, pages/s (needs SGLang)",
    "serve": "vLLM's OpenAI servers driven by `vllm bench serve` and a chat client, with/without kvcore",
    "restart": "a pool kept across daemon restarts: re-adopt time, restart pause, index cost",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        try:
            module = importlib.import_module(f"kvcore.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kvcore.bench.{name}":
                continue  # not in this build yet
            raise
        bench = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=parser.formatter_class
        )
        bench.add_argument("--json", action="store_true", help="print one JSON object")
        module.add_arguments(bench)
        bench.set_defaults(_run=module.run)


def main(args: argparse.Namespace) -> int:
    result: dict[str, Any] = args._run(args)
    title = f"kvcore bench {args.benchmark}"
    headline = getattr(importlib.import_module(f"kvcore.bench.{args.benchmark}"), "HEADLINE", None)
    if callable(headline):
        headline = headline(result)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=False))
    elif headline is None:  # a benchmark that names no headline yet: every figure
        print_table(title, result)
    else:
        print_report(title, result, headline)
    failed = unmet(result, headline or ())
    for line in failed:
        print(f"{title}: FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


def print_table(title: str, result: dict[str, Any]) -> None:
    """Render a result object as a two-column table; nested objects get dotted keys."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in _flatten(result):
        table.add_row(key, _fmt(value))
    Console().print(table)


def _flatten(obj: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_flatten(value, name + "."))
        else:
            rows.append((name, value))
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
