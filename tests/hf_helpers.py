"""Shared set-up of the transformers adapter tests: a daemon, private pools, reference runs."""

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

from kvcore import Client, KVLayout
from kvcore.daemon_process import DaemonProcess
from kvcore.demo_model import TinyLlama, greedy

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
) -> Client:
    """A session on a fresh pool that fits ``spec``; gone when the client closes."""
    layout = KVLayout(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, dtype, num_pages
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
