"""kvcore_ipc: the transport of kvcore (spec/protocol.md).

Typed messages (``messages``), msgpack framing and limits (``codec``), the
daemon's ROUTER loop (``server``), the engine's DEALER channel (``channel``),
shared memory regions (``memory``) and the event stream (``events``).
This package knows nothing about pages or prefixes beyond message field types,
and imports nothing from kvcore.
"""

from kvcore_ipc.messages import ERROR_CODES, PROTOCOL_VERSION

__all__ = ["ERROR_CODES", "PROTOCOL_VERSION"]
