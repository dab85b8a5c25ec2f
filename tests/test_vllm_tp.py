"""Tensor parallelism end to end: two vLLM engines of tensor_parallel_size=2 share a
prefix through a pool of two shards (one per rank), and generate what a plain
tensor_parallel_size=1 engine does.

vLLM's CPU build runs TP=2 with the ``mp`` executor (two worker processes, gloo).
Engine A computes and saves the prompts (every rank its own heads into its own
shard; a page is committed once both ranks saved it); engine B, with vLLM's own
prefix cache off, loads them on both ranks (external hits of the whole prefix) and
continues; with a page of the pool wrong in both shards (the negative
control, vllm_helpers.overwrite_page), B's check fails. Slow (three engines start,
minutes on 2 cores)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    MODEL,
    OTHER_TOKENS,
    PAGE_SIZE,
    Engine,
    overwrite_page,
    same_tokens,
    vllm_available,
    write_model,
)

from kvcore import KeySpace

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

PROMPTS = [
    [(7 * i + 3) % MODEL.vocab_size for i in range(3 * PAGE_SIZE + 5)],  # 3 full pages + 5
    [(11 * i + 1) % MODEL.vocab_size for i in range(2 * PAGE_SIZE + 9)],  # 2 full pages + 9
]
SIZING: dict[str, Any] = {"kv_bytes": 32 << 20, "max_num_seqs": 4, "max_model_len": 512}


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


@pytest.fixture(scope="module")
def expected(model: Path, daemon: str) -> dict[str, Any]:
    """A plain tensor_parallel_size=1 engine's outputs of PROMPTS, which engine A
    (tensor_parallel_size=2) decodes too, committing their pages; both closed after."""
    with (
        Engine(model, None, **SIZING) as plain,
        Engine(model, {"endpoint": daemon}, tensor_parallel_size=2, **SIZING) as a,
    ):
        expected = plain.generate(PROMPTS, max_tokens=6)
        same_tokens(a.generate(PROMPTS, max_tokens=6)["tokens"], expected["tokens"])
    return expected


@pytest.fixture(scope="module")
def b(model: Path, daemon: str, expected: dict[str, Any]) -> Iterator[Engine]:
    """Engine B (tensor_parallel_size=2), started once A is gone; vLLM's own prefix cache
    off, so that it loads the prompts' pages from kvcore at each call."""
    connector = {"endpoint": daemon}
    with Engine(model, connector, tensor_parallel_size=2, prefix_caching=False, **SIZING) as b:
        yield b


def b_decodes(b: Engine, expected: dict[str, Any]) -> None:
    """B loads the full pages of PROMPTS on both ranks and decodes ``expected``."""
    before = b.stats()["external_hit_tokens"]
    second = b.generate(PROMPTS, max_tokens=6)
    prefix = sum(len(p) // PAGE_SIZE * PAGE_SIZE for p in PROMPTS)
    assert b.stats()["external_hit_tokens"] - before >= prefix
    assert sum(second["cached"]) >= prefix
    same_tokens(second["tokens"], expected["tokens"])  # both ranks loaded their own heads


def test_two_tp2_engines_share_a_prefix_through_a_sharded_pool(
    b: Engine, expected: dict[str, Any]
) -> None:
    b_decodes(b, expected)


def test_b_decodes_other_tokens_from_a_wrong_page_in_both_shards(
    b: Engine, expected: dict[str, Any], daemon: str
) -> None:
    """The control of the test above: page 0 of the first prompt holds page 2's K/V,
    both ranks' halves of it (each shard's)."""
    overwrite_page(daemon, PROMPTS[0], KeySpace(model=b.model()), 0, 2)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        b_decodes(b, expected)


def test_a_pool_of_other_shards_than_ranks_is_a_layout_mismatch(daemon: str) -> None:
    from kvcore import Client
    from kvcore.errors import LayoutMismatch
    from kvcore.integrations.vllm.ranks import WorkerRank

    with pytest.raises(LayoutMismatch, match=r"2 shard.*expects 4.*shards=4"):
        Client.connect(daemon, map_memory=False, **WorkerRank(3, 4).connect_options())
    with (
        Client.connect(daemon, map_memory=False) as any_count,  # asks for no count
        pytest.raises(LayoutMismatch, match=r"2 shard.*tensor_parallel_size=1.*shards=1"),
    ):
        WorkerRank(0, 1).check(any_count, "default")
    with Client.connect(daemon, map_memory=False, **WorkerRank(1, 2).connect_options()) as rank1:
        WorkerRank(1, 2).check(rank1, "default")
    assert WorkerRank.current() == WorkerRank(0, 1)  # no vLLM process group here
