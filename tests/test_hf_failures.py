"""KVCoreCache when things go wrong: nothing stays held in the daemon, errors are typed."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from hf_helpers import SMALL, daemon, held, module_endpoint, padded, private_client, reference
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from kvcore import Client
from kvcore.demo_model import greedy
from kvcore.errors import BadRequest, LayoutMismatch, OutOfPages, Timeout, Unsupported
from kvcore.integrations.transformers import KVCoreCache
from kvcore.layout import KVLayout


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from module_endpoint(tmp_path_factory, "hf-fail")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return SMALL.build()


class _FailAt:
    """A forward hook on one decoder layer that raises on its ``step``-th call."""

    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.calls += 1
        if self.calls == self.step:
            raise ValueError(f"injected failure in forward {self.step}")


def test_a_forward_failing_midway_frees_every_sequence_at_once(
    endpoint: str, model: torch.nn.Module
) -> None:
    prompts = [SMALL.prompt(n, seed=n) for n in (20, 35)]
    ids, mask = padded(prompts)
    layer = model.model.layers[1]  # type: ignore[union-attr,index]
    handle = layer.register_forward_hook(_FailAt(step=4))  # prefill + 2 decode steps, then fail
    with private_client(endpoint, SMALL) as client:
        try:
            cache = KVCoreCache(client, model)  # deliberately no `with`: the hook must free
            with pytest.raises(ValueError, match="injected failure"):
                greedy(model, ids, 10, attention_mask=mask, cache=cache)
            assert held(client) == (0, 0)
            with pytest.raises(BadRequest, match="spent"):  # the cache cannot be reused
                greedy(model, ids, 2, attention_mask=mask, cache=cache)
            cache.close()
            assert held(client) == (0, 0)
            client.check_integrity()
        finally:
            handle.remove()
    assert model.config._attn_implementation == "sdpa"


def test_a_second_generate_on_one_cache_is_refused_before_writing(
    endpoint: str, model: torch.nn.Module
) -> None:
    """Its forward restarts the positions: fed on top of the first call's pages, its K/V
    would be wrong and (at close) committed under the rows' tokens for later requests."""
    first, second = SMALL.prompt(20, seed=6), SMALL.prompt(20, seed=7)
    with private_client(endpoint, SMALL) as client:
        reused = KVCoreCache(client, model)  # no `with`: the refused forward must free
        greedy(model, torch.tensor([first]), 3, cache=reused)
        with pytest.raises(BadRequest, match="one generate call"):
            greedy(model, torch.tensor([second]), 3, cache=reused)
        assert held(client) == (0, 0)
        reused.close()
        ids, mask = padded([first, second])  # padded rows: the mask width gives it away
        with KVCoreCache(client, model) as cache:
            greedy(model, ids, 2, attention_mask=mask, cache=cache)
            with pytest.raises(BadRequest, match="one generate call"):
                greedy(model, ids, 2, attention_mask=mask, cache=cache)
            assert held(client) == (0, 0)
        # only the first call's own pages were published: a fresh cache still matches
        with KVCoreCache(client, model) as cache:
            out = greedy(model, torch.tensor([first + second[:12]]), 4, cache=cache)
            assert cache.num_cached_tokens == 16
        assert torch.equal(out, reference(model, [first + second[:12]], 4))
        client.check_integrity()


