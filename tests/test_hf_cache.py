"""KVCoreCache with the torch backend: token-for-token equal to transformers' DynamicCache.

Every test generates with the same random-weight Llama twice: once with
transformers' own DynamicCache, once on a private kvcore pool through the
adapter, and compares tokens. Pools are ephemeral (one per test), so their
figures (held pages, hits) belong to that test alone. The model's weights are drawn
with spread 0.15 (peaked logits), and each test whose warm run is served cached pages
runs the same check once more with a wrong page served, where it must fail (its
negative control, hf_helpers.wrong_page).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_helpers import (
    SMALL,
    cache_space,
    forward_logits,
    generate_logits,
    held,
    module_endpoint,
    other_page,
    padded,
    private_client,
    reference,
    served_pages,
    wrong_page_fails,
)
from transformers import LogitsProcessor, LogitsProcessorList

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.demo_model import greedy
from kvcore.integrations.transformers import KVCoreCache
from kvcore.layout import cdiv

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
NEW = 16


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from module_endpoint(tmp_path_factory, "hf")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return SMALL.build()


def check_batch(
    client: Client, model: torch.nn.Module, prompts: list[list[int]], want: torch.Tensor
) -> int:
    """One adapter run of the left-padded batch decodes ``want`` (transformers' own
    tokens; AssertionError otherwise) and leaves nothing held; returns its cached tokens."""
    ids, mask = padded(prompts)
    with KVCoreCache(client, model) as cache:
        out = greedy(model, ids, NEW, attention_mask=mask, cache=cache)
        cached = cache.num_cached_tokens
    assert held(client) == (0, 0)
    assert torch.equal(out, want), "the adapter's tokens are not DynamicCache's"
    return cached


def check_fails_on_a_wrong_page(
    client: Client, model: torch.nn.Module, prompts: list[list[int]], want: torch.Tensor
) -> None:
    """Negative control of a warm run: the first page the longest prompt is served holds
    other tokens' K/V (another committed page's bytes), and the same check must fail."""
    longest = max(prompts, key=len)
    pages = served_pages(client, cache_space(client, model), longest[:-1])
    with wrong_page_fails(client, pages[0], other_page(client, pages), "not DynamicCache's"):
        check_batch(client, model, prompts, want)


def kvcore_run(
    endpoint: str, model: torch.nn.Module, prompts: list[list[int]], **kw: object
) -> list[int]:
    """Two adapter runs of the same batch on one pool, cold then warm (hitting the pages
    the first committed), each decoding transformers' own tokens; a warm run that hit
    is then repeated as its negative control. Returns the cached tokens of each."""
    want = reference(model, prompts, NEW)
    with private_client(endpoint, SMALL, **kw) as client:  # type: ignore[arg-type]
        cached = [check_batch(client, model, prompts, want) for _ in range(2)]
        if cached[1]:
            check_fails_on_a_wrong_page(client, model, prompts, want)
        client.check_integrity()
    return cached


@pytest.mark.parametrize(
    ("length", "warm_hit"),
    [(5, 0), (16, 0), (17, 16), (70, 64)],
    ids=["shorter-than-a-page", "exactly-one-page", "one-page-plus-one", "many-pages"],
)
def test_batch_of_one_equals_dynamic_cache(
    endpoint: str, model: torch.nn.Module, length: int, warm_hit: int
) -> None:
    prompt = SMALL.prompt(length, seed=length)
    cached = kvcore_run(endpoint, model, [prompt])
    assert cached == [0, warm_hit]  # a hit covers whole pages and never the last token


def test_left_padded_batch_of_three_lengths(endpoint: str, model: torch.nn.Module) -> None:
    prompts = [SMALL.prompt(n, seed=100 + n) for n in (5, 16, 50)]
    cached = kvcore_run(endpoint, model, prompts)
    out = reference(model, prompts, NEW)
    for row, prompt in zip(out, prompts, strict=True):  # and each row equals its run alone
        assert torch.equal(row, reference(model, [prompt], NEW)[0])
    assert cached == [0, 48]  # only the 50-token row has a full page before its last token


def test_mixed_hits_in_one_batch(endpoint: str, model: torch.nn.Module) -> None:
    """Rows with different hits: only the columns every row has cached are skipped."""
    shared = SMALL.prompt(40, seed=7)
    first, second = shared + SMALL.prompt(3, seed=8), SMALL.prompt(30, seed=9)
    prompts = [first, second, shared + SMALL.prompt(9, seed=10)]
    ids, mask = padded(prompts)
    want = greedy(model, ids, NEW, attention_mask=mask)
    with private_client(endpoint, SMALL) as client:
        with KVCoreCache(client, model) as cache:
            greedy(model, torch.tensor([first]), 2, cache=cache)
        assert check_batch(client, model, prompts, want) == 32 + 0 + 32
        check_fails_on_a_wrong_page(client, model, prompts, want)


@pytest.mark.parametrize("order", ["PLKTH", "LPHKT", "PLHKT"])
def test_every_physical_order_decodes_transformers_tokens(
    endpoint: str, model: torch.nn.Module, order: str
) -> None:
    """The same pages in another physical order (page-major, head-outer): the kernels read
    the layer views' strides, so the tokens and hits are the layer-major pool's."""
    prompts = [SMALL.prompt(n, seed=200 + n) for n in (9, 40)]
    assert kvcore_run(endpoint, model, prompts, order=order) == [0, 32]


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
        cached = kvcore_run(endpoint, model, prompts, page_size=page_size)
        assert cached[1] == sum((n - 1) // page_size * page_size for n in (4, 11))


def check_bf16(
    client: Client, model: torch.nn.Module, prompt: list[int], tokens: list[int], ref: torch.Tensor
) -> int:
    """A bf16 adapter run of ``prompt`` made to pick transformers' ``tokens``: at every
    step its raw logits are within the step's bound of the reference's ``ref``, and
    wherever the reference's best two are more than twice the bound apart it picks the
    reference's token. Returns its cached tokens.

    The bound of step t is ``2 E_t``, E_t the largest distance of the reference's bf16
    logits from the float32 model's on the same tokens (the effect of bfloat16's
    rounding, measured): both bf16 runs round the same weights and the same operations'
    results to bfloat16, except inside attention, where the adapter rounds less (fp32
    arithmetic, one rounding of the output), so each is within about E_t of the float
    run and within 2 E_t of the other (triangle inequality)."""
    with KVCoreCache(client, model) as cache:
        _, logits = generate_logits(model, prompt, NEW, cache, force=tokens)
        cached = cache.num_cached_tokens
    exact = forward_logits(SMALL.build(), prompt, tokens)
    bound = 2 * (ref - exact).abs().amax(-1)  # [NEW]
    apart = (logits - ref).abs().amax(-1)
    assert bool((apart <= bound).all()), f"bf16 logits {apart} apart, bounds {bound}"
    top2 = ref.topk(2, dim=-1).values
    confident = top2[:, 0] - top2[:, 1] > 2 * bound
    best = logits.argmax(-1)[confident]
    assert torch.equal(best, torch.tensor(tokens)[confident]), "another token picked"
    return cached


def test_bfloat16_matches_within_rounding_noise(endpoint: str) -> None:
    """bf16: the torch backend attends in fp32 and rounds once, SDPA rounds inside, so the two
    runs' logits differ by bf16 noise and a free-running comparison flips at the first near
    tie. So the adapter run is fed the reference's tokens (teacher forcing through a logits
    processor) and compared step by step (check_bf16); the warm run with a page of the
    prompt is repeated with a wrong page, where the same check must fail."""
    model = SMALL.build("bfloat16")
    for length in (5, 16, 70):
        prompt = SMALL.prompt(length, seed=length)
        tokens, ref = generate_logits(model, prompt, NEW)
        with private_client(endpoint, SMALL, dtype="bfloat16") as client:
            cached = [check_bf16(client, model, prompt, tokens, ref) for _ in range(2)]
            assert cached == [0, (length - 1) // 16 * 16]  # cold, then the full pages cached
            if cached[1]:  # negative control
                pages = served_pages(client, cache_space(client, model), prompt[:-1])
                page, source = pages[0], other_page(client, pages)
                with wrong_page_fails(client, page, source, "logits|another token"):
                    check_bf16(client, model, prompt, tokens, ref)


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


def test_a_hit_brought_back_from_the_host_tier_counts_as_host(
    model: torch.nn.Module, tmp_path: Path
) -> None:
    """A pool of 8 pages with a host tier: a prompt's 2 full pages hit in the pool
    ("pool"), then, pushed out of it by other pages, come back from its host tier
    ("host"); every run decodes transformers' own tokens."""
    prompt = SMALL.prompt(40, seed=300)  # 2 full pages and 8 tokens
    want = reference(model, [prompt], 4)
    pool = f"{SMALL.pool_flag(num_pages=8)},host_tier=1MiB"
    figures = []
    with (
        DaemonProcess("--endpoint", f"ipc://{tmp_path / 'kv.sock'}", "--pool", pool) as daemon,
        Client.connect(daemon.endpoint) as client,
    ):
        for push_out in (False, False, True):
            if push_out:  # 8 other pages committed: the prompt's go to the host tier
                other = SMALL.prompt(8 * 16, seed=301)
                client.allocate(1, other, compute_last=False)
                client.commit(1, other)
                client.free(1)
            with KVCoreCache(client, model) as cache:
                assert torch.equal(greedy(model, torch.tensor([prompt]), 4, cache=cache), want)
            figures.append((cache.num_cached_tokens, cache.cached_tokens_by_source))
    assert figures == [(0, {}), (32, {"pool": 32}), (32, {"host": 32})]
