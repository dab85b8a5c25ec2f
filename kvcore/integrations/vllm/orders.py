"""Which pool order matches vLLM's KV cache: the one whose pages copy as plain runs.

vLLM (0.32) names a cache's physical order with a ``KVCacheLayout``
(vllm/v1/kv_cache_layout.py): a permutation of its logical axes ``[L, B, H, N, C]``
(layer, block, head, token, content), outermost first, e.g. ``"LBHNC"`` (the
identity, the only one vLLM's CPU attention accepts) or ``"BLHNC"`` (block-major:
one block of every layer is one run). A kvcore pool names its order the same way
over ``LPKTH`` (kvcore/layout.py). The axes map one to one (``L`` -> ``L``, ``B`` ->
``P``, ``H`` -> ``H``, ``N`` -> ``T``), and the content axis ``C`` holds the part
axis ``K`` and head_dim ``D`` the way the attention backend reads it
(:data:`~.pages.HeadLayout`)::

    kv_last   (FlashAttention, Triton, FlashInfer)  C = [K | V] = [K][D]: "C" -> "K"
    kv_blocks (CPU_ATTN)                             [N][C] = [K][N][D]:   "NC" -> "KT"
    latent    (MLA: H = 1, K = 1, C = D)             any order of the size-1 axes; named
                                                     in the identity's ("LPKTH")

so vLLM's CPU cache (``LBHNC``, ``kv_blocks``) is ``"LPHKT"``: per (layer, page)
``[H, 2, N, D]``, byte for byte vLLM's block; a FlashInfer ``HND`` cache
(``LBHNC``, ``kv_last``) is ``"LPHTK"``, a block-major one (``BLHNC``) ``"PLHTK"``.
Any other order still works, through strided copies (:mod:`.runs` says which copy
runs); only the matching one copies each page of each layer as one ``memcpy``, and
a page-major pool under a block-major cache each page as one run of every layer.
"""

from __future__ import annotations

from kvcore.integrations.vllm.pages import KV_BLOCKS, KV_LAST, LATENT, HeadLayout

VLLM_AXES = {"L": "L", "B": "P", "H": "H", "N": "T"}
"""vLLM's logical cache axes and kvcore's pool axes they are (``C`` by the backend)."""
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM 0.32's ``KVCacheLayout`` names (vllm/v1/kv_cache_layout.py)."""
CPU_LAYOUT = "LBHNC"
"""The one layout vLLM 0.32's ``CPU_ATTN`` accepts (``supported_kv_cache_layouts``)."""


def matching_order(vllm_layout: str, head: HeadLayout) -> str | None:
    """The pool order (a permutation of ``LPKTH``) whose page bytes per layer are those
    of vLLM's block in cache layout ``vllm_layout`` read as ``head``; None where none
    is (``kv_blocks`` needs the token axis right outside the content, as vLLM's CPU
    kernel has it)."""
    assert sorted(vllm_layout) == sorted("LBHNC"), vllm_layout
    order = "".join(VLLM_AXES.get(axis, "C") for axis in vllm_layout)
    if head == KV_LAST:
        return order.replace("C", "K")
    if head == KV_BLOCKS:
        return order.replace("TC", "KT") if "TC" in order else None
    assert head == LATENT, head
    outer = order.replace("H", "").replace("C", "")  # H and K have size 1
    return outer.replace("T", "KTH")


def layout_name(vllm_config: object) -> str:
    """The ``KVCacheLayout`` vLLM resolved for this engine (``CPU_LAYOUT`` where it
    has resolved none: vLLM's CPU platform takes its only one)."""
    cache_config = getattr(vllm_config, "cache_config", None)
    name = getattr(cache_config, "kv_cache_layout", None)
    return str(name) if name else CPU_LAYOUT
