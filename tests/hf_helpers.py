"""Shared set-up of the transformers adapter tests: a daemon, private pools, reference runs,
logits of teacher-forced runs, and the wrong page of the negative controls."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kvcore import Client, KVLayout
from kvcore.daemon_process import DaemonProcess
from kvcore.demo_model import TinyLlama, greedy
from kvcore.integrations.transformers import KVCoreCache
from kvcore.layout import DEFAULT_ORDER
from kvcore.prefix import KeySpace, encode_tokens, page_keys, root_key
from kvcore.testing import tolerance

# Small enough for 2 cores: 2 layers, hidden 128, GQA 4 query / 2 KV heads, head dim 32.
SMALL = TinyLlama(
    num_layers=2,
    hidden_size=128,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=256,
    vocab_size=256,
)


@contextmanager
def daemon(tmp: Path) -> Iterator[DaemonProcess]:
    """A daemon that lets each test attach a private (ephemeral) pool of its own layout."""
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp / 'kv.sock'}",
        "--allow-ephemeral",
        "--pool",
        SMALL.pool_flag(num_pages=8),
    ) as d:
        yield d


def module_endpoint(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[str]:
    """Body of a module-scoped ``endpoint`` fixture: a daemon, with torch on one thread
    while the module runs (small matmuls: threads only contend on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with daemon(tmp_path_factory.mktemp(name)) as d:
            yield d.endpoint
    finally:
        torch.set_num_threads(threads)


def private_client(
    endpoint: str,
    spec: TinyLlama,
    *,
    dtype: str = "float32",
    page_size: int = 16,
    num_pages: int = 256,
    order: str = DEFAULT_ORDER,
) -> Client:
    """A session on a fresh pool that fits ``spec`` (in physical ``order``); gone when the
    client closes."""
    layout = KVLayout(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, dtype, num_pages, order=order
    )
    return Client.connect(endpoint, pool=f"t-{secrets.token_hex(4)}", layout=layout, ephemeral=True)


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids and attention_mask for ``prompts`` (pad id 0)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def reference(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """transformers' own run (DynamicCache) of the left-padded batch."""
    ids, mask = padded(prompts)
    return greedy(model, ids, new_tokens, attention_mask=mask)  # type: ignore[arg-type]


def held(client: Client) -> tuple[int, int]:
    """(live sequences, held pages) of the client's pool."""
    stats = client.stats()
    return stats.num_sequences, stats.held_pages


ENGINE = r"""
import json, sys, torch
from kvcore import Client
from kvcore.demo_model import *  # the spec's class, by its repr
from kvcore.integrations.transformers import KVCoreCache
spec, endpoint, prompt, new = eval(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
model = spec.build()
ids = torch.tensor([prompt])
with Client.connect(endpoint) as client, KVCoreCache(client, model) as cache, torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                         max_new_tokens=new, min_new_tokens=new, do_sample=False)
    print(json.dumps({"cached": cache.num_cached_tokens, "tokens": out[0, len(prompt):].tolist()}))
"""


def engine_process(spec: TinyLlama, endpoint: str, prompt: list[int], new: int) -> dict[str, Any]:
    """One greedy generate of ``spec``'s model (any kvcore.demo_model spec) on a
    KVCoreCache, in an engine process of its own: ``cached`` (prompt tokens served
    from the pool) and the new ``tokens``."""
    argv = [sys.executable, "-c", ENGINE, repr(spec), endpoint, json.dumps(prompt), str(new)]
    result: dict[str, Any] = json.loads(
        subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    )
    return result


# -- logits of a run, teacher-forced ----------------------------------------------------


class Force(LogitsProcessor):
    """Makes step i of a generate pick ``tokens[i]``; the raw logits are still reported."""

    def __init__(self, tokens: list[int], prompt_length: int) -> None:
        self.tokens = tokens
        self.start = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.start]] = 0
        return forced


def generate_logits(
    model: torch.nn.Module,
    prompt: list[int],
    new: int,
    cache: Any = None,
    force: list[int] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """A greedy generate of ``new`` tokens (with ``cache``: None is transformers' own
    DynamicCache), made to pick ``force`` if given: (its tokens, the raw logits of
    each step [new, vocab] float32)."""
    processors = LogitsProcessorList()
    if force is not None:
        processors.append(Force(force, len(prompt)))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            logits_processor=processors,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.logits, dim=1)[0].float()


