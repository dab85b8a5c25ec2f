"""What SGLang's storage config and host pool say the backend attaches with.

kvcore's keys of ``--hicache-storage-backend-extra-config`` (:class:`StorageConfig`),
the kvcore layout one rank's host pool has (:func:`expected_layout`: MHA or MLA,
float or fp8), and the first attach (:func:`connect`), whose errors say what to
start or change. Coming back after the daemon is gone is
:mod:`kvcore.integrations.reconnect`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.client import Client
from kvcore.errors import LayoutMismatch, Timeout
from kvcore.integrations.sglang.pages import HOST_ORDERS, LAYOUTS
from kvcore.layout import DTYPE_SIZES, KVLayout
from kvcore.prefix import DEFAULT_NAMESPACE

SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")
"""SGLang's own keys of the extra config (SGLang reads them; kvcore skips them)."""


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """kvcore's keys of ``--hicache-storage-backend-extra-config``, each optional:
    ``endpoint`` (default: the default daemon, $KVCORE_ENDPOINT), ``pool``,
    ``namespace``, ``timeout_s`` (bound on one round trip, seconds), ``retry_s`` (after
    the daemon stopped answering, calls are misses for this long, doubled per failure
    in a row: :mod:`kvcore.integrations.reconnect`; then it is attached again),
    ``model_id`` (an operator's declaration that deployments serve the same model,
    replacing the source part of the rank's model identity; "" derives it:
    :mod:`kvcore.integrations.identity`)."""

    endpoint: str
    pool: str = "default"
    namespace: str = DEFAULT_NAMESPACE
    timeout_s: float = 5.0
    retry_s: float = 5.0
    model_id: str = ""


FP8_KV_CACHE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""SGLang's ``--kv-cache-dtype`` values whose uint8 host pages are a kvcore fp8 dtype."""
MLA_LAYOUTS = LAYOUTS[:3]  # SGLang's MLA host pool has no page_head


def expected_layout(host: Any, kv_cache_dtype: str = "") -> tuple[KVLayout, str]:
    """The kvcore layout one rank's SGLang host pool has, in the order whose pages copy
    as SGLang's do (:data:`~.pages.HOST_ORDERS`), and its layout name: an MHA
    pool (``layer_num``, ``head_num``, ``head_dim``, ``page_size``, ``dtype``) is a
    ``kv`` layout, an MLA pool (``kv_lora_rank``, ``qk_rope_head_dim``,
    ``kv_cache_dim``) a ``latent`` one of one head ``kv_cache_dim`` wide. SGLang's
    uint8 pages of an fp8 cache are the fp8 dtype ``kv_cache_dtype`` (the server's
    ``--kv-cache-dtype``) names. ValueError naming the setting for a host pool kvcore
    cannot store: another layout, split K/V widths, packed fp8 MLA rows (DeepSeek
    sparse attention), or bytes of no kvcore dtype."""
    layout: str = getattr(host, "layout", "")
    mla = hasattr(host, "kv_lora_rank")
    layouts = MLA_LAYOUTS if mla else LAYOUTS
    if layout not in layouts or not (mla or hasattr(host, "head_num")):
        raise ValueError(
            f"kvcore's SGLang storage holds {'MLA' if mla else 'MHA'} host pools in "
            f"--hicache-mem-layout {', '.join(layouts)}; got {type(host).__name__} "
            f"({layout!r})"
        )
    if mla:
        heads, dim = 1, host.kv_cache_dim
        if host.dsa_kv_cache_store_fp8 or dim != host.kv_lora_rank + host.qk_rope_head_dim:
            raise ValueError(
                "kvcore's SGLang storage does not hold packed fp8 MLA rows (DeepSeek "
                f"sparse attention's packed_fp8, {dim} bytes a token) yet; serve with "
                "--kv-cache-dtype auto or without --hicache-storage-backend on kvcore"
            )
    else:
        heads, dim = host.head_num, host.head_dim
        if getattr(host, "v_head_dim", dim) != dim:
            raise ValueError("kvcore's SGLang storage needs equal K and V head dims")
    dtype = str(host.dtype).removeprefix("torch.")
    if dtype == "uint8":  # SGLang keeps an fp8 KV cache as uint8 bytes
        dtype = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype, "")
        if not dtype or _rocm():
            raise ValueError(
                "kvcore's SGLang storage holds an fp8 KV cache of --kv-cache-dtype "
                f"{' or '.join(FP8_KV_CACHE_DTYPES)} on CUDA or CPU, not SGLang's uint8 "
                f"pages of --kv-cache-dtype {kv_cache_dtype or '(unknown)'}"
                f"{' on ROCm (float8_e4m3fnuz)' if _rocm() else ''}; serve with one of "
                "those or without --hicache-storage-backend on kvcore"
            )
    elif dtype not in DTYPE_SIZES:
        raise ValueError(f"kvcore's SGLang storage does not hold {dtype} host pools")
    kv = KVLayout(
        num_layers=host.layer_num,
        num_kv_heads=heads,
        head_dim=dim,
        page_size=host.page_size,
        dtype=dtype,
        num_pages=1,  # the daemon's choice
        kind="latent" if mla else "kv",
        order=HOST_ORDERS[layout],
    )
    return kv, layout


def _rocm() -> bool:
    """Whether torch is a ROCm build: SGLang's fp8 there is float8_e4m3fnuz."""
    import torch

    return bool(torch.version.hip)


def connect(config: StorageConfig, layout: KVLayout, host_layout: str) -> Client:
    """The backend's session on a pool of ``layout`` (SGLang's ``host_layout`` host
    pool's). Timeout naming the endpoint if no daemon answers; LayoutMismatch with the
    ``--pool`` flag that fits the host pool if the daemon's pool differs, its order
    included: a pool in another order is refused, never copied run by run
    (kvcore.integrations.sglang.storage says why)."""
    try:
        return Client.connect(
            config.endpoint,
            config.pool,
            config.namespace,
            layout=layout,
            timeout_s=config.timeout_s,
            name="sglang",
        )
    except Timeout:
        raise Timeout(
            f"no kvcore daemon answers at {config.endpoint} within {config.timeout_s} s: "
            f"start one (`kvcore serve --pool ...`) or set 'endpoint' in "
            f"--hicache-storage-backend-extra-config"
        ) from None
    except LayoutMismatch as exc:
        fields = {"name": config.pool, **layout.to_dict(), "num_pages": "N"}
        flag = ",".join(f"{k}={v}" for k, v in fields.items())
        raise LayoutMismatch(
            f"{exc}; SGLang's {host_layout} host pool (--hicache-mem-layout) needs a pool "
            f"in order={layout.order}, whose pages copy as SGLang's: `kvcore serve --pool "
            f"{flag}`"
        ) from None
