"""KVCoreCache with the Triton backend (interpreted on a machine without CUDA): a tiny
model, few tokens, the same token-for-token equality with DynamicCache as the torch grid."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hf_helpers import held, module_endpoint, padded, private_client

from kvcore.backend import Backend, get
from kvcore.demo_model import TinyLlama, greedy
from kvcore.errors import Unsupported
from kvcore.integrations.transformers import KVCoreCache

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
# 1 layer, head dim 32, GQA 2:1; page size 4 so short prompts still span pages
TINY = TinyLlama(
    num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=128
)
PAGE = 4
NEW = 5


@pytest.fixture(scope="module")
def triton() -> Backend:
    try:
        return get("triton")
    except Unsupported as exc:
        pytest.skip(f"no triton backend here: {exc}")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from module_endpoint(tmp_path_factory, "hf-triton")


@pytest.mark.parametrize(
    "lengths",
    [[3], [4], [13], [3, 9, 6]],
    ids=["shorter-than-a-page", "exactly-one-page", "many-pages", "padded-batch-of-three"],
)
def test_triton_equals_dynamic_cache(endpoint: str, triton: Backend, lengths: list[int]) -> None:
    model = TINY.build()
    prompts = [TINY.prompt(n, seed=n) for n in lengths]
    ids, mask = padded(prompts)
    expected = greedy(model, ids, NEW, attention_mask=mask)
    with private_client(endpoint, TINY, page_size=PAGE, num_pages=64) as client:
        for _ in range(2):  # cold, then with the full prompt pages cached
            with KVCoreCache(client, model, backend=triton) as cache:
                out = greedy(model, ids, NEW, attention_mask=mask, cache=cache)
            assert torch.equal(out, expected)
        assert cache.num_cached_tokens == sum((n - 1) // PAGE * PAGE for n in lengths)
        assert held(client) == (0, 0)


def test_triton_forks_and_bfloat16(endpoint: str, triton: Backend) -> None:
    model = TINY.build("bfloat16")
    prompt = TINY.prompt(10, seed=11)
    options = {"num_return_sequences": 2, "do_sample": True, "top_k": 1}
    torch_out = None
    for backend in (get("torch"), triton):  # bf16: the two backends agree with each other
        with private_client(endpoint, TINY, dtype="bfloat16", page_size=PAGE) as client:
            with KVCoreCache(client, model, backend=backend) as cache:
                out = greedy(model, torch.tensor([prompt]), NEW, cache=cache, **options)
                assert held(client)[0] == 2
            assert held(client) == (0, 0)
        assert torch.equal(out[0], out[1])
        if torch_out is None:
            torch_out = out
    assert torch.equal(out, torch_out)
