"""Calls into the Mooncake binding that must not stall the daemon.

Measured on mooncake-transfer-engine-non-cuda 0.3.13.post1: ``setup`` against an
absent master retries for about 90 s holding the GIL (every thread of the
process stops), ``close`` with the master gone holds it for 7-16 s, and a store
destroyed unclosed aborts the process. ``get_batch``, ``put_batch``,
``batch_is_exist`` and ``health_check`` release the GIL (a dead master costs
them up to ~4.5 s, which the caller does not wait for: :class:`Worker`).
"""

from __future__ import annotations

import atexit
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def accepts(host: str, port: str, timeout_s: float) -> bool:
    """True iff ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def abandon(store: Any) -> None:
    """Keep ``store`` open until the process exits, then close it (atexit).

    Closing it now would hold the GIL for seconds (its master is gone), and
    destroying it unclosed aborts or crashes the process (joinable C++ threads),
    so the exit pays for it instead: up to ~16 s per store whose master died."""
    _ABANDONED.append(store)


_ABANDONED: list[Any] = []


@atexit.register
def _close_abandoned() -> None:
    for store in _ABANDONED:
        store.close()


class Worker:
    """One daemon thread running submitted calls in order. Unlike a ThreadPoolExecutor
    it is never joined at interpreter exit, so a call stuck in the store (a master
    that died mid-call) cannot hold up the process's exit."""

    def __init__(self, name: str) -> None:
        self._calls: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((call, future))
        return future

    def stop(self) -> None:
        """Let the thread end after the calls already submitted."""
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to the waiter, which counts a miss
                future.set_exception(exc)
