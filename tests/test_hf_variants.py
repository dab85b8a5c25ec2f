"""The transformers Cache on attention variants: sliding windows, logit soft-capping
and attention sinks, as the kernels' plan options (kvcore/integrations/hf_binding.py
``options``), on tiny random Gemma-2-style (windows + soft-cap), Gemma-3-style
(windows) and gpt-oss-style (windows + sinks, mixture-of-experts MLPs) models.

Per model, two engine processes on one daemon: engine A (a child process) generates
from a system prompt longer than the window plus its question; engine B (this
process) then asks another question after the same system prompt, is served the
system prompt's pages from the pool, and generates token for token what
transformers' own cache (DynamicCache, the model's eager attention) generates. The
window (24 tokens) starts mid-page (pages of 16) for every query past the first 24.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from hf_helpers import cache_space, engine_process, reference, served_pages, wrong_page_fails

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.demo_model import TinyGemma2, TinyGemma3, TinyGptOss, TinyLlama
from kvcore.integrations.transformers import KVCoreCache

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
PAGE = 16
MODELS: dict[str, TinyLlama] = {
    "gemma2": TinyGemma2(num_layers=2, window=24),
    "gemma3": TinyGemma3(num_layers=2, window=24),
    "gpt-oss": TinyGptOss(num_layers=2, window=24),
}
SYSTEM = TinyLlama().prompt(3 * PAGE, seed=11)  # 3 full pages, twice the window
NEW = 8


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("hf-variants")
    pool = TinyGemma3(num_layers=2).pool_flag(page_size=PAGE, num_pages=256)
    with DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", "--pool", pool) as d:
        yield d.endpoint


def generate(client: Client, model: torch.nn.Module, prompt: list[int]) -> tuple[int, list[int]]:
    ids = torch.tensor([prompt])
    with KVCoreCache(client, model) as cache, torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
        )
        return cache.num_cached_tokens, out[0, len(prompt) :].tolist()


def check_engine_b(client: Client, model: torch.nn.Module, prompt: list[int]) -> None:
    """Engine B's generate of ``prompt``: served A's pages of the system prompt, every
    layer, it decodes transformers' own tokens (AssertionError saying which fails)."""
    cached, tokens = generate(client, model, prompt)
    assert cached == len(SYSTEM), "engine B missed A's pages"
    assert tokens == reference(model, [prompt], NEW)[0].tolist(), "tokens not transformers'"


@pytest.mark.parametrize("name", MODELS)
def test_engine_b_hits_engine_a_and_decodes_what_transformers_decodes(
    endpoint: str, name: str
) -> None:
    spec = MODELS[name]
    first = SYSTEM + spec.prompt(7, seed=1)
    a = engine_process(spec, endpoint, first, NEW)
    model = spec.build()
    assert a["cached"] == 0
    assert a["tokens"] == reference(model, [first], NEW)[0].tolist()
    second = SYSTEM + spec.prompt(9, seed=2)
    with Client.connect(endpoint) as client:
        check_engine_b(client, model, second)
        # negative control: the last system page (inside every query's window) holding
        # the first's bytes, other tokens' K/V: the same check fails; restored, it passes
        pages = served_pages(client, cache_space(client, model), SYSTEM)
        with wrong_page_fails(client, pages[-1], pages[0], "not transformers'"):
            check_engine_b(client, model, second)
        check_engine_b(client, model, second)


def test_each_variant_changes_the_tokens() -> None:
    """Each option matters on these models: without it transformers decodes otherwise,
    so the equalities above hold only if the kernels apply the window, the soft-cap
    and the sinks."""
    prompt = SYSTEM + TinyLlama().prompt(9, seed=2)
    wide = 10**6  # a window wider than any prompt: full attention
    ablations = [
        (MODELS["gemma3"], dataclasses.replace(MODELS["gemma3"], window=wide)),
        (MODELS["gemma2"], dataclasses.replace(MODELS["gemma2"], window=wide)),
        (MODELS["gemma2"], dataclasses.replace(MODELS["gemma2"], soft_cap=1e9)),
        (MODELS["gpt-oss"], dataclasses.replace(MODELS["gpt-oss"], window=wide)),
    ]
    for spec, without in ablations:
        want = reference(spec.build(), [prompt], NEW)
        assert not torch.equal(reference(without.build(), [prompt], NEW), want), without
    sinkless = MODELS["gpt-oss"].build()
    want = reference(sinkless, [prompt], NEW)
    for layer in sinkless.model.layers:
        layer.self_attn.sinks.data.fill_(-1e9)  # exp(sink) = 0: no sink
    assert not torch.equal(reference(sinkless, [prompt], NEW), want)
