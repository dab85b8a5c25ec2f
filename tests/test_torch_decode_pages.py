"""The torch backend's decode of an unpadded batch gathers whole pages: the unwritten
slots of the last page (NaN here, as a reused page may hold) are gathered but never
attended over, from the planning thread (its workspace) or another (its own gather)."""

from __future__ import annotations

import threading

import pytest
import torch
from kvcore_torch import TorchBackend

from kvcore.testing import tolerance
from kvcore.testing.kernels import dense_attention

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)


def test_unpadded_decode_never_reads_the_rest_of_the_last_page() -> None:
    gen = torch.Generator().manual_seed(3)
    page_size, num_kv_heads, head_dim, n = 4, 2, 8, 6  # 6 tokens: 1.5 pages per row
    cache = torch.full((5, 2, page_size, num_kv_heads, head_dim), float("nan"))
    table = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32)
    lens = torch.tensor([n, n], dtype=torch.int32)
    keys = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
    values = torch.randn(2, n, num_kv_heads, head_dim, generator=gen)
    for b in range(2):
        for t in range(n):
            page = int(table[b, t // page_size])
            cache[page, 0, t % page_size] = keys[b, t]
            cache[page, 1, t % page_size] = values[b, t]
    query = torch.randn(2, 4, head_dim, generator=gen)
    backend = TorchBackend()
    plan = backend.plan_decode(cache, table, lens)
    out = backend.decode(plan, query, cache, 0.3)
    elsewhere: list[torch.Tensor] = []
    thread = threading.Thread(
        target=lambda: elsewhere.append(backend.decode(plan, query, cache, 0.3))
    )
    thread.start()
    thread.join()
    for b in range(2):
        expected = dense_attention(query[b : b + 1], keys[b], values[b], 0.3)[0]
        # two fp32 computations (the backend, SDPA) of one query over the row's n keys
        bound = tolerance.attention(query[b : b + 1], keys[b], values[b], 0.3, keys=n)
        tolerance.assert_close(out[b], expected, bound, "decode vs dense attention")
        tolerance.assert_close(elsewhere[0][b], expected, bound, "another thread's decode")
