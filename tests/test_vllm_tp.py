"""Pages shared across tensor-parallel sizes, end to end: a vLLM engine at
tensor_parallel_size=1 and one at 2 on one daemon each hit the other's prefix, and
generate what plain vLLM (no connector) does.

A pool page holds every KV head of the model (kvcore/integrations/vllm/ranks.py): the
TP=1 worker copies both of the tiny model's KV heads, each TP=2 rank its one (rank 1
head 1), in a head-outer pool order (``LPHKT``), so each rank's head of a page and
layer is one run of bytes. vLLM's CPU build runs TP=2 with the ``mp`` executor (two
worker processes, gloo). Both engines run with vLLM's own prefix cache off, so that a
prompt asked again is loaded from kvcore.

Negative controls: one KV head of a committed page overwritten with another page's
(in the daemon's real shared-memory pool), and the engine that loads it decodes other
tokens: head 1 (TP=2 rank 1's, read by the TP=1 engine) and head 0 (rank 0's, read by
the TP=2 engine). Must-not-share: a pool of one shard per TP rank (kvcore's earlier
layout, whose bytes are one rank's heads) and a pool of another head count are
refused with the pool to start (tests/test_vllm_ranks.py, no engine). A TP=4 engine
(two ranks per KV head: replicas) shares both ways too (marked slow: a fourth engine,
of four worker processes). Three engines start at once (about a minute on 2 cores)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import (
    CPU_ORDER,
    MODEL,
    OTHER_TOKENS,
    PAGE_SIZE,
    Engine,
    decodes_as_plain,
    hits,
    loadable,
    pinned_pages,
    pool_flag,
    running,
    settle,
    vllm_available,
    write_model,
)

from kvcore import KeySpace

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

SIZING: dict[str, Any] = {"kv_bytes": 32 << 20, "max_num_seqs": 4, "max_model_len": 512}


def prompt(a: int, b: int, pages: int) -> list[int]:
    """``pages`` full pages and 5 tokens more: tokens no other prompt here shares."""
    return [(a * i + b) % MODEL.vocab_size for i in range(pages * PAGE_SIZE + 5)]


BY_TP1 = prompt(7, 3, 3)  # the TP=1 engine computes it, the TP=2 engine hits it
BY_TP2 = prompt(11, 1, 3)  # and the other way round
CONTROL_1 = prompt(13, 5, 3)  # computed by TP=2, head 1 made wrong, loaded by TP=1
CONTROL_2 = prompt(17, 2, 3)  # computed by TP=1, head 0 made wrong, loaded by TP=2


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One pool of every KV head (the model's 2), in the head-outer order of vLLM's CPU
    blocks, one shard: what both engines attach to."""
    from kvcore.daemon_process import DaemonProcess

    tmp = tmp_path_factory.mktemp("tp")
    pool = pool_flag(256, order=CPU_ORDER)
    with DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", "--pool", pool) as d:
        yield d.endpoint


@pytest.fixture(scope="module")
def engines(model: Path, daemon: str) -> Iterator[dict[str, Engine]]:
    """Plain vLLM (no connector), a TP=1 and a TP=2 engine on the daemon, loading at once."""
    connector = {"endpoint": daemon}
    started = {
        "plain": Engine(model, None, wait=False, **SIZING),
        "tp1": Engine(model, connector, prefix_caching=False, wait=False, **SIZING),
        "tp2": Engine(
            model, connector, tensor_parallel_size=2, prefix_caching=False, wait=False, **SIZING
        ),
    }
    with running(list(started.values())):
        yield started


def computes(engine: Engine, plain: Engine, tokens: list[int], daemon: str) -> None:
    """``engine`` decodes ``tokens`` as plain vLLM does, loading nothing, and commits its
    full pages (the daemon holds no sequence after)."""
    decodes_as_plain(engine, plain, tokens, 0)
    settle(daemon)


def overwrite_head(daemon: str, tokens: list[int], space: KeySpace, head: int) -> None:
    """KV head ``head`` of the first page committed for ``tokens``, every layer, gets the
    bytes of that head of the third page; the other head stays right."""
    with pinned_pages(daemon, tokens, space) as (shards, pages):
        assert len(shards) == 1 and len(pages) == 3, (len(shards), pages)
        for layer in shards[0]:
            wrong, right = layer[pages[0], :, :, head], layer[pages[2], :, :, head]
            assert not bool((wrong == right).all()), "the heads are equal"
            wrong.copy_(right)


def test_both_engines_key_their_pages_alike(engines: dict[str, Engine]) -> None:
    """The identity names no TP size (kvcore/integrations/identity.py)."""
    assert engines["tp1"].model() == engines["tp2"].model()


def test_tp2_hits_what_tp1_computed(engines: dict[str, Engine], daemon: str) -> None:
    computes(engines["tp1"], engines["plain"], BY_TP1, daemon)
    decodes_as_plain(engines["tp2"], engines["plain"], BY_TP1, loadable(BY_TP1))


def test_tp1_hits_what_tp2_computed(engines: dict[str, Engine], daemon: str) -> None:
    """Both ranks of the TP=2 engine saved their head into the one page before it was
    committed: the TP=1 engine loads both heads from it."""
    computes(engines["tp2"], engines["plain"], BY_TP2, daemon)
    decodes_as_plain(engines["tp1"], engines["plain"], BY_TP2, loadable(BY_TP2))
    assert hits(engines["tp2"]) >= loadable(BY_TP1)  # the other test's, if it ran first


def test_tp1_decodes_other_tokens_from_a_wrong_head_saved_by_rank_1(
    engines: dict[str, Engine], daemon: str
) -> None:
    plain, tp1, tp2 = engines["plain"], engines["tp1"], engines["tp2"]
    computes(tp2, plain, CONTROL_1, daemon)
    overwrite_head(daemon, CONTROL_1, KeySpace(model=tp1.model()), head=1)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        decodes_as_plain(tp1, plain, CONTROL_1, loadable(CONTROL_1))


def test_tp2_decodes_other_tokens_from_a_wrong_head_saved_by_tp1(
    engines: dict[str, Engine], daemon: str
) -> None:
    plain, tp1, tp2 = engines["plain"], engines["tp1"], engines["tp2"]
    computes(tp1, plain, CONTROL_2, daemon)
    overwrite_head(daemon, CONTROL_2, KeySpace(model=tp2.model()), head=0)
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        decodes_as_plain(tp2, plain, CONTROL_2, loadable(CONTROL_2))


BY_TP4 = prompt(19, 4, 3)  # computed by a TP=4 engine (heads replicated), hit by TP=1
FOR_TP4 = prompt(23, 6, 3)  # computed by TP=1, hit by TP=4


@pytest.mark.slow
def test_a_tp4_engine_of_replicated_heads_shares_both_ways(
    engines: dict[str, Engine], model: Path, daemon: str
) -> None:
    """Four ranks over the model's two KV heads: ranks 0 and 1 hold head 0, ranks 2 and
    3 head 1; ranks 0 and 2 save, all four load. A fourth engine (four worker
    processes), hence slow."""
    plain, tp1 = engines["plain"], engines["tp1"]
    computes(tp1, plain, FOR_TP4, daemon)
    connector = {"endpoint": daemon}
    with Engine(model, connector, tensor_parallel_size=4, prefix_caching=False, **SIZING) as tp4:
        assert tp4.model() == tp1.model()
        decodes_as_plain(tp4, plain, FOR_TP4, loadable(FOR_TP4))
        computes(tp4, plain, BY_TP4, daemon)
    decodes_as_plain(tp1, plain, BY_TP4, loadable(BY_TP4))
