"""kvcore page events for the vLLM-format publisher's tests: chains of stored pages
with their tokens and namespace, keyed as spec/hashing.md says."""

from __future__ import annotations

import hashlib
import socket
import struct

from kvcore_ipc.messages import EventBatch, PageRemovedEvent, PageStoredEvent
from kvcore_ipc.vllm_events import root_key


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    raw = struct.pack(f"<{len(tokens)}I", *tokens)
    return hashlib.sha256(parent + bytes([0x02]) + len(raw).to_bytes(4, "little") + raw).digest()


def chain(
    tokens: list[int], page_size: int, namespace: str = "default", first_page: int = 0
) -> list[PageStoredEvent]:
    """Stored events of every full page of ``tokens`` (page ids from ``first_page``)."""
    parent, events = root_key(namespace), []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        key = page_key(parent, page)
        events.append(
            PageStoredEvent(key, parent, first_page + i, tokens=page, namespace=namespace)
        )
        parent = key
    return events


def removed(event: PageStoredEvent) -> PageRemovedEvent:
    return PageRemovedEvent(event.key, event.page)


def batch(events: list[PageStoredEvent] | list[PageRemovedEvent], epoch: int = 7) -> EventBatch:
    return EventBatch("default", epoch, 1, list(events))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
