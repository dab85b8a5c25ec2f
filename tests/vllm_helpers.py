"""vLLM engines in their own processes, for the connector's tests and benchmark.

An engine process builds ``vllm.LLM`` on a tiny random Llama written to a
directory (nothing is downloaded; ``skip_tokenizer_init``, prompts as token ids),
optionally with the kvcore connector, then serves JSON commands on stdin, one per
line, answering one JSON line each:

* ``{"op": "generate", "prompts": [[ids]...], "max_tokens": n, "abort": [i...]}``:
  greedy outputs (aborted prompts are dropped after their first step), vLLM's
  cached-token count per prompt, and each prompt's time to first token (s);
* ``{"op": "stats"}``: the connector's counters (external hits, pages moved).

VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps scheduler and worker in the engine process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvcore.integrations.tiny_llama import TinyLlama

#: The CPU attention backend wants head dims other than 16 and blocks of 32k tokens.
MODEL = TinyLlama(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512, vocab_size=512)  # fmt: skip
PAGE_SIZE = 32


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def write_model(directory: Path) -> Path:
    """config.json + model.safetensors of :data:`MODEL` (seeded: equal in every process)."""
    if not (directory / "config.json").exists():
        MODEL.build("float32").save_pretrained(directory)
    return directory


def pool_flag(num_pages: int = 512, name: str = "default") -> str:
    return MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=num_pages, name=name)


ENGINE = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

args = json.loads(sys.argv[1])
options = dict(model=args["model"], skip_tokenizer_init=True, dtype="float32",
               block_size=args["block_size"], max_model_len=args.get("max_model_len", 2048), enforce_eager=True,
               gpu_memory_utilization=0.05, kv_cache_memory_bytes=args["kv_bytes"],
               max_num_seqs=args.get("max_num_seqs", 64), seed=0)
if args.get("connector") is not None:
    from vllm.config import KVTransferConfig
    options["kv_transfer_config"] = KVTransferConfig(
        kv_connector="KvcoreConnector", kv_connector_module_path="kvcore.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config=args["connector"])
llm = LLM(**options)
engine = llm.llm_engine
connector = None
if args.get("connector") is not None:
    core = engine.engine_core.engine_core
    connector = core.scheduler.connector
print(json.dumps({"ready": True}), flush=True)
counter = 0

def totals():
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    counts = connector._scheduler.stats.totals()
    for k, v in get_kv_transfer_group()._worker.stats.totals().items():
        counts[k] += v
    counts["preemptions"] = connector._scheduler.preemptions
    return counts

for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "stats":
        print(json.dumps(totals() if connector is not None else {}), flush=True)
        continue
    params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True,
                            detokenize=False)
    ids = []
    start = time.perf_counter()
    for prompt in cmd["prompts"]:
        counter += 1
        ids.append(f"r{counter}")
        engine.add_request(ids[-1], TokensPrompt(prompt_token_ids=prompt), params)
    aborted = {ids[i] for i in cmd.get("abort", [])}
    out, cached, ttft = {}, {}, {}
    first_step = True
    while engine.has_unfinished_requests():
        for o in engine.step():
            ttft.setdefault(o.request_id, time.perf_counter() - start)
            cached[o.request_id] = o.num_cached_tokens
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        if first_step and aborted:
            engine.abort_request(sorted(aborted))
            first_step = False
    print(json.dumps({"tokens": [out.get(i) for i in ids], "cached": [cached.get(i, 0) for i in ids],
                      "ttft": [ttft.get(i) for i in ids],
                      "wall": time.perf_counter() - start}), flush=True)
"""


class Engine:
    """One engine process; ``connector`` is the extra config (None: no connector)."""

    def __init__(self, model: Path, connector: dict[str, Any] | None, *,
                 kv_bytes: int = 64 << 20, max_num_seqs: int = 64, max_model_len: int = 2048,
                 env: dict[str, str] | None = None, timeout_s: float = 300) -> None:  # fmt: skip
        args = {"model": str(model), "connector": connector, "block_size": PAGE_SIZE,
                "kv_bytes": kv_bytes, "max_num_seqs": max_num_seqs,
                "max_model_len": max_model_len}  # fmt: skip
        self.timeout_s = timeout_s
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, json.dumps(args)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, env={**os.environ, **(env or {})},
        )  # fmt: skip
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self._log.seek(0)
                tail = self._log.read()[-3000:]
                raise RuntimeError(f"vLLM engine exited ({self.proc.wait()}):\n{tail}")
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                return reply

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]], max_tokens: int = 8,
                 abort: list[int] | None = None) -> dict[str, Any]:  # fmt: skip
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, abort=abort or [])

    def stats(self) -> dict[str, Any]:
        return self.call(op="stats")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