def forward_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits [len(tokens), vocab] float32 that predict ``tokens`` after ``prompt``,
    from one forward over ``prompt + tokens[:-1]`` without a cache."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits: torch.Tensor = model(ids).logits[0, len(prompt) - 1 :].float()
    return logits


def chosen(logprobs: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Each step's log-probability [len(tokens)] of its token."""
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]


# -- negative controls: a wrong page ------------------------------------------------------


def longest_reduction(spec: TinyLlama, tokens: int) -> int:
    """The most terms any sum of ``spec``'s model adds up over ``tokens`` tokens: a
    projection (hidden), the MLP's down projection (intermediate), attention (tokens)
    or, on MLA, a latent's key and value chain (kv_lora_rank + qk_nope_head_dim)."""
    latent = getattr(spec, "kv_lora_rank", 0) + getattr(spec, "qk_nope_head_dim", 0)
    return max(spec.hidden_size, spec.intermediate_size, tokens, latent)


def float32_runs(spec: TinyLlama, bf16_effect: float, tokens: int) -> tolerance.Tolerance:
    """Bound on one output (a logit, a log-probability) of two float32 runs of ``spec``'s
    model over ``tokens`` tokens that sum in other orders (a paged kernel against SDPA,
    absorbed against expanded MLA): ``tolerance.rescaled`` from ``bf16_effect``, how far
    a bfloat16 run of the same weights is from the float run on the same inputs, to a
    relative ``tolerance.reordered(n)`` per operation, n = longest_reduction."""
    n = longest_reduction(spec, tokens)
    d = tolerance.reordered(n)
    atol = tolerance.rescaled(bf16_effect, tolerance.unit_roundoff("bfloat16"), d)
    why = f"float32 runs: {bf16_effect:.3g} (a bf16 run's distance) x 2 gamma({n}) / u(bf16)"
    return tolerance.Tolerance(atol, 0.0, why)


def cache_space(client: Client, model: torch.nn.Module, **options: str) -> KeySpace:
    """The key space a KVCoreCache of ``model`` on ``client`` files its pages under."""
    with KVCoreCache(client, model, **options) as cache:
        return cache.space


def served_pages(client: Client, space: KeySpace, tokens: list[int]) -> list[int]:
    """The committed pool pages holding the full pages of ``tokens`` under ``space``, in
    order: what an engine on that key space is served for a prompt that starts so."""
    size = client.layout.page_size
    parent = root_key(space.resolved(client.namespace))
    keys = page_keys(parent, encode_tokens(tokens[: len(tokens) // size * size]), size)
    by_key = {p.key: p.page for p in client.snapshot().pages}
    missing = sum(key not in by_key for key in keys)
    assert not missing, f"{missing} of the {len(keys)} pages of the prompt are not committed"
    return [by_key[key] for key in keys]


def other_page(client: Client, pages: list[int]) -> int:
    """A committed page of the pool that is none of ``pages``: other tokens' K/V."""
    others = [p.page for p in client.snapshot().pages if p.page not in pages]
    assert others, "the pool holds no committed page besides these"
    return others[0]


@contextmanager
def wrong_page(client: Client, page: int, source: int) -> Iterator[None]:
    """A negative control: pool page ``page`` holds the bytes of page ``source`` in every
    layer (the K/V of other tokens, as a stale or misrouted page would) until the block
    ends, then its own again. Two pages of one prefix swapped would not do: attention
    over a prefix is a sum over its tokens, in any order (their positions are rotated
    into K before it is stored), so the outputs would not move. A run inside commits
    its new full pages, K/V computed over the wrong page, under the keys of the tokens it
    generated: no later prompt of the pool should extend it."""
    assert page != source
    saved = [layer[page].clone() for layer in client.kv_caches]
    for layer in client.kv_caches:
        layer[page].copy_(layer[source])
    try:
        yield
    finally:
        for layer, bytes_ in zip(client.kv_caches, saved, strict=True):
            layer[page].copy_(bytes_)


@contextmanager
def wrong_page_fails(client: Client, page: int, source: int, match: str) -> Iterator[None]:
    """A negative control: the check run inside must raise an AssertionError matching
    ``match`` while page ``page`` holds page ``source``'s bytes (:func:`wrong_page`)."""
    with wrong_page(client, page, source), pytest.raises(AssertionError, match=match):
        yield
