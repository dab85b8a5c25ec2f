"""vLLM engines in their own processes for the connector's tests: the benchmark's
helpers (kvcore.bench.vllm_engine), re-exported."""

from __future__ import annotations

from kvcore.bench.vllm_engine import (
    MODEL,
    PAGE_SIZE,
    Engine,
    pool_flag,
    vllm_available,
    write_model,
)

__all__ = ["MODEL", "PAGE_SIZE", "Engine", "pool_flag", "vllm_available", "write_model"]
