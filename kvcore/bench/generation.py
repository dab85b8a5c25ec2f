"""Timed greedy generation through the three caches ``kvcore bench e2e`` compares:
generate() with a cache object (DynamicCache or kvcore's KVCoreCache) over a
left-padded batch, and transformers' own paged cache (continuous batching,
``model.generate_batch``) over the unpadded rows.

Decode tokens/s excludes the prefill: it is the tokens stamped after the last
row's first token over the time from that stamp to the last. Token ids are ints,
lengths are in tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcore.layout import cdiv

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class Generated:
    """One generation run: decode tokens/s (all rows, prefill excluded) and new tokens."""

    tokens_per_s: float
    tokens: list[list[int]]  # [rows][new_tokens]


def rows_equal(a: list[list[int]], b: list[list[int]]) -> int:
    """How many rows of ``a`` equal the same row of ``b``."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def timed_generate(
    model: LlamaForCausalLM, rows: list[list[int]], new_tokens: int, cache: object
) -> Generated:
    """Greedy generate() over left-padded ``rows`` with ``cache`` (DynamicCache or kvcore)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from kvcore.demo_model import greedy

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    new = greedy(
        model,
        ids,
        new_tokens,
        attention_mask=mask,
        cache=cache,
        logits_processor=LogitsProcessorList([Stamp()]),
    )
    tps = len(rows) * (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return Generated(tps, new.tolist())


def hf_paged_generate(
    model: LlamaForCausalLM, rows: list[list[int]], new_tokens: int, page_size: int
) -> Generated:
    """Greedy ``model.generate_batch`` (transformers' continuous batching, paged cache of
    ``page_size`` tokens per page) over unpadded ``rows``. Sized so that every prompt is
    in the first (prefill) batch and no row waits for pages."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    pages = sum(cdiv(len(r) + new_tokens, page_size) for r in rows)
    config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=pages + len(rows),
        max_batch_tokens=sum(len(r) for r in rows),
        max_requests_per_batch=len(rows),
    )
    generation = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False, max_new_tokens=new_tokens, pad_token_id=0
    )
    with _quiet("ContinuousBatchingLogger"), torch.no_grad():
        out = model.generate_batch(
            rows,
            generation_config=generation,
            continuous_batching_config=config,
            record_timestamps=True,
        )
    results = list(out.values())
    failed = [r.error for r in results if r.error is not None]
    if len(results) != len(rows) or failed:
        raise RuntimeError(f"generate_batch: {len(results)} of {len(rows)} rows; {failed[:1]}")
    stamps = [r.timestamps or [] for r in results]
    first = max(s[0] for s in stamps)  # every row has its first token: decode starts
    decoded = sum(1 for s in stamps for t in s if t > first)
    return Generated(
        decoded / (max(s[-1] for s in stamps) - first), [list(r.generated_tokens) for r in results]
    )


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Silence a logger (continuous batching logs advice on psutil at ERROR on every call)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
