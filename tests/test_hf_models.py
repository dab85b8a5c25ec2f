"""Models are part of the key space: two transformers models of one geometry (a base
model and a "fine-tune": other weights) on one pool never share pages, and each
generates what transformers' own cache does; the same model does share, across model
objects; a copy of a checkpoint at another path shares only under one ``model_id``; a
random init from a checkpoint's config, and weights changed in place, are other models.
The rule itself: tests/test_model_identity.py; across processes: test_hf_crossprocess.

Every model here draws its weights with spread 0.15 (TinyLlama's init_std, saved in the
checkpoints' configs), so its logits are peaked and a wrong K/V changes its tokens.
Each test has a negative control that runs the same check where it must fail: a
must-share test with a wrong page served (hf_helpers.wrong_page); a must-not-share
test with the pages shared anyway, under one ``model_id`` (the operator's override,
which skips the weights' digest): the other model's pages then decode other tokens,
which is why they must not be shared."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hf_helpers import (
    SMALL,
    cache_space,
    held,
    module_endpoint,
    private_client,
    reference,
    served_pages,
    wrong_page_fails,
)
from transformers import AutoConfig, AutoModelForCausalLM

from kvcore import Client
from kvcore.integrations.transformers import KVCoreCache

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
SYSTEM = SMALL.prompt(48, seed=3)  # 3 full pages of 16
NEW = 8


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from module_endpoint(tmp_path_factory, "hf-models")


def run(
    client: Client, model: torch.nn.Module, prompt: list[int], **options: str
) -> tuple[int, torch.Tensor]:
    """(prompt tokens served from the pool, the new tokens) of one greedy generate."""
    ids = torch.tensor([prompt])
    with KVCoreCache(client, model, **options) as cache, torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
        )
        return cache.num_cached_tokens, out[:, ids.shape[1] :]


def check_own_tokens(
    client: Client, model: torch.nn.Module, prompt: list[int], cached: int, **options: str
) -> None:
    """A generate of ``prompt`` is served ``cached`` prompt tokens from the pool and decodes
    ``model``'s own tokens, transformers' (AssertionError saying which fails)."""
    hit, tokens = run(client, model, prompt, **options)
    assert hit == cached, f"served {hit} prompt tokens from the pool, not {cached}"
    assert torch.equal(tokens, reference(model, [prompt], NEW)), "not the model's own tokens"


def test_another_model_of_the_same_geometry_never_hits_and_decodes_its_own_tokens(
    endpoint: str,
) -> None:
    base, tuned = SMALL.build(), dataclasses.replace(SMALL, seed=1).build()
    with private_client(endpoint, SMALL) as client:
        cached, _ = run(client, base, SYSTEM + SMALL.prompt(12, seed=4))
        assert cached == 0
        prompt = SYSTEM + SMALL.prompt(12, seed=5)
        check_own_tokens(client, tuned, prompt, 0)  # the base model's pages are not its
        assert not torch.equal(reference(tuned, [prompt], NEW), reference(base, [prompt], NEW))
        cached, _ = run(client, base, prompt)  # the base model's own pages are there
        assert cached == len(SYSTEM)
        cached, _ = run(client, tuned, prompt)  # and so, now, are the fine-tune's
        assert cached == len(SYSTEM)
        # negative control: the base model's pages shared with the fine-tune anyway
        run(client, base, SYSTEM + SMALL.prompt(12, seed=17), model_id="one")
        with pytest.raises(AssertionError, match="not the model's own tokens"):
            check_own_tokens(client, tuned, prompt, len(SYSTEM), model_id="one")
        assert held(client) == (0, 0)


def test_the_same_model_built_twice_hits(endpoint: str) -> None:
    first, second = SMALL.build(), SMALL.build()  # one seed: equal weights, two objects
    with private_client(endpoint, SMALL) as client:
        run(client, first, SYSTEM + SMALL.prompt(12, seed=6))
        prompt = SYSTEM + SMALL.prompt(12, seed=7)
        check_own_tokens(client, second, prompt, len(SYSTEM))
        # negative control: the first system page holding the third's bytes
        pages = served_pages(client, cache_space(client, second), SYSTEM)
        with wrong_page_fails(client, pages[0], pages[2], "not the model's own tokens"):
            check_own_tokens(client, second, prompt, len(SYSTEM))


def test_a_copy_at_another_path_shares_only_under_one_model_id(
    endpoint: str, tmp_path: Path
) -> None:
    SMALL.build().save_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32)
    with private_client(endpoint, SMALL) as client:
        run(client, a, SYSTEM + SMALL.prompt(12, seed=8))
        prompt = SYSTEM + SMALL.prompt(12, seed=9)
        cached, _ = run(client, b, prompt)
        assert cached == 0  # another path: another model, unless the operator says so
        run(client, a, SYSTEM + SMALL.prompt(12, seed=10), model_id="tiny-llama")
        prompt = SYSTEM + SMALL.prompt(12, seed=11)
        check_own_tokens(client, b, prompt, len(SYSTEM), model_id="tiny-llama")
        # negative control: the first system page holding the third's bytes
        space = cache_space(client, b, model_id="tiny-llama")
        pages = served_pages(client, space, SYSTEM)
        with wrong_page_fails(client, pages[0], pages[2], "not the model's own tokens"):
            check_own_tokens(client, b, prompt, len(SYSTEM), model_id="tiny-llama")
        assert held(client) == (0, 0)


def test_a_random_init_from_a_checkpoints_config_never_hits_its_pages(
    endpoint: str, tmp_path: Path
) -> None:
    SMALL.build().save_pretrained(tmp_path / "a")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    config = AutoConfig.from_pretrained(tmp_path / "a")
    assert config.initializer_range >= 0.15  # TinyLlama's spread: peaked logits
    torch.manual_seed(7)
    fresh = AutoModelForCausalLM.from_config(config).eval()
    with private_client(endpoint, SMALL) as client:
        run(client, loaded, SYSTEM + SMALL.prompt(12, seed=12))
        prompt = SYSTEM + SMALL.prompt(12, seed=13)
        # the config names the checkpoint; the weights are others
        check_own_tokens(client, fresh, prompt, 0)
        # negative control: the checkpoint's pages shared with the random init anyway
        run(client, loaded, SYSTEM + SMALL.prompt(12, seed=18), model_id="one")
        with pytest.raises(AssertionError, match="not the model's own tokens"):
            check_own_tokens(client, fresh, prompt, len(SYSTEM), model_id="one")
        assert held(client) == (0, 0)


def test_weights_changed_in_place_through_data_miss_on_the_next_cache(endpoint: str) -> None:
    model = SMALL.build()
    with private_client(endpoint, SMALL) as client:
        run(client, model, SYSTEM + SMALL.prompt(12, seed=14))
        run(client, model, SYSTEM + SMALL.prompt(12, seed=14), model_id="one")
        cached, _ = run(client, model, SYSTEM + SMALL.prompt(12, seed=15))
        assert cached == len(SYSTEM)  # unchanged: its own pages
        model.model.layers[0].self_attn.k_proj.weight.data.mul_(1.5)  # no version bump
        prompt = SYSTEM + SMALL.prompt(12, seed=16)
        check_own_tokens(client, model, prompt, 0)
        # negative control: the pages of the weights before the change shared anyway
        # (one model_id skips the digest): the changed model decodes other tokens on them
        with pytest.raises(AssertionError, match="not the model's own tokens"):
            check_own_tokens(client, model, prompt, len(SYSTEM), model_id="one")
        assert held(client) == (0, 0)
