"""SGLang's pages and keys in kvcore, without SGLang: the strided page views of its
four MHA host layouts and three MLA ones against the page slices its host pool takes
(tensors of exactly the shapes of SGLang 0.5.23's pool_host/mha.py and mla.py), the
round trip through a kvcore pool (a latent one for MLA, fp8 byte for byte), what
stays refused, and the key spaces. The real SGLang objects drive the backend in tests/test_sglang_storage.py, and
derive the key spaces from SGLang's published arguments in tests/test_sglang_identity.py."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from kvcore.errors import BadRequest
from kvcore.integrations.identity import path_weights, process_nonce, space_model
from kvcore.integrations.sglang.attach import expected_layout
from kvcore.integrations.sglang.keys import (
    MIN_PAGE_SIZE,
    ServerModel,
    page_tokens,
    pages_tokens,
    rank_identity,
    sglang_model,
)
from kvcore.integrations.sglang.pages import (
    HOST_ORDERS,
    LAYOUTS,
    copy_pages,
    flat_page,
    host_pages,
    pool_pages,
    unflat_page,
)
from kvcore.layout import KVLayout
from kvcore.prefix import PackedTokens, count_tokens, encode_tokens


def kv_buffer(layout: str, pages: int, layers: int, ps: int, heads: int, dim: int) -> torch.Tensor:
    """An SGLang MHA host pool's kv_buffer (init_kv_buffer's dims), filled with distinct values."""
    size = pages * ps
    dims = {
        "layer_first": (2, layers, size, heads, dim),
        "page_first": (2, size, layers, heads, dim),
        "page_first_direct": (2, pages, layers, ps, heads, dim),
        "page_head": (2, pages, heads, ps, layers, dim),
    }[layout]
    return torch.arange(torch.Size(dims).numel(), dtype=torch.float32).view(dims)


def sglang_page(buffer: torch.Tensor, layout: str, page: int, ps: int) -> torch.Tensor:
    """The slice SGLang's get_data_page(page * ps) takes, flattened."""
    if layout == "layer_first":
        return buffer[:, :, page * ps : (page + 1) * ps].flatten()
    if layout == "page_first":
        return buffer[:, page * ps : (page + 1) * ps].flatten()
    return buffer[:, page : page + 1].flatten()


GEOMETRY = st.tuples(
    st.sampled_from(LAYOUTS),
    st.integers(1, 4),  # pages
    st.integers(1, 3),  # layers
    st.sampled_from([1, 2, 8]),  # page size (tokens)
    st.integers(1, 3),  # heads
    st.integers(1, 5),  # head dim
)


@settings(max_examples=60, deadline=None)
@given(GEOMETRY)
def test_page_views_are_sglangs_pages(geometry: tuple[str, int, int, int, int, int]) -> None:
    layout, pages, layers, ps, heads, dim = geometry
    buffer = kv_buffer(layout, pages, layers, ps, heads, dim)
    view = host_pages(buffer, layout, ps)
    assert view.shape == (pages, layers, 2, ps, heads, dim)
    assert view.data_ptr() == buffer.data_ptr()  # a view, not a copy
    for page in range(pages):
        expected = sglang_page(buffer, layout, page, ps)
        assert torch.equal(flat_page(view[page], layout), expected)
        assert torch.equal(unflat_page(expected, layout, view[page].shape), view[page])
    # K is [:, :, 0], V is [:, :, 1], in every layout: SGLang keeps them as kv_buffer[0] / [1]
    assert torch.equal(view[:, :, 0].flatten().sort().values, buffer[0].flatten().sort().values)


