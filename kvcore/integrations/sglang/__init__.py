"""kvcore as SGLang's HiCache storage tier, shared by every SGLang instance on a daemon.

SGLang loads it by name, with no change to SGLang::

    --enable-hierarchical-cache --page-size 64
    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcore",
        "module_path": "kvcore.integrations.sglang", "class_name": "KVCoreStorage",
        "interface_v1": 1, "endpoint": ..., "pool": ..., "namespace": ...}'

(kvcore's keys optional: :class:`~.storage.StorageConfig`). The daemon's pool must
have the layout of one rank's host pool (layers, that rank's KV heads, head dim,
page size, dtype). :mod:`.keys` maps SGLang's page keys onto kvcore's prefix keys,
in a key space per model and shard; :mod:`.pages` moves pages between SGLang's host
pool and the mapped kvcore pool; :mod:`.storage` is the backend.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVCoreStorage", "StorageConfig"]


def __getattr__(name: str) -> Any:
    """The backend on first use (SGLang's factory asks for ``KVCoreStorage``), so that
    :mod:`.keys` and :mod:`.pages` import without SGLang."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from kvcore.integrations.sglang import storage
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("sglang"):
            raise
        raise ImportError("kvcore.integrations.sglang needs SGLang (pip install sglang)") from exc
    return getattr(storage, name)
