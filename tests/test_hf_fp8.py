"""The transformers Cache on fp8 pools: a float32 model's K/V stored as float8_e4m3fn
or float8_e5m2 (saturating, scales 1.0), dequantized by the kernels on load.

fp8 is lossy, so the reference is transformers running with its K/V quantized the
same way (a DynamicCache that rounds what it stores to the format and back), not its
float run. Engine A, then engine B (served the system prompt's pages engine A wrote),
generates made to pick the reference's tokens; each token's log-probability is within
:func:`bound` of the reference's, and wherever the reference's best two tokens are
further apart than twice that, the engine's best is the reference's. The float run
would fail the same bound on these prompts (the test checks), and so does engine B
served a wrong page (the negative control).

The bound is derived, not fitted (kvcore.testing.tolerance): the engine and the
reference compute in float32 in other orders, so a few K/V elements within a few ulps
of an fp8 rounding midpoint round to neighbouring fp8 values in one run and not the
other (an AMD EPYC rounds other elements than a Xeon does); each such flip moves a
log-probability by far more than float32 noise.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hf_helpers import (
    SMALL,
    cache_space,
    chosen,
    float32_runs,
    forward_logits,
    generate_logits,
    longest_reduction,
    module_endpoint,
    served_pages,
    wrong_page_fails,
)
from transformers import DynamicCache

from kvcore import Client
from kvcore.backend import FP8_MAX
from kvcore.integrations.transformers import KVCoreCache
from kvcore.layout import KVLayout
from kvcore.testing import tolerance

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
SYSTEM = SMALL.prompt(48, seed=21)  # 3 full pages
NEW = 8
TAIL = 1e-6  # the chance that more K/V elements flip than the bound allows for


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


@dataclass(frozen=True, slots=True)
class Reference:
    """Quantized transformers' greedy run of one prompt, and the bound an engine's run of
    it is held to."""

    tokens: list[int]
    logprobs: torch.Tensor  # [NEW] of its tokens
    gaps: torch.Tensor  # [NEW] its best minus its second-best log-probability
    exact: torch.Tensor  # [NEW] the float run's log-probabilities of the same tokens
    bound: float  # nats
    why: str


def bound(
    prompt: list[int], fp8: torch.dtype, fp8_effect: float, bf16_effect: float
) -> tuple[float, str]:
    """Derived bound, in nats, on |engine - reference| for a token's log-probability.

    * Elements: the first new token attends ``N = len(prompt) x layers x Hkv x D x 2``
      fp8 K/V elements (later ones attend more; fewer is the stricter case).
    * Disagreement: every K/V element is a float32 result of sums of at most
      ``n = longest_reduction`` terms, so the engine's and the reference's values
      before rounding are within ``d = tolerance.reordered(n)`` (``2 gamma_n``) of each
      other, relative.
    * Flips: ``tolerance.fp8_flips(N, fp8, d, TAIL)`` elements at most round to
      neighbouring fp8 values (one step apart) in the two runs; their effect is
      ``tolerance.subset_effect(fp8_effect, N, flips)``, ``fp8_effect`` the measured
      distance of the quantized run from the float run (every element rounded).
    * float32: the rest of the two runs differs by reordered sums: ``float32_runs``,
      from ``bf16_effect``, the measured distance of a bfloat16 run from the float run.
    """
    elements = len(prompt) * SMALL.num_layers * SMALL.num_kv_heads * SMALL.head_dim * 2
    d = tolerance.reordered(longest_reduction(SMALL, len(prompt) + NEW))
    flips = tolerance.fp8_flips(elements, fp8, d, TAIL)
    from_flips = tolerance.subset_effect(fp8_effect, elements, flips)
    from_fp32 = float32_runs(SMALL, bf16_effect, len(prompt) + NEW)
    why = (
        f"{flips} of {elements} elements flipped: sqrt(12 x {flips} / {elements}) x "
        f"{fp8_effect:.3g} (fp8's effect) = {from_flips:.3g}, + {from_fp32}"
    )
    return from_flips + from_fp32.atol, why


def reference(
    model: torch.nn.Module, coarse: torch.nn.Module, prompt: list[int], fp8: torch.dtype
) -> Reference:
    """Quantized transformers' run of ``prompt``, the float run (``model``) and a bfloat16
    run (``coarse``, the same weights) of its tokens, and the bound they give."""
    tokens, logits = generate_logits(model, prompt, NEW, QuantizedKV(fp8))
    logprobs = logits.log_softmax(-1)
    top2 = logprobs.topk(2, dim=-1).values
    exact = chosen(forward_logits(model, prompt, tokens).log_softmax(-1), tokens)
    rounded = chosen(forward_logits(coarse, prompt, tokens).log_softmax(-1), tokens)
    quantized = chosen(logprobs, tokens)
    fp8_effect = float((exact - quantized).abs().max())
    limit, why = bound(prompt, fp8, fp8_effect, float((exact - rounded).abs().max()))
    return Reference(tokens, quantized, top2[:, 0] - top2[:, 1], exact, limit, why)


def check_engine(
    client: Client, model: torch.nn.Module, prompt: list[int], ref: Reference
) -> tuple[int, torch.Tensor]:
    """One engine's generate of ``prompt`` on a KVCoreCache, made to pick ``ref``'s tokens:
    each token's log-probability within ``ref.bound`` of the reference's (AssertionError
    naming the distance otherwise); wherever the reference's best two are more than
    twice the bound apart, the engine's best is the reference's token (each
    log-probability within the bound, so the order of those two cannot change).
    Returns (prompt tokens served from the pool, the engine's log-probabilities)."""
    with KVCoreCache(client, model) as cache:
        _, logits = generate_logits(model, prompt, NEW, cache, force=ref.tokens)
        cached = cache.num_cached_tokens
    logprobs = logits.log_softmax(-1)
    got = chosen(logprobs, ref.tokens)
    apart = float((got - ref.logprobs).abs().max())
    assert apart <= ref.bound, (
        f"log-probabilities {apart:.3g} nats from quantized transformers' (bound "
        f"{ref.bound:.3g} nats: {ref.why})"
    )
    confident = ref.gaps > 2 * ref.bound
    best = logprobs.argmax(-1)[confident]
    assert torch.equal(best, torch.tensor(ref.tokens)[confident]), "another token picked"
    return cached, got


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_two_engines_on_an_fp8_pool_decode_what_quantized_transformers_decodes(
    endpoint: str, dtype: str
) -> None:
    model, coarse = SMALL.build(), SMALL.build("bfloat16")
    layout = KVLayout(SMALL.num_layers, SMALL.num_kv_heads, SMALL.head_dim, 16, dtype, 128)
    fp8 = getattr(torch, dtype)
    prompts = [SYSTEM + SMALL.prompt(7, seed=1), SYSTEM + SMALL.prompt(9, seed=2)]
    with Client.connect(
        endpoint, pool=f"t-{secrets.token_hex(4)}", layout=layout, ephemeral=True
    ) as client:
        for engine, prompt in zip("AB", prompts, strict=True):
            ref = reference(model, coarse, prompt, fp8)
            cached, got = check_engine(client, model, prompt, ref)
            assert cached == (0 if engine == "A" else len(SYSTEM)), engine
        # the float run's log-probabilities would fail the bound: fp8 shows
        assert float((ref.exact - got).abs().max()) > ref.bound, ref.why
        # negative control: engine B again, the first system page holding the third's
        # bytes (other tokens' K/V) -- the same check must fail
        pages = served_pages(client, cache_space(client, model), SYSTEM)
        with wrong_page_fails(client, pages[0], pages[2], "nats from quantized transformers'"):
            check_engine(client, model, prompts[1], ref)
        check_engine(client, model, prompts[1], ref)  # the page is back: B passes again