@settings(max_examples=30, deadline=None)
@given(GEOMETRY, st.data())
def test_pages_round_trip_through_a_kvcore_pool(
    geometry: tuple[str, int, int, int, int, int], data: st.DataObject
) -> None:
    layout, pages, layers, ps, heads, dim = geometry
    source = host_pages(kv_buffer(layout, pages, layers, ps, heads, dim), layout, ps)
    order = data.draw(  # the order the backend attaches with, or any other (copies serve all)
        st.one_of(st.just(HOST_ORDERS[layout]), st.permutations("LPKTH").map("".join))
    )
    kv = KVLayout(layers, heads, dim, ps, "float32", num_pages=6, order=order)
    memory = torch.full((kv.total_bytes // 4,), float("nan"))
    pool = pool_pages(kv.layer_views(memory))
    src = data.draw(st.permutations(range(pages)))
    dst = data.draw(st.lists(st.integers(0, 5), min_size=pages, max_size=pages, unique=True))
    copy_pages(pool, torch.tensor(dst), source, torch.tensor(src))
    for s, d in zip(src, dst, strict=True):  # in kvcore's layout: layer l of page d
        for layer, view in enumerate(kv.layer_views(memory)):
            assert torch.equal(view[d], source[s, layer])
        if order == HOST_ORDERS[layout] != "LPKTH":  # a page-major pool's page is SGLang's
            assert torch.equal(kv.pages_view(memory)[d].flatten(), flat_page(source[s], layout))
    untouched = [p for p in range(6) if p not in dst]
    assert bool(pool[untouched].isnan().all())  # no byte of another page written
    back = host_pages(
        torch.zeros_like(kv_buffer(layout, pages, layers, ps, heads, dim)), layout, ps
    )
    copy_pages(back, torch.tensor(src), pool, torch.tensor(dst))
    assert torch.equal(back, source)


def mla_buffer(layout: str, pages: int, layers: int, ps: int, dim: int) -> torch.Tensor:
    """An SGLang MLA host pool's kv_buffer (its init_kv_buffer dims; dim = kv_cache_dim),
    uint8 bytes as SGLang stores an fp8 cache, all 256 values."""
    size = pages * ps
    dims = {
        "layer_first": (layers, size, 1, dim),
        "page_first": (size, layers, 1, dim),
        "page_first_direct": (pages, layers, ps, 1, dim),
    }[layout]
    return torch.randint(0, 256, dims, dtype=torch.uint8)


def mla_page(buffer: torch.Tensor, layout: str, page: int, ps: int) -> torch.Tensor:
    """The slice SGLang's MLA get_data_page(page * ps) takes, flattened."""
    if layout == "layer_first":
        return buffer[:, page * ps : (page + 1) * ps].flatten()
    if layout == "page_first":
        return buffer[page * ps : (page + 1) * ps].flatten()
    return buffer[page : page + 1].flatten()


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(("layer_first", "page_first", "page_first_direct")),
    st.integers(1, 4),  # pages
    st.integers(1, 3),  # layers
    st.sampled_from([1, 2, 8]),  # page size (tokens)
    st.integers(1, 9),  # kv_cache_dim
    st.sampled_from(["uint8", "float8_e4m3fn", "float8_e5m2"]),  # kvcore's pool dtype
)
def test_mla_pages_are_sglangs_and_round_trip_a_latent_pool_byte_for_byte(
    layout: str, pages: int, layers: int, ps: int, dim: int, dtype: str
) -> None:
    buffer = mla_buffer(layout, pages, layers, ps, dim)
    view = host_pages(buffer, layout, ps, latent=True)
    assert view.shape == (pages, layers, 1, ps, 1, dim)  # kvcore's latent page per layer
    assert view.data_ptr() == buffer.data_ptr()
    for page in range(pages):
        expected = mla_page(buffer, layout, page, ps)
        assert torch.equal(flat_page(view[page], layout), expected)
        assert torch.equal(unflat_page(expected, layout, view[page].shape), view[page])
    if dtype == "uint8":
        return
    kv = KVLayout(layers, 1, dim, ps, dtype, num_pages=5, kind="latent")
    memory = torch.zeros(kv.total_bytes, dtype=torch.uint8)
    layer_views = kv.layer_views(memory)
    assert layer_views[0].dtype == getattr(torch, dtype)
    pool = pool_pages(layer_views)
    assert pool.dtype == torch.uint8  # SGLang's fp8 bytes go in as bytes, not as values
    dst = torch.tensor([4 - p for p in range(pages)])
    copy_pages(pool, dst, view, torch.arange(pages))
    for p in range(pages):
        for layer, lv in enumerate(layer_views):
            assert torch.equal(lv[4 - p].view(torch.uint8), view[p, layer])
    back = host_pages(torch.zeros_like(buffer), layout, ps, latent=True)
    copy_pages(back, torch.arange(pages), pool, dst)
    assert torch.equal(back, view)  # NaN and inf bit patterns included


def host_pool(**fields: object) -> SimpleNamespace:
    """The attributes attach.expected_layout reads of an SGLang host pool (an MLA one
    unless head_num is given), SGLang 0.5.23's names."""
    mla = {"kv_lora_rank": 32, "qk_rope_head_dim": 16, "kv_cache_dim": 48}
    base = {"layout": "layer_first", "layer_num": 2, "page_size": 16, "dtype": torch.bfloat16}
    if "head_num" not in fields:
        base |= {**mla, "dsa_kv_cache_store_fp8": False}
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    ("host", "kv_cache_dtype", "layout"),
    [
        (host_pool(), "auto", ("bfloat16", "latent", 1, 48)),
        (host_pool(dtype=torch.uint8), "fp8_e4m3", ("float8_e4m3fn", "latent", 1, 48)),
        (
            host_pool(layout="page_first_direct", dtype=torch.uint8),
            "fp8_e5m2",
            ("float8_e5m2", "latent", 1, 48),
        ),
        (
            host_pool(head_num=2, head_dim=8, dtype=torch.uint8),
            "fp8_e4m3",
            ("float8_e4m3fn", "kv", 2, 8),
        ),
        (host_pool(head_num=2, head_dim=8), "bf16", ("bfloat16", "kv", 2, 8)),
    ],
)
def test_mla_and_fp8_host_pools_are_kvcore_layouts(
    host: SimpleNamespace, kv_cache_dtype: str, layout: tuple[str, str, int, int]
) -> None:
    kv, name = expected_layout(host, kv_cache_dtype)
    assert (kv.dtype, kv.kind, kv.num_kv_heads, kv.head_dim) == layout
    assert (kv.num_layers, kv.page_size, name) == (2, 16, host.layout)


