"""KVCoreCache with the torch backend: token-for-token equal to transformers' DynamicCache.

Every test generates with the same random-weight Llama twice: once with
transformers' own DynamicCache, once on a private kvcore pool through the
adapter, and compares tokens. Pools are ephemeral (one per test), so their
figures (held pages, hits) belong to that test alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from hf_helpers import SMALL, held, module_endpoint, padded, private_client, reference
from transformers import LogitsProcessor, LogitsProcessorList

from kvcore.demo_model import greedy
from kvcore.integrations.transformers import KVCoreCache
from kvcore.layout import cdiv

NEW = 16


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from module_endpoint(tmp_path_factory, "hf")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return SMALL.build()


def kvcore_run(
    endpoint: str, model: torch.nn.Module, prompts: list[list[int]], **kw: object
) -> tuple[torch.Tensor, list[int]]:
    """Two adapter runs of the same batch on one pool: (tokens of each, cached tokens of each)."""
    ids, mask = padded(prompts)
    outs, cached = [], []
    with private_client(endpoint, SMALL, **kw) as client:  # type: ignore[arg-type]
        for _ in range(2):  # cold, then warm: the second run hits the pages the first committed
            with KVCoreCache(client, model) as cache:
                outs.append(greedy(model, ids, NEW, attention_mask=mask, cache=cache))
                cached.append(cache.num_cached_tokens)
            assert held(client) == (0, 0)
        client.check_integrity()
    assert torch.equal(outs[0], outs[1])
    return outs[0], cached


@pytest.mark.parametrize(
    ("length", "warm_hit"),
    [(5, 0), (16, 0), (17, 16), (70, 64)],
    ids=["shorter-than-a-page", "exactly-one-page", "one-page-plus-one", "many-pages"],
)
def test_batch_of_one_equals_dynamic_cache(
    endpoint: str, model: torch.nn.Module, length: int, warm_hit: int
) -> None:
    prompt = SMALL.prompt(length, seed=length)
    out, cached = kvcore_run(endpoint, model, [prompt])
    assert torch.equal(out, reference(model, [prompt], NEW))
    assert cached == [0, warm_hit]  # a hit covers whole pages and never the last token


def test_left_padded_batch_of_three_lengths(endpoint: str, model: torch.nn.Module) -> None:
    prompts = [SMALL.prompt(n, seed=100 + n) for n in (5, 16, 50)]
    out, cached = kvcore_run(endpoint, model, prompts)
    assert torch.equal(out, reference(model, prompts, NEW))
    for row, prompt in zip(out, prompts, strict=True):  # and each row equals its run alone
        assert torch.equal(row, reference(model, [prompt], NEW)[0])
    assert cached == [0, 48]  # only the 50-token row has a full page before its last token


def test_mixed_hits_in_one_batch(endpoint: str, model: torch.nn.Module) -> None:
    """Rows with different hits: only the columns every row has cached are skipped."""
    shared = SMALL.prompt(40, seed=7)
    first, second = shared + SMALL.prompt(3, seed=8), SMALL.prompt(30, seed=9)
    with private_client(endpoint, SMALL) as client:
        with KVCoreCache(client, model) as cache:
            greedy(model, torch.tensor([first]), 2, cache=cache)
        ids, mask = padded([first, second, shared + SMALL.prompt(9, seed=10)])
        with KVCoreCache(client, model) as cache:
            out = greedy(model, ids, NEW, attention_mask=mask, cache=cache)
            assert cache.num_cached_tokens == 32 + 0 + 32
    assert torch.equal(out, greedy(model, ids, NEW, attention_mask=mask))


@pytest.mark.parametrize("kv_heads", [1, 4], ids=["mqa", "mha"])
def test_other_head_groupings(endpoint: str, kv_heads: int) -> None:
    spec = replace(SMALL, num_kv_heads=kv_heads)
    model = spec.build()
    prompts = [spec.prompt(n, seed=n) for n in (9, 40)]
    ids, mask = padded(prompts)
    with private_client(endpoint, spec) as client, KVCoreCache(client, model) as cache:
        out = greedy(model, ids, NEW, attention_mask=mask, cache=cache)
    assert torch.equal(out, greedy(model, ids, NEW, attention_mask=mask))


def test_page_size_one_and_odd(endpoint: str, model: torch.nn.Module) -> None:
    prompts = [SMALL.prompt(n, seed=n) for n in (4, 11)]
    for page_size in (1, 7):
        out, cached = kvcore_run(endpoint, model, prompts, page_size=page_size)
        assert torch.equal(out, reference(model, prompts, NEW))
        assert cached[1] == sum((n - 1) // page_size * page_size for n in (4, 11))


def test_bfloat16_matches_within_rounding_noise(endpoint: str) -> None:
    """bf16: the torch backend attends in fp32 and rounds once, SDPA rounds inside, so the two
    runs' logits differ by bf16 noise and a free-running comparison flips at the first near
    tie. So the adapter run is fed the reference's tokens (teacher forcing through a logits
    processor) and, at every step, its raw logits must be within the noise of the reference's
    and pick the reference's token wherever the reference's top two are further apart."""
    model = SMALL.build("bfloat16")
    for length in (5, 16, 70):
        prompt = SMALL.prompt(length, seed=length)
        ref_tokens, ref_logits = _with_logits(model, prompt, None, None)
        top2 = ref_logits.topk(2, dim=-1).values
        confident = top2[:, 0] - top2[:, 1] > 0.25
        with private_client(endpoint, SMALL, dtype="bfloat16") as client:
            for _ in range(2):  # cold, then with the prompt's full pages cached
                with KVCoreCache(client, model) as cache:
                    _, logits = _with_logits(model, prompt, cache, ref_tokens)
                assert (logits - ref_logits).abs().max() < 0.25
                assert torch.equal(logits.argmax(-1)[confident], ref_tokens[confident])


class _Force(LogitsProcessor):
    """Makes step i pick ``tokens[i]``; the raw logits are still reported."""

    def __init__(self, tokens: torch.Tensor, prompt_length: int) -> None:
        self.tokens = tokens.tolist()
        self.start = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.start]] = 0
        return forced


def _with_logits(
    model: torch.nn.Module, prompt: list[int], cache: KVCoreCache | None, force: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    processors = LogitsProcessorList()
    if force is not None:
        processors.append(_Force(force, len(prompt)))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            min_new_tokens=NEW,  # type: ignore[operator]
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            cache=cache,
            logits_processor=processors,
        )
    return out.sequences[0, len(prompt) :], torch.stack(out.logits, dim=1)[0].float()


def test_num_return_sequences_forks_the_prompt(endpoint: str, model: torch.nn.Module) -> None:
    prompt = SMALL.prompt(40, seed=3)  # 2 full pages + 8 tokens
    options = {"num_return_sequences": 3, "do_sample": True, "top_k": 1}  # top_k=1: greedy
    ref = greedy(model, torch.tensor([prompt]), 10, **options)
    with private_client(endpoint, SMALL) as client:
        with KVCoreCache(client, model) as cache:
            out = greedy(model, torch.tensor([prompt]), 10, cache=cache, **options)
            # 50 tokens = 4 pages per row: 2 full prompt pages shared by all three rows, the
            # third page copied on write by two of them, the fourth private: 2 + 3 + 3 = 8
            assert held(client) == (3, 8)
        assert held(client) == (0, 0)
        stats = client.stats()
        assert stats.query_tokens == 40  # one allocate: the other rows are forks
    assert torch.equal(out, ref)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_past_key_values_alias_and_unbinding(endpoint: str, model: torch.nn.Module) -> None:
    prompt = SMALL.prompt(20, seed=4)
    with private_client(endpoint, SMALL) as client, KVCoreCache(client, model) as cache:
        assert model.config._attn_implementation == "kvcore+sdpa"
        out = greedy(model, torch.tensor([prompt]), NEW, past_key_values=cache)
        assert cache.num_prompt_tokens == 20
    assert model.config._attn_implementation == "sdpa"  # the last cache unbinds the model
    assert torch.equal(out, reference(model, [prompt], NEW))


def test_dynamic_cache_on_a_bound_model_is_transformers_own(
    endpoint: str, model: torch.nn.Module
) -> None:
    prompts = [SMALL.prompt(n, seed=n) for n in (6, 30)]
    expected = reference(model, prompts, NEW)
    with private_client(endpoint, SMALL) as client, KVCoreCache(client, model):
        assert torch.equal(reference(model, prompts, NEW), expected)


def test_one_validation_per_forward(
    endpoint: str, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter plans each forward once (tables, slots and copies in one read-back) and
    runs every layer on that plan: the value checks run once per forward, not per layer."""
    from kvcore import backend_checks

    reads: list[int] = []
    run = backend_checks.ValueChecks.run

    def counted(self: backend_checks.ValueChecks) -> list[list[int]]:
        reads.append(len(self.flags))
        return run(self)

    monkeypatch.setattr(backend_checks.ValueChecks, "run", counted)
    prompts = [SMALL.prompt(n, seed=n) for n in (9, 23)]  # ragged: pages, slots, a mask
    ids, mask = padded(prompts)
    forwards = []

    class Count(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            forwards.append(1)
            return scores

    with private_client(endpoint, SMALL) as client, KVCoreCache(client, model) as cache:
        out = greedy(
            model,
            ids,
            NEW,
            attention_mask=mask,
            cache=cache,
            logits_processor=LogitsProcessorList([Count()]),
        )
    assert len(forwards) == NEW and len(reads) == NEW, (len(forwards), reads)
    assert torch.equal(out, reference(model, prompts, NEW))


def test_a_round_trip_reserves_ahead_for_the_whole_batch(
    endpoint: str, model: torch.nn.Module
) -> None:
    """Rows that cross pages at different steps share round trips: each one extends every
    row due within the next page_size steps, so 40 decode steps make 3 round trips (one
    every 16 steps; reserving only each row's own next page made 11). No row holds more
    than one page past the page its last token needs, the reserved pages are freed at
    close, and the tokens stay DynamicCache's."""
    prompts = [SMALL.prompt(n, seed=30 + n) for n in (16, 21, 27, 30)]
    ids, mask = padded(prompts)
    trips: list[int] = []
    with private_client(endpoint, SMALL) as client:
        with KVCoreCache(client, model) as cache:
            grow = cache.rows._grow

            def counted(*args: Any) -> None:
                trips.append(len(cache.rows.rows[0].tokens))
                grow(*args)

            cache.rows._grow = counted  # type: ignore[method-assign]
            out = greedy(model, ids, 41, attention_mask=mask, cache=cache)
            for row in cache.rows.rows:
                assert len(row.pages) <= cdiv(len(row.tokens), 16) + 1, (row.pages, row.tokens)
        assert held(client) == (0, 0)
    # the first decode step, then every 16 steps (row 0's length at each round trip)
    assert trips == [16, 32, 48], trips
    assert torch.equal(out, reference(model, prompts, 41))
