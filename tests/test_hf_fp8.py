"""The transformers Cache on fp8 pools: a float32 model's K/V stored as float8_e4m3fn
or float8_e5m2 (saturating, scales 1.0), dequantized by the kernels on load.

fp8 is lossy, so the reference is transformers running with its K/V quantized the
same way (a DynamicCache that rounds what it stores to the format and back), not its
float run: engine A's and engine B's log-probabilities of every generated token equal
that reference's within 1e-4 nats (float32 arithmetic in both, in another order), and
their tokens are the reference's. Engine B is served the system prompt's pages engine
A wrote. The float run decodes otherwise on these prompts (the test checks), so the
comparison is not one fp8 cannot fail.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hf_helpers import SMALL, module_endpoint
from transformers import DynamicCache

from kvcore import Client
from kvcore.backend import FP8_MAX
from kvcore.integrations.transformers import KVCoreCache
from kvcore.layout import KVLayout

SYSTEM = SMALL.prompt(48, seed=21)  # 3 full pages
NEW = 8
TOLERANCE = 1e-4  # nats, per token's log-probability


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from module_endpoint(tmp_path_factory, "hf-fp8")


class QuantizedKV(DynamicCache):
    """transformers' own cache, storing K/V rounded to ``dtype`` (saturating) and back."""

    def __init__(self, dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fp8 = dtype
        self.limit = FP8_MAX[str(dtype).removeprefix("torch.")]

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        def rounded(x: torch.Tensor) -> torch.Tensor:
            return x.float().clamp(-self.limit, self.limit).to(self.fp8).to(x.dtype)

        return super().update(rounded(key), rounded(value), *args, **kwargs)


def generate(
    model: torch.nn.Module, prompt: list[int], cache: Any
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and each one's log-probability."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :]
    logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
    return tokens.tolist(), logprobs.gather(1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_two_engines_on_an_fp8_pool_decode_what_quantized_transformers_decodes(
    endpoint: str, dtype: str
) -> None:
    model = SMALL.build()
    layout = KVLayout(SMALL.num_layers, SMALL.num_kv_heads, SMALL.head_dim, 16, dtype, 128)
    fp8 = getattr(torch, dtype)
    prompts = [SYSTEM + SMALL.prompt(7, seed=1), SYSTEM + SMALL.prompt(9, seed=2)]
    with Client.connect(
        endpoint, pool=f"t-{secrets.token_hex(4)}", layout=layout, ephemeral=True
    ) as client:
        for engine, prompt in zip("AB", prompts, strict=True):
            with KVCoreCache(client, model) as cache:
                tokens, logprobs = generate(model, prompt, cache)
                cached = cache.num_cached_tokens
            want_tokens, want = generate(model, prompt, QuantizedKV(fp8))
            assert tokens == want_tokens, engine
            assert float((logprobs - want).abs().max()) <= TOLERANCE, engine
            assert cached == (0 if engine == "A" else len(SYSTEM)), engine
    tokens, quantized = generate(model, prompts[1], QuantizedKV(fp8))
    ids = torch.tensor([prompts[1] + tokens[:-1]])
    with torch.no_grad():  # the float run's log-probabilities of the same tokens
        logits = model(ids).logits[0, len(prompts[1]) - 1 :].float()
    exact = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert float((exact - quantized).abs().max()) > 10 * TOLERANCE  # fp8 shows
