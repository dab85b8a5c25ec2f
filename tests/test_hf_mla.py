"""The transformers Cache on a DeepSeek-V2-style model (multi-head latent attention) over
a latent pool: the attention modules compute in absorbed form over one latent vector per
token (kvcore/integrations/hf_mla.py), with the kernels' ``Attention(v_head_dim=...)``.

Two engine processes on one daemon: engine A (a child process) generates from a system
prompt plus its question; engine B (this process) asks another question after the same
system prompt, is served the system prompt's pages from the pool, and generates token
for token what transformers' own cache (DynamicCache, the model's own attention with
the latent expanded per head) generates.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import torch
from hf_helpers import (
    SMALL,
    cache_space,
    engine_process,
    float32_runs,
    reference,
    served_pages,
    wrong_page_fails,
)

from kvcore import Client, KVLayout
from kvcore.daemon_process import DaemonProcess
from kvcore.demo_model import TinyDeepseekV2
from kvcore.errors import LayoutMismatch
from kvcore.integrations.transformers import KVCoreCache
from kvcore.testing import tolerance

pytestmark = pytest.mark.numeric  # rerun by CI as other CPUs (.ci/run)
PAGE = 16
SPEC = TinyDeepseekV2(num_layers=2)  # latent of 64 + 32 = 96 elements per token and layer
SYSTEM = SPEC.prompt(3 * PAGE, seed=11)  # 3 full pages
NEW = 8


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("hf-mla")
    # page-major without head-outer: latent pages in an order other than the default
    pool = SPEC.pool_flag(page_size=PAGE, num_pages=256) + ",order=PLKTH"
    args = ("--endpoint", f"ipc://{tmp / 'd.sock'}", "--allow-ephemeral", "--pool", pool)
    with DaemonProcess(*args) as d:
        yield d.endpoint


def check_engine_b(client: Client, model: torch.nn.Module, prompt: list[int]) -> None:
    """Engine B's generate of ``prompt``: served the system prompt's latent pages, every
    layer, it decodes transformers' own tokens (AssertionError saying which fails)."""
    ids = torch.tensor([prompt])
    with KVCoreCache(client, model) as cache:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                cache=cache,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
            )
        # while bound, a DynamicCache run is transformers' own (expanded K/V, no pages)
        want = reference(model, [prompt], NEW)[0].tolist()
    assert cache.num_cached_tokens == len(SYSTEM), "engine B missed A's latent pages"
    assert out[0, len(prompt) :].tolist() == want, "engine B's tokens are not transformers'"
    assert reference(model, [prompt], NEW)[0].tolist() == want  # unbound: the same


def test_engine_b_hits_engine_a_and_decodes_what_transformers_decodes(endpoint: str) -> None:
    first = SYSTEM + SPEC.prompt(7, seed=1)
    a = engine_process(SPEC, endpoint, first, NEW)
    model = SPEC.build()
    assert a["cached"] == 0
    assert a["tokens"] == reference(model, [first], NEW)[0].tolist()
    second = SYSTEM + SPEC.prompt(9, seed=2)
    with Client.connect(endpoint) as client:
        check_engine_b(client, model, second)
        # negative control: the first system page holding the third's latents (other
        # tokens'): the same check fails, then passes again with the page restored
        pages = served_pages(client, cache_space(client, model), SYSTEM)
        with wrong_page_fails(client, pages[0], pages[2], "not transformers'"):
            check_engine_b(client, model, second)
        check_engine_b(client, model, second)


def test_absorbed_logits_match_the_expanded_ones(endpoint: str) -> None:
    """A prompt's logits over the latent pages equal transformers' within the bound of two
    float32 runs that sum in other orders (absorbed against expanded attention; the bound
    scaled from a bfloat16 run's distance, hf_helpers.float32_runs)."""
    model = SPEC.build()
    ids = torch.tensor([SPEC.prompt(2 * PAGE + 5, seed=3)])
    with torch.no_grad():
        want = model(ids).logits
        coarse = SPEC.build("bfloat16")(ids).logits.float()
        with Client.connect(endpoint) as client, KVCoreCache(client, model) as cache:
            got = model(ids, cache=cache).logits
    bound = float32_runs(SPEC, float((coarse - want).abs().max()), ids.shape[1])
    tolerance.assert_close(got, want, bound, "absorbed MLA's logits")


def _ephemeral(endpoint: str, layout: KVLayout) -> Client:
    return Client.connect(endpoint, pool=f"t-{secrets.token_hex(4)}", layout=layout, ephemeral=True)


def test_a_pool_of_the_other_kind_is_a_layout_mismatch_naming_the_pool_flag(
    endpoint: str,
) -> None:
    kv = KVLayout(SPEC.num_layers, 2, SPEC.head_dim, PAGE, "float32", 8)
    with _ephemeral(endpoint, kv) as client:
        flag = "kind=latent,num_layers=2,num_kv_heads=1,head_dim=96,dtype=float32"
        with pytest.raises(LayoutMismatch, match=flag):
            KVCoreCache(client, SPEC.build())
    latent = KVLayout(SMALL.num_layers, 1, 96, PAGE, "float32", 8, "latent")
    with _ephemeral(endpoint, latent) as client:
        flag = "kind=kv,num_layers=2,num_kv_heads=2,head_dim=32,dtype=float32"
        with pytest.raises(LayoutMismatch, match=flag):
            KVCoreCache(client, SMALL.build())
