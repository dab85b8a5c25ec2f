"""kvcore_ipc: the transport of kvcore (spec/protocol.md).

Typed messages (``messages``), msgpack framing and limits (``codec``), the
daemon's ROUTER loop (``server``), the engine's DEALER channel (``channel``),
their shared CURVE and socket-file set-up (``sockets``), shared memory regions
(``memory``: POSIX shm in ``shm``, CUDA IPC in ``cuda_ipc``) and the event
streams (``events``, and vLLM's format in ``vllm_events``).
This package knows nothing about pages or prefixes beyond message field types,
and imports nothing from kvcore.
"""

from kvcore_ipc.messages import ERROR_CODES, PROTOCOL_VERSION

__all__ = ["ERROR_CODES", "PROTOCOL_VERSION"]
