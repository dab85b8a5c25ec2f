"""vLLM engines in their own processes, for ``kvcore bench vllm`` and the connector's
tests: the tiny model they serve (:data:`MODEL`, written by :func:`write_model`;
nothing downloaded), the daemon pool that fits it (:func:`pool_flag`) and
:class:`Engine`, one ``vllm.LLM`` driven over JSON lines."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvcore.demo_model import TinyLlama

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


def block_bytes() -> int:
    """Bytes of one vLLM block of :data:`MODEL` in float32, all layers (K and V)."""
    return MODEL.num_layers * 2 * PAGE_SIZE * MODEL.num_kv_heads * MODEL.head_dim * 4
