"""A small Llama-architecture model built from a config in code: nothing is downloaded.

Used by ``kvcore demo``, ``kvcore bench e2e`` and the adapter's tests. Weights are
random from a fixed seed, drawn with a larger spread than transformers' default
init (``initializer_range`` 0.02 makes a random model repeat one token forever),
so greedy decoding walks through varied tokens and a wrong K/V shows up as a
different token within a few steps.

GQA (4 query heads, 2 KV heads), head dim 64, RoPE; sizes in elements, lengths
in tokens. :func:`pool_flag` gives the ``kvcore serve --pool`` value whose layout
matches the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class TinyLlama:
    """Model geometry. Frozen: one spec builds identical weights in every process."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_positions: int = 2048
    init_std: float = 0.15
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def config_fields(self) -> dict[str, Any]:
        """The transformers config fields of this geometry that every architecture here
        shares (sizes, token ids, the init spread)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_positions,
            "initializer_range": self.init_std,
            "bos_token_id": 1,
            "eos_token_id": None,
            "pad_token_id": 0,
            "tie_word_embeddings": False,
        }

    def build(self, dtype: str = "float32", attn_implementation: str = "sdpa") -> LlamaForCausalLM:
        """The model in eval mode on CPU, in ``dtype`` ("float32", "bfloat16", "float16")."""
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(  # type: ignore[call-arg]
            **self.config_fields(), attn_implementation=attn_implementation
        )
        built: LlamaForCausalLM = self._seeded(LlamaForCausalLM, config, dtype)
        return built

    def _seeded(self, cls: Any, config: Any, dtype: str) -> Any:
        """``cls(config)`` drawn from this spec's seed (the caller's RNG left as it was),
        in eval mode, in ``dtype``, generating without an end token."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = cls(config)
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
        return model.to(getattr(torch, dtype)).eval()

    def pool_flag(
        self,
        *,
        dtype: str = "float32",
        page_size: int = 16,
        num_pages: int = 1024,
        name: str = "default",
    ) -> str:
        """``kvcore serve --pool`` value for a host pool that fits this model."""
        return (
            f"name={name},device=cpu,num_layers={self.num_layers},num_kv_heads={self.num_kv_heads},"
            f"head_dim={self.head_dim},page_size={page_size},dtype={dtype},num_pages={num_pages}"
        )

    def prompt(self, length: int, seed: int) -> list[int]:
        """``length`` random token ids in [3, vocab) (0-2 are pad/bos/eos), from ``seed``."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        ids: torch.Tensor = torch.randint(3, self.vocab_size, (length,), generator=gen)
        return [int(t) for t in ids.tolist()]


@dataclass(frozen=True, slots=True)
class TinyGemma3(TinyLlama):
    """A Gemma-3-style hybrid of the same geometry: layers alternate between a sliding
    window of ``window`` tokens (even layers) and full attention (odd layers), as vLLM's
    hybrid KV cache allocator serves them (two KV cache groups)."""

    window: int = 64

    @property
    def layer_types(self) -> list[str]:
        return [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_layers)
        ]

    def build(self, dtype: str = "float32", attn_implementation: str = "sdpa") -> Any:
        """The model (transformers' ``Gemma3ForCausalLM``) in eval mode on CPU."""
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(  # type: ignore[call-arg]
            **self.config_fields(),
            sliding_window=self.window,
            layer_types=self.layer_types,
            attn_implementation=attn_implementation,
        )
        return self._seeded(Gemma3ForCausalLM, config, dtype)


def timed_greedy(
    model: LlamaForCausalLM, rows: list[list[int]], new_tokens: int, cache: object
) -> tuple[torch.Tensor, list[float]]:
    """Greedy generate over unpadded ``rows`` with ``cache``: (new tokens [B, new_tokens],
    [start, time after step 1, after step 2, ...]) in ``time.perf_counter`` seconds.
    ``stamps[1] - stamps[0]`` is the time to first token."""
    import time

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps = [time.perf_counter()]

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(rows)
    new = greedy(
        model,
        ids,
        new_tokens,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        logits_processor=LogitsProcessorList([Stamp()]),
    )
    return new, stamps


def greedy(
    model: LlamaForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: object
) -> torch.Tensor:
    """Greedy generate's new tokens [B, max_new_tokens] (no early stop)."""
    import torch

    with torch.no_grad():
        options: dict[str, object] = {"do_sample": False, **kwargs}
        out = model.generate(
            input_ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, **options
        )
    new: torch.Tensor = out[:, input_ids.shape[1] :]
    return new
