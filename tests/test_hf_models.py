"""Models are part of the key space: two transformers models of one geometry (a base
model and a "fine-tune": other weights) on one pool never share pages, and each
generates what transformers' own cache does; the same model does share, across model
objects; a copy of a checkpoint at another path shares only under one ``model_id``; a
random init from a checkpoint's config, and weights changed in place, are other models.
The rule itself: tests/test_model_identity.py; across processes: test_hf_crossprocess."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hf_helpers import SMALL, held, module_endpoint, private_client, reference
from transformers import AutoConfig, AutoModelForCausalLM

from kvcore import Client
from kvcore.integrations.transformers import KVCoreCache

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


def test_another_model_of_the_same_geometry_never_hits_and_decodes_its_own_tokens(
    endpoint: str,
) -> None:
    base, tuned = SMALL.build(), dataclasses.replace(SMALL, seed=1).build()
    with private_client(endpoint, SMALL) as client:
        cached, _ = run(client, base, SYSTEM + SMALL.prompt(12, seed=4))
        assert cached == 0
        prompt = SYSTEM + SMALL.prompt(12, seed=5)
        cached, tokens = run(client, tuned, prompt)
        assert cached == 0  # the base model's pages are not the fine-tune's
        assert torch.equal(tokens, reference(tuned, [prompt], NEW))
        assert not torch.equal(tokens, reference(base, [prompt], NEW))  # they differ
        cached, _ = run(client, base, prompt)  # the base model's own pages are there
        assert cached == len(SYSTEM)
        cached, _ = run(client, tuned, prompt)  # and so, now, are the fine-tune's
        assert cached == len(SYSTEM)
        assert held(client) == (0, 0)


def test_the_same_model_built_twice_hits(endpoint: str) -> None:
    first, second = SMALL.build(), SMALL.build()  # one seed: equal weights, two objects
    with private_client(endpoint, SMALL) as client:
        run(client, first, SYSTEM + SMALL.prompt(12, seed=6))
        prompt = SYSTEM + SMALL.prompt(12, seed=7)
        cached, tokens = run(client, second, prompt)
        assert cached == len(SYSTEM)
        assert torch.equal(tokens, reference(second, [prompt], NEW))


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
        cached, tokens = run(client, b, prompt, model_id="tiny-llama")
        assert cached == len(SYSTEM)
        assert torch.equal(tokens, reference(b, [prompt], NEW))
        assert held(client) == (0, 0)


def test_a_random_init_from_a_checkpoints_config_never_hits_its_pages(
    endpoint: str, tmp_path: Path
) -> None:
    SMALL.build().save_pretrained(tmp_path / "a")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    torch.manual_seed(7)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "a")).eval()
    with private_client(endpoint, SMALL) as client:
        run(client, loaded, SYSTEM + SMALL.prompt(12, seed=12))
        prompt = SYSTEM + SMALL.prompt(12, seed=13)
        cached, tokens = run(client, fresh, prompt)
        assert cached == 0  # the config names the checkpoint; the weights are others
        assert torch.equal(tokens, reference(fresh, [prompt], NEW))
        assert held(client) == (0, 0)


def test_weights_changed_in_place_through_data_miss_on_the_next_cache(endpoint: str) -> None:
    model = SMALL.build()
    with private_client(endpoint, SMALL) as client:
        run(client, model, SYSTEM + SMALL.prompt(12, seed=14))
        cached, _ = run(client, model, SYSTEM + SMALL.prompt(12, seed=15))
        assert cached == len(SYSTEM)  # unchanged: its own pages
        model.model.layers[0].self_attn.k_proj.weight.data.mul_(1.5)  # no version bump
        prompt = SYSTEM + SMALL.prompt(12, seed=16)
        cached, tokens = run(client, model, prompt)
        assert cached == 0
        assert torch.equal(tokens, reference(model, [prompt], NEW))
        assert held(client) == (0, 0)
