"""What SGLang's storage config and host pool say the backend attaches with.

kvcore's keys of ``--hicache-storage-backend-extra-config`` (:class:`StorageConfig`),
the kvcore layout one rank's MHA host pool has (:func:`expected_layout`), and the
first attach (:func:`connect`), whose errors say what to start or change. Coming
back after the daemon is gone is :mod:`kvcore.integrations.reconnect`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.client import Client
from kvcore.errors import LayoutMismatch, Timeout
from kvcore.integrations.sglang.pages import LAYOUTS
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


def expected_layout(host: Any) -> tuple[KVLayout, str]:
    """The kvcore layout an SGLang MHA host pool's pages have (its ``layer_num``,
    ``head_num``, ``head_dim``, ``page_size``, ``dtype``), and its layout name.
    ValueError for a host pool kvcore cannot store (MLA, split K/V widths, an
    unknown layout, SGLang's uint8 bytes of an fp8 KV cache)."""
    layout = getattr(host, "layout", None)
    if layout not in LAYOUTS or not hasattr(host, "head_num"):
        raise ValueError(
            f"kvcore's SGLang storage holds MHA host pools in {', '.join(LAYOUTS)}; "
            f"got {type(host).__name__} ({layout!r})"
        )
    if getattr(host, "v_head_dim", host.head_dim) != host.head_dim:
        raise ValueError("kvcore's SGLang storage needs equal K and V head dims")
    dtype = str(host.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:  # SGLang keeps an fp8 KV cache as uint8 bytes
        raise ValueError(
            f"kvcore's SGLang storage does not hold {dtype} host pools (an fp8 KV cache, "
            "--kv-cache-dtype fp8_e4m3 or fp8_e5m2, is one) yet; serve with "
            "--kv-cache-dtype auto or without --hicache-storage-backend on kvcore"
        )
    kv = KVLayout(
        num_layers=host.layer_num,
        num_kv_heads=host.head_num,
        head_dim=host.head_dim,
        page_size=host.page_size,
        dtype=dtype,
        num_pages=1,  # the daemon's choice
    )
    return kv, layout


def connect(config: StorageConfig, layout: KVLayout) -> Client:
    """The backend's session on a pool of ``layout``. Timeout naming the endpoint if no
    daemon answers; LayoutMismatch with the ``--pool`` flag that fits SGLang's host
    pool if the daemon's pool differs."""
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
            f"{exc}; SGLang's host pool needs `kvcore serve --pool {flag}`"
        ) from None
