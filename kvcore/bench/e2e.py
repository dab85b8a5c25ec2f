"""``kvcore bench e2e``: transformers generate() with the kvcore cache vs DynamicCache.

Same run, same model (kvcore.integrations.tiny_llama, the demo model), same
prompts. A daemon is started with a host pool that fits the model (or
``--endpoint`` names one whose pool ``--pool`` fits it).

* Decode: ``--batch`` rows of ``--prompt-tokens`` tokens, ``--new-tokens`` greedy
  tokens. A logits processor stamps the time of every step; decode tokens/s is
  ``batch * (steps - 1) / (last stamp - first stamp)``, so the prefill is
  excluded. Median over ``--repeats`` runs with fresh prompts (no prefix hits).
* Time to first token (TTFT): prompts of ``--ttft-tokens`` tokens whose leading
  ``--cached-fraction`` (rounded down to whole pages) was committed by an
  earlier request, against cold prompts of the same length, both through the
  kvcore cache; start of generate() to the first step's stamp.

Each repeat runs all four measurements back to back; ``decode_tps_ratio`` is
the median over repeats of kvcore / DynamicCache tokens/s, ``ttft_cached_ratio``
the median of cached / cold TTFT (the absolute figures are medians too).
Targets on CPU with the torch backend: >= 0.8 and <= 0.5.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from kvcore.client import Client
    from kvcore.integrations.tiny_llama import TinyLlama


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="attach to this daemon instead of starting one")
    parser.add_argument("--pool", default="default", help="pool name (default: default)")
    parser.add_argument("--backend", default="torch", help="kernel backend (default: torch)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--batch", type=int, default=1, help="rows per decode run (default 1)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="decode prompt length")
    parser.add_argument(
        "--new-tokens", type=int, default=64, help="tokens generated per decode run"
    )
    parser.add_argument("--ttft-tokens", type=int, default=256, help="TTFT prompt length")
    parser.add_argument("--cached-fraction", type=float, default=0.75,
                        help="share of the TTFT prompt already cached (default 0.75)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=7, help="runs per figure (median)")
    parser.add_argument("--hidden-size", type=int, help="model width (default: the demo model's)")
    parser.add_argument("--layers", type=int, help="model layers (default: the demo model's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: steady on a busy machine)")  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvcore.client import Client
    from kvcore.daemon_process import DaemonProcess
    from kvcore.integrations.tiny_llama import TinyLlama

    torch.set_num_threads(args.threads)
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


def _measure(args: argparse.Namespace, spec: TinyLlama, model: LlamaForCausalLM,
             client: Client) -> dict[str, Any]:  # fmt: skip
    from transformers import DynamicCache

    from kvcore.integrations.tiny_llama import timed_greedy
    from kvcore.integrations.transformers import KVCoreCache

    page_size = client.layout.page_size
    seed = iter(range(10_000, 1_000_000))

    def decode_tps(use_kvcore: bool) -> float:
        rows = [spec.prompt(args.prompt_tokens, next(seed)) for _ in range(args.batch)]
        if use_kvcore:
            with KVCoreCache(client, model, backend=args.backend) as cache:
                _, stamps = timed_greedy(model, rows, args.new_tokens, cache)
        else:
            _, stamps = timed_greedy(model, rows, args.new_tokens, DynamicCache())
        return float(args.batch * (len(stamps) - 2) / (stamps[-1] - stamps[1]))

    def ttft(cached: bool) -> float:
        prompt = spec.prompt(args.ttft_tokens, next(seed))
        num_cached = int(args.ttft_tokens * args.cached_fraction) // page_size * page_size
        if cached:  # an earlier request commits the shared prefix (one extra token: full pages)
            with KVCoreCache(client, model, backend=args.backend) as cache:
                timed_greedy(model, [prompt[: num_cached + 1]], 1, cache)
        with KVCoreCache(client, model, backend=args.backend) as cache:
            _, stamps = timed_greedy(model, [prompt], 1, cache)
            assert cache.num_cached_tokens == (num_cached if cached else 0), cache.num_cached_tokens
        return stamps[1] - stamps[0]

    decode_tps(True), decode_tps(False)  # warm up both paths
    # paired and interleaved: a change in machine load hits both sides of a ratio alike
    dyn, kv, cold, warm = [], [], [], []
    for _ in range(args.repeats):
        dyn.append(decode_tps(False))
        kv.append(decode_tps(True))
        cold.append(ttft(False))
        warm.append(ttft(True))
    decode_ratio = statistics.median(k / d for k, d in zip(kv, dyn, strict=True))
    ttft_ratio = statistics.median(w / c for w, c in zip(warm, cold, strict=True))
    dyn_tps, kv_tps = statistics.median(dyn), statistics.median(kv)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    stats = client.stats()
    return {
        "decode_tps_ratio": decode_ratio,
        "ttft_cached_ratio": ttft_ratio,
        "decode": {"kvcore_tokens_per_s": kv_tps, "dynamic_cache_tokens_per_s": dyn_tps,
                   "batch": args.batch, "prompt_tokens": args.prompt_tokens,
                   "new_tokens": args.new_tokens},
        "ttft": {"cached_ms": warm_s * 1e3, "cold_ms": cold_s * 1e3,
                 "prompt_tokens": args.ttft_tokens,
                 "cached_tokens": int(args.ttft_tokens * args.cached_fraction) // page_size * page_size},
        "setup": {"backend": args.backend, "dtype": args.dtype, "page_size": page_size,
                  "threads": args.threads, "repeats": args.repeats,
                  "model": f"llama {spec.num_layers} layers, hidden {spec.hidden_size}, "
                           f"{spec.num_heads} q / {spec.num_kv_heads} kv heads"},
        "pool_hit_rate": stats.hit_rate,
        "targets_met": decode_ratio >= 0.8 and ttft_ratio <= 0.5,
    }  # fmt: skip
