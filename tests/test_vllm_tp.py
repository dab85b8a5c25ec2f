"""Tensor parallelism end to end: two vLLM engines of tensor_parallel_size=2 share a
prefix through a pool of two shards (one per rank), and generate what a plain
tensor_parallel_size=1 engine does.

vLLM's CPU build runs TP=2 with the ``mp`` executor (two worker processes, gloo).
Engine A computes and saves the prompts (every rank its own heads into its own
shard; a page is committed once both ranks saved it); engine B, with an empty
prefix cache of its own, loads them on both ranks (external hits of the whole
prefix) and continues. Slow (three engines start, minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import MODEL, PAGE_SIZE, vllm_available, write_model

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

ENGINE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

args = json.loads(sys.argv[1])
options = dict(model=args["model"], skip_tokenizer_init=True, dtype="float32",
               block_size=args["block_size"], max_model_len=512, enforce_eager=True,
               gpu_memory_utilization=0.05, kv_cache_memory_bytes=32 << 20, max_num_seqs=4,
               seed=0, tensor_parallel_size=args["tp"], distributed_executor_backend="mp")
if args["connector"] is not None:
    from vllm.config import KVTransferConfig
    options["kv_transfer_config"] = KVTransferConfig(
        kv_connector="KvcoreConnector", kv_connector_module_path="kvcore.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config=args["connector"])
llm = LLM(**options)
connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    prompts = json.loads(line)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    hits = connector._scheduler.stats.totals() if connector is not None else {}
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "cached": [o.num_cached_tokens for o in outs],
                      "external_hit_tokens": hits.get("external_hit_tokens", 0)}), flush=True)
"""

PROMPTS = [
    [(7 * i + 3) % MODEL.vocab_size for i in range(3 * PAGE_SIZE + 5)],  # 3 full pages + 5
    [(11 * i + 1) % MODEL.vocab_size for i in range(2 * PAGE_SIZE + 9)],  # 2 full pages + 9
]


class TpEngine:
    """One ``vllm.LLM`` of tensor_parallel_size ``tp`` in its own process; ``generate``
    sends prompts (one JSON line) and returns tokens, cached-token counts and the
    connector's external hit tokens since start-up."""

    def __init__(self, model: Path, tp: int, connector: dict[str, Any] | None) -> None:
        args = {"model": str(model), "tp": tp, "connector": connector, "block_size": PAGE_SIZE}
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self._ready = False

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                return reply
        self._log.seek(0)
        raise RuntimeError(f"vLLM engine exited ({self.proc.wait()}):\n{self._log.read()[-4000:]}")

    def generate(self, prompts: list[list[int]]) -> dict[str, Any]:
        if not self._ready:
            self._read()
            self._ready = True
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(prompts) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from kvcore.daemon_process import DaemonProcess

    tmp = tmp_path_factory.mktemp("tp")
    heads = MODEL.num_kv_heads // 2  # one rank's
    pool = MODEL.pool_flag(page_size=PAGE_SIZE, num_pages=256).replace(
        f"num_kv_heads={MODEL.num_kv_heads}", f"num_kv_heads={heads}"
    )
    with DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", "--pool", pool + ",shards=2") as d:
        yield d.endpoint


def test_two_tp2_engines_share_a_prefix_through_a_sharded_pool(model: Path, daemon: str) -> None:
    connector = {"endpoint": daemon}
    plain = TpEngine(model, 1, None)
    a = TpEngine(model, 2, connector)
    try:
        expected = plain.generate(PROMPTS)
        first = a.generate(PROMPTS)
    finally:
        plain.close()
        a.close()
    b = TpEngine(model, 2, connector)
    try:
        second = b.generate(PROMPTS)
    finally:
        b.close()
    assert first["tokens"] == expected["tokens"]
    assert second["tokens"] == expected["tokens"]  # both ranks loaded their own heads
    prefix = sum(len(p) // PAGE_SIZE * PAGE_SIZE for p in PROMPTS)
    assert second["external_hit_tokens"] >= prefix
    assert sum(second["cached"]) >= prefix


def test_a_pool_of_other_shards_than_ranks_is_a_layout_mismatch(daemon: str) -> None:
    from kvcore import Client
    from kvcore.errors import LayoutMismatch
    from kvcore.integrations.vllm.ranks import TensorRank

    with pytest.raises(LayoutMismatch, match=r"2 shard.*expects 4.*shards=4"):
        Client.connect(daemon, map_memory=False, **TensorRank(3, 4).connect_options())
    with (
        Client.connect(daemon, map_memory=False) as any_count,  # asks for no count
        pytest.raises(LayoutMismatch, match=r"2 shard.*tensor_parallel_size=1.*shards=1"),
    ):
        TensorRank(0, 1).check(any_count, "default")
    with Client.connect(daemon, map_memory=False, **TensorRank(1, 2).connect_options()) as rank1:
        TensorRank(1, 2).check(rank1, "default")
    assert TensorRank.current() == TensorRank(0, 1)  # no vLLM process group here
