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


@dataclass(frozen=True, slots=True)
class TinyGemma2(TinyGemma3):
    """A Gemma-2-style model: Gemma 3's alternating windows, and attention logits
    soft-capped at ``soft_cap`` (small, so that it changes the scores of a random model)."""

    soft_cap: float = 2.0

    def build(self, dtype: str = "float32", attn_implementation: str = "eager") -> Any:
        """The model (transformers' ``Gemma2ForCausalLM``) in eval mode on CPU."""
        from transformers import Gemma2Config, Gemma2ForCausalLM

        config = Gemma2Config(  # type: ignore[call-arg]
            **self.config_fields(),
            sliding_window=self.window,
            layer_types=self.layer_types,
            attn_logit_softcapping=self.soft_cap,
            final_logit_softcapping=None,
            attn_implementation=attn_implementation,
        )
        return self._seeded(Gemma2ForCausalLM, config, dtype)


@dataclass(frozen=True, slots=True)
class TinyGptOss(TinyGemma3):
    """A gpt-oss-style model: alternating windows, a learned attention sink per query
    head, and a mixture of ``experts`` MLPs. The sinks are drawn from the seed with a
    spread of ``sink_std`` (transformers' init leaves them near 0, where a random
    model's tokens hardly depend on them)."""

    experts: int = 4
    sink_std: float = 3.0

    def build(self, dtype: str = "float32", attn_implementation: str = "eager") -> Any:
        """The model (transformers' ``GptOssForCausalLM``) in eval mode on CPU."""
        import torch
        from transformers import GptOssConfig, GptOssForCausalLM

        config = GptOssConfig(  # type: ignore[call-arg]
            **self.config_fields(),
            sliding_window=self.window,
            layer_types=self.layer_types,
            num_local_experts=self.experts,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_implementation=attn_implementation,
        )
        model = self._seeded(GptOssForCausalLM, config, dtype)
        draw = torch.Generator().manual_seed(self.seed)
        for layer in model.model.layers:
            sinks = torch.randn(self.num_heads, generator=draw) * self.sink_std
            layer.self_attn.sinks.data.copy_(sinks)
        return model


@dataclass(frozen=True, slots=True)
class TinyDeepseekV2(TinyLlama):
    """A DeepSeek-V2-style model: multi-head latent attention (MLA; no query LoRA) and
    dense MLPs. Each layer caches one latent vector per token, ``kv_lora_rank`` +
    ``qk_rope_head_dim`` elements (``latent_dim``): :meth:`pool_flag` is a latent pool."""

    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 32
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def build(self, dtype: str = "float32", attn_implementation: str = "sdpa") -> Any:
        """The model (transformers' ``DeepseekV2ForCausalLM``) in eval mode on CPU."""
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        fields = {**self.config_fields(), "num_key_value_heads": self.num_heads}  # expanded
        config = DeepseekV2Config(  # type: ignore[call-arg]
            **fields,
            kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=None,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
            first_k_dense_replace=self.num_layers,  # every MLP dense
            attn_implementation=attn_implementation,
        )
        return self._seeded(DeepseekV2ForCausalLM, config, dtype)

    def pool_flag(
        self,
        *,
        dtype: str = "float32",
        page_size: int = 16,
        num_pages: int = 1024,
        name: str = "default",
    ) -> str:
        """``kvcore serve --pool`` value for a latent host pool that fits this model."""
        return (
            f"name={name},device=cpu,kind=latent,num_layers={self.num_layers},num_kv_heads=1,"
            f"head_dim={self.latent_dim},page_size={page_size},dtype={dtype},num_pages={num_pages}"
        )


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