class _InterruptAt(_FailAt):
    def __call__(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.calls += 1
        if self.calls == self.step:
            raise KeyboardInterrupt


def test_a_keyboard_interrupt_in_a_forward_ends_the_step_as_failed(
    endpoint: str, model: torch.nn.Module
) -> None:
    prompts = [SMALL.prompt(20, seed=8), SMALL.prompt(27, seed=9)]
    ids, mask = padded(prompts)
    want = reference(model, prompts, 5)
    hidden = model.model(ids, attention_mask=mask, cache=DynamicCache()).last_hidden_state  # type: ignore[operator,union-attr]
    layer = model.model.layers[0]  # type: ignore[union-attr,index]
    handle = layer.register_forward_hook(_InterruptAt(step=3))  # prefill, 1 decode, then ^C
    with private_client(endpoint, SMALL) as client:
        try:
            cache = KVCoreCache(client, model)  # no `with`: the step itself must free
            with pytest.raises(KeyboardInterrupt):
                greedy(model, ids, 5, attention_mask=mask, cache=cache)
        finally:
            handle.remove()
        assert held(client) == (0, 0)
        with pytest.raises(BadRequest, match="spent"):
            greedy(model, ids, 2, attention_mask=mask, cache=cache)
        # the inner model (no pre-forward of the bound model runs) is transformers' own again
        again = model.model(ids, attention_mask=mask, cache=DynamicCache()).last_hidden_state  # type: ignore[operator,union-attr]
        assert torch.equal(again, hidden)
        assert torch.equal(reference(model, prompts, 5), want)
        cache.close()
        assert held(client) == (0, 0)
        client.check_integrity()
    assert model.config._attn_implementation == "sdpa"


class _RaiseAt(LogitsProcessor):
    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.step:
            raise RuntimeError("invalid input on step 3")
        return scores


def test_generate_raising_between_forwards_frees_on_leaving_with(
    endpoint: str, model: torch.nn.Module
) -> None:
    prompt = SMALL.prompt(40, seed=1)
    with private_client(endpoint, SMALL) as client:
        with pytest.raises(RuntimeError, match="step 3"), KVCoreCache(client, model) as cache:
            greedy(
                model,
                torch.tensor([prompt]),
                10,
                cache=cache,
                logits_processor=LogitsProcessorList([_RaiseAt(3)]),
            )
        assert held(client) == (0, 0)
        # what was fully written before the failure was still published: a later run hits it
        with KVCoreCache(client, model) as cache:
            greedy(model, torch.tensor([prompt]), 2, cache=cache)
            assert cache.num_cached_tokens == 32


def test_running_out_of_pages_midway_is_typed_and_leaves_nothing(
    endpoint: str, model: torch.nn.Module
) -> None:
    prompt = SMALL.prompt(30, seed=2)  # 2 pages of 16; the pool has 3
    with private_client(endpoint, SMALL, num_pages=3) as client:
        with pytest.raises(OutOfPages), KVCoreCache(client, model) as cache:
            greedy(model, torch.tensor([prompt]), 40, cache=cache)  # needs a 5th page at step 19
        assert held(client) == (0, 0)
        with pytest.raises(OutOfPages), KVCoreCache(client, model) as cache:  # at allocate
            ids, mask = padded([prompt, SMALL.prompt(31, seed=3)])
            greedy(model, ids, 2, attention_mask=mask, cache=cache)
        assert held(client) == (0, 0)
        client.check_integrity()


def test_bad_inputs_are_typed_errors(endpoint: str, model: torch.nn.Module) -> None:
    ids = torch.tensor([SMALL.prompt(8, seed=4), SMALL.prompt(8, seed=5)])
    right_padded = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    with private_client(endpoint, SMALL) as client:
        with pytest.raises(BadRequest, match="left padding"), KVCoreCache(client, model) as cache:
            greedy(model, ids, 2, attention_mask=right_padded, cache=cache)
        with pytest.raises(Unsupported, match="beam"), KVCoreCache(client, model) as cache:
            greedy(model, ids, 4, num_beams=2, cache=cache)
        assert held(client) == (0, 0)


def test_a_pool_that_does_not_fit_the_model_is_refused(
    endpoint: str, model: torch.nn.Module
) -> None:
    for other in (replace(SMALL, num_kv_heads=4), replace(SMALL, num_layers=3)):
        with private_client(endpoint, other) as client, pytest.raises(LayoutMismatch):
            KVCoreCache(client, model)
    with (
        private_client(endpoint, SMALL, dtype="bfloat16") as client,
        pytest.raises(LayoutMismatch, match="dtype"),
    ):
        KVCoreCache(client, model)
    assert model.config._attn_implementation == "sdpa"  # a refused cache never bound


def test_a_latent_pool_for_a_model_without_mla_is_a_layout_mismatch(
    endpoint: str, model: torch.nn.Module
) -> None:
    layout = KVLayout(SMALL.num_layers, 1, 2 * SMALL.head_dim, 16, "float32", 64, kind="latent")
    pool = f"t-{secrets.token_hex(4)}"
    with (
        Client.connect(endpoint, pool=pool, layout=layout, ephemeral=True) as client,
        pytest.raises(LayoutMismatch, match="kind=kv"),
    ):
        KVCoreCache(client, model)
    assert model.config._attn_implementation == "sdpa"  # a refused cache never bound


def test_a_timed_out_start_leaves_nothing_held(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A timeout says nothing of what ran: every sequence the batch may have made is freed."""
    import os
    import signal

    from kvcore import Client
    from kvcore.integrations.paged_rows import PagedRows
    from kvcore.prefix import KeySpace

    with daemon(tmp_path_factory.mktemp("hf-timeout")) as d:
        assert d.proc is not None
        with Client.connect(d.endpoint, map_memory=False, timeout_s=0.2) as client:
            rows = PagedRows(client, torch.device("cpu"), KeySpace(model="t"))
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(Timeout):
                    rows.start(torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]), None)
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            rows.close()
            stats = client.stats()
            assert (stats.num_sequences, stats.held_pages) == (0, 0)