@pytest.mark.parametrize(
    ("host", "kv_cache_dtype", "why"),
    [
        (host_pool(layout="page_unified"), "auto", "MLA .*--hicache-mem-layout.*'page_unified'"),
        (host_pool(layout="page_first_kv_split"), "auto", "--hicache-mem-layout.*kv_split"),
        (host_pool(layout="page_head"), "auto", "MLA host pools.*'page_head'"),
        (host_pool(head_num=1, head_dim=8, layout="page_unified"), "auto", "MHA .*page_unified"),
        (
            host_pool(dtype=torch.uint8, kv_cache_dim=656, dsa_kv_cache_store_fp8=True),
            "fp8_e4m3",
            "packed_fp8",
        ),
        (host_pool(dtype=torch.uint8), "auto", "--kv-cache-dtype auto"),  # FP8 checkpoint
        (host_pool(head_num=2, head_dim=8, dtype=torch.uint8), "mxfp8", "--kv-cache-dtype mxfp8"),
        (host_pool(dtype=torch.uint8), "", "--kv-cache-dtype [(]unknown"),  # nothing published
        (host_pool(head_num=2, head_dim=8, v_head_dim=4), "auto", "equal K and V"),
    ],
)
def test_what_sglang_stores_otherwise_is_refused_naming_the_setting(
    host: SimpleNamespace, kv_cache_dtype: str, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        expected_layout(host, kv_cache_dtype)


def test_an_unknown_layout_or_a_partial_page_is_refused() -> None:
    with pytest.raises(ValueError, match="page_unified"):
        host_pages(torch.zeros(2, 1, 8, 1, 1), "page_unified", 8)
    with pytest.raises(ValueError, match="whole pages"):
        host_pages(torch.zeros(2, 1, 12, 1, 1), "layer_first", 8)


@dataclasses.dataclass(frozen=True)
class Rank:
    """The fields of SGLang's HiCacheStorageConfig that a rank's key space reads."""

    model_name: str | None = "m"
    tp_rank: int = 0
    tp_size: int = 2
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_size: int = 1
    is_mla_model: bool = False
    should_split_heads: bool = False


SERVER = ServerModel(model_path="m", dtype="bfloat16", kv_cache_dtype="auto")


def space(rank: Rank = Rank(), server: ServerModel = SERVER, model_id: str = "") -> str:
    return space_model(rank_identity(rank, server, model_id))


@pytest.mark.parametrize(
    ("rank", "server"),
    [
        (Rank(), dataclasses.replace(SERVER, model_path="m2")),
        (Rank(tp_rank=1), SERVER),
        (Rank(tp_size=4), SERVER),
        (Rank(pp_rank=1, pp_size=2), SERVER),
        (Rank(), dataclasses.replace(SERVER, revision="v2")),
        (Rank(), dataclasses.replace(SERVER, dtype="float16")),
        (Rank(), dataclasses.replace(SERVER, kv_cache_dtype="fp8_e4m3")),
        (Rank(), dataclasses.replace(SERVER, quantization="fp8")),
    ],
)
def test_another_model_or_shard_is_another_key_space(rank: Rank, server: ServerModel) -> None:
    assert space(rank, server) != space()
    assert len(space(rank, server).encode()) == 64  # within kvcore's 256 bytes for a model


def test_model_id_declares_the_model_and_the_shard_still_enters() -> None:
    assert space(Rank(), dataclasses.replace(SERVER)) == space()  # equal ranks share
    assert space(Rank(model_name="a"), model_id="x") == space(Rank(model_name="b"), model_id="x")
    assert space(Rank(), model_id="x") != space()
    assert space(Rank(tp_rank=1), model_id="x") != space(Rank(), model_id="x")
    kv = dataclasses.replace(SERVER, kv_cache_dtype="fp8_e4m3")
    assert space(Rank(), kv, model_id="x") != space(Rank(), model_id="x")


def test_a_local_model_path_is_its_files_and_unpublished_server_args_are_unknown(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text("{}")
    ident = rank_identity(Rank(), dataclasses.replace(SERVER, model_path=str(tmp_path)))
    assert ident.source.weights == path_weights(tmp_path)
    assert ident.kv_dtype == "bfloat16"  # "auto": the model's dtype
    assert (ident.tp_rank, ident.tp_size) == (0, 2)  # each rank is a client of its own
    # outside an SGLang server (no runtime context): the storage config alone
    assert sglang_model(Rank()) == space(Rank(), ServerModel())


def checkpoint(directory: Path, eps: float = 1e-5) -> LlamaConfig:
    """A model directory (its config and a weights file) and the config SGLang loads."""
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, rms_norm_eps=eps)
    config.save_pretrained(directory)
    (directory / "model.safetensors").write_bytes(directory.name.encode())
    return config


def test_two_checkpoints_under_one_served_name_are_two_models(tmp_path: Path) -> None:
    """SGLang passes its --served-model-name as the storage config's model_name: the
    source is the server's model_path (its files) and SGLang's HF config."""
    base, tuned = tmp_path / "base", tmp_path / "finetune"
    config = checkpoint(base)
    checkpoint(tuned)
    llm = Rank(model_name="llm")
    on_base = ServerModel(model_path=str(base), dtype="bfloat16", hf_config=config)
    ident = rank_identity(llm, on_base)
    assert ident.source.model == os.path.realpath(base)
    assert ident.source.weights == path_weights(base) and ident.source.config
    on_tuned = dataclasses.replace(on_base, model_path=str(tuned))
    assert space(llm, on_tuned) != space(llm, on_base)
    assert space(Rank(model_name="chat"), on_base) == space(llm, on_base)  # one checkpoint
    overridden = dataclasses.replace(
        on_base, hf_config=LlamaConfig(**{**config.to_dict(), "rms_norm_eps": 1e-3})
    )
    assert space(llm, overridden) != space(llm, on_base)  # --json-model-override-args
    assert space(llm, on_tuned, "m") == space(llm, on_base, "m")  # declared one model


def test_weights_nothing_names_are_this_process_alone_and_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unnamed = ServerModel(model_path="org/not-in-the-hub-cache", dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        ident = rank_identity(Rank(model_name="llm"), unnamed)
    assert ident.source.weights == process_nonce()
    assert "model_id" in caplog.text and "org/not-in-the-hub-cache" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        assert rank_identity(Rank(), unnamed, "m").source.model_id == "m"
    assert not caplog.records  # a declared model needs no warning
    checkpoint(tmp_path)
    dummy = ServerModel(model_path=str(tmp_path), load_format="dummy")
    assert rank_identity(Rank(), dummy).source.weights == process_nonce()
    assert rank_identity(Rank(), dummy, "m").source.weights == process_nonce()  # never shared


def test_mla_ranks_share_rank_zeros_pages_and_fp8_scales_enter(tmp_path: Path) -> None:
    """SGLang stores an MLA model's (replicated) latent cache from TP rank 0 alone and
    every rank prefetches it: every rank's key space is rank 0's, the TP size still
    enters. An fp8 cache's scales file (--quantization-param-path) enters by content."""
    mla = [space(Rank(is_mla_model=True, tp_rank=r)) for r in range(2)]
    assert mla[0] == mla[1] == space(Rank(tp_rank=0))  # MLA or not: the layouts differ
    assert space(Rank(is_mla_model=True, tp_size=4)) != mla[0]
    fp8 = dataclasses.replace(SERVER, kv_cache_dtype="fp8_e4m3")
    assert rank_identity(Rank(), fp8).kv_scales == "checkpoint"
    assert rank_identity(Rank(), dataclasses.replace(SERVER, kv_cache_dtype="bf16")).kv_scales == ""
    assert space(Rank(), dataclasses.replace(SERVER, kv_cache_dtype="bf16")) == space()
    scales = tmp_path / "scales.json"
    scales.write_text('{"k": 1}')
    with_file = dataclasses.replace(fp8, kv_scales_path=str(scales))
    first = space(Rank(), with_file)
    assert first != space(Rank(), fp8)
    scales.write_text('{"k": 2}')
    assert space(Rank(), with_file) != first


@pytest.mark.parametrize(
    ("rank", "why"),
    [
        (Rank(should_split_heads=True), "split heads"),
        (Rank(attn_cp_size=2), "split heads or contexts"),
    ],
)
def test_what_kvcore_does_not_store_is_refused(rank: Rank, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        rank_identity(rank, SERVER)
    with pytest.raises(ValueError, match="needs the model"):
        rank_identity(Rank(model_name=None), ServerModel())


def test_keys_fill_a_page() -> None:
    tokens = page_tokens("a" * 64, 64)
    assert len(tokens) == 64 and tokens[8:] == [0] * 56 and all(0 <= t < 2**32 for t in tokens)
    assert page_tokens("a" * 64, 64) == tokens != page_tokens("b" * 64, 64)
    with pytest.raises(BadRequest, match=f"at least {MIN_PAGE_SIZE} tokens"):
        page_tokens("a", MIN_PAGE_SIZE - 1)
    with pytest.raises(BadRequest, match=f"at least {MIN_PAGE_SIZE} tokens"):
        pages_tokens(["a"], MIN_PAGE_SIZE - 1)


@given(keys=st.lists(st.text(max_size=70), max_size=5), page_size=st.sampled_from([8, 16, 64]))
def test_packed_keys_are_the_keys_tokens(keys: list[str], page_size: int) -> None:
    """What the backend sends packed is each key's page_tokens, page after page."""
    packed = pages_tokens(keys, page_size)
    assert isinstance(packed, PackedTokens) and count_tokens(packed) == len(keys) * page_size
    assert packed == encode_tokens([t for key in keys for t in page_tokens(key, page_size)])
