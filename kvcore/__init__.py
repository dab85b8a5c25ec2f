"""kvcore: a KV-cache manager that inference engines attach to.

``from kvcore import Manager, KVLayout`` embeds the state machine in-process;
``kvcore.Client`` attaches to a daemon (``kvcore serve``). Importing kvcore
imports neither torch nor ZeroMQ; the names that need them load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcore import errors
from kvcore.errors import KVCoreError
from kvcore.layout import KVLayout
from kvcore.manager import Allocation, Extension, Manager, PrefixHit, Stats
from kvcore.prefix import KeySpace

if TYPE_CHECKING:
    from kvcore.client import Client

__version__ = "0.1.0"
__all__ = [
    "Allocation",
    "Client",
    "Extension",
    "KVCoreError",
    "KVLayout",
    "KeySpace",
    "Manager",
    "PrefixHit",
    "Stats",
    "errors",
]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from kvcore.client import Client

        return Client
    raise AttributeError(f"module 'kvcore' has no attribute {name!r}")
