"""The scheduler side's line to the daemon: one I/O thread, so vLLM's scheduler never
waits for a round trip.

The scheduler :meth:`~DaemonLink.send`\\ s operations and returns at once; the thread
sends everything queued since its last round trip as one batch, in order, and posts
what the scheduler must learn (an allocation's pages, an extension's new pages, a
request the daemon refused, the daemon gone) as :class:`Done` records, which the
scheduler :meth:`~DaemonLink.take`\\ s at its next hook. Only the thread uses the
Client after start-up (the scheduler reads its ``epoch`` and ``layout``, which
change only on reconnect, inside the thread, before the ``reconnected`` record).

Failures: an op the daemon refuses (any error not in :data:`DAEMON_GONE`: out of
pages, a quota, a forbidden namespace, too many tokens) fails that op alone; the ops
after it are sent again. The daemon gone (:data:`DAEMON_GONE`): every queued op is
dropped (allocations answered as failed), nothing is sent for ``retry_s`` seconds
(doubled after each failure in a row, up to :data:`MAX_RETRY_S`), then the thread
attaches again and posts ``reconnected``: the old session's sequences are gone.

Bounded: at most :data:`MAX_QUEUED` ops wait; past that, commits are dropped
(their pages stay unpublished: a later miss, never a wrong hit); allocations,
extensions and frees are kept (each is bounded by vLLM's live requests).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Literal

from kvcore.client import Batch, Client
from kvcore.errors import (
    BatchFailed,
    KVCoreError,
    LeaseLost,
    NotAttached,
    OutOfPages,
    StaleEpoch,
    Timeout,
)
from kvcore.results import Allocation, Extension

log = logging.getLogger("kvcore.vllm")
MAX_RETRY_S = 60.0  # the longest quiet period after failures in a row
MAX_QUEUED = 4096  # ops waiting for the thread; commits past this are dropped
DAEMON_GONE: tuple[type[KVCoreError], ...] = (Timeout, StaleEpoch, LeaseLost, NotAttached)
"""Failures that mean the daemon (or this session on it) is gone; any other
KVCoreError (OutOfPages, QuotaExceeded, Forbidden, BadRequest, ...) is one op's."""


@dataclass(frozen=True, slots=True)
class Allocate:
    """Start sequence ``seq`` for request ``req_id`` (a prefix lookup and its pin)."""

    req_id: str
    seq: int
    tokens: list[int]
    salt: str
    lora: str


@dataclass(frozen=True, slots=True)
class Extend:
    """Grow sequence ``seq`` by ``num_tokens`` tokens (room for generated pages)."""

    req_id: str
    seq: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Commit:
    """Publish ``tokens`` (from token ``start``, a page boundary) of sequence ``seq``."""

    seq: int
    tokens: list[int]
    start: int


@dataclass(frozen=True, slots=True)
class Free:
    seq: int


Op = Allocate | Extend | Commit | Free


@dataclass(frozen=True, slots=True)
class Done:
    """What the scheduler learns from the thread. ``kind``: ``allocated`` (``result``
    an Allocation), ``extended`` (an Extension), ``refused`` (the op's request runs
    without kvcore from now on; the link logged why), ``failed`` (an allocation that
    did not run: a miss, ask again later), ``reconnected`` (a new session: forget
    every sequence)."""

    kind: Literal["allocated", "extended", "refused", "failed", "reconnected"]
    req_id: str = ""
    seq: int = 0
    result: Allocation | Extension | None = None


class DaemonLink:
    """The I/O thread and its two queues (ops in, :class:`Done` out)."""

    def __init__(self, client: Client, *, retry_s: float, timeout_s: float) -> None:
        self.client = client
        self._timeout_s = timeout_s  # the bound on one round trip
        self._retry_first = self._retry_s = retry_s
        self._inbox: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._answered = threading.Condition()  # notified on each record posted
        self._pending = 0  # ops sent to the thread and not yet handled
        self._quiet_until = 0.0  # monotonic time before which nothing is sent
        self._stale = False  # a call failed: attach again before the next one
        self._warned: set[str] = set()  # error codes logged at WARNING already
        self._thread = threading.Thread(target=self._run, name="kvcore-link", daemon=True)
        self._thread.start()

    # -- the scheduler's side --------------------------------------------------------

    def quiet(self) -> bool:
        """Whether the daemon is taken for gone now (ask it nothing)."""
        return time.monotonic() < self._quiet_until

    def send(self, op: Op) -> None:
        with self._idle:
            if isinstance(op, Commit) and self._pending >= MAX_QUEUED:
                return  # bounded: an unpublished page is a later miss
            self._pending += 1
        self._inbox.put(op)

    def wait_answer(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for a record to take; whether one is there."""
        with self._answered:
            return self._answered.wait_for(lambda: not self._done.empty(), timeout_s)

    def take(self) -> list[Done]:
        """Every record posted since the last call, in order."""
        out: list[Done] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every op sent so far was handled (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        """Send what is queued, stop the thread, close the session."""
        self.wait_idle(self._timeout_s)
        self._inbox.put(None)
        self._thread.join(timeout=self._timeout_s)
        self.client.close()

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        while (first := self._inbox.get()) is not None:
            ops = [first]
            while True:
                try:
                    op = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if op is None:
                    self._inbox.put(None)  # stop after this round
                    break
                ops.append(op)
            try:
                self._handle(ops)
            except Exception:  # never let the thread die: vLLM would wait forever
                log.exception("kvcore: the daemon link failed; requests are misses")
                self._drop(ops)
            with self._idle:
                self._pending -= len(ops)
                self._idle.notify_all()

    def _handle(self, ops: list[Op]) -> None:
        was_stale = self._stale
        if not self._connected():
            self._drop(ops)
            return
        if was_stale:  # a new session: ops of the old one's sequences mean nothing now
            ops = [op for op in ops if isinstance(op, Allocate)]
        one_by_one = False
        while ops:
            sent = ops[:1] if one_by_one else ops
            try:
                with self.client.batch() as batch:
                    _queue(batch, sent)
                self._post(sent, batch.results)
                ops = ops[len(sent) :]
            except BatchFailed as exc:
                self._post(sent[: exc.batch_index], exc.batch_results)
                if not self._refused(sent[exc.batch_index], exc):
                    self._drop(ops[exc.batch_index + 1 :])
                    return
                ops = ops[exc.batch_index + 1 :]
            except KVCoreError as exc:  # the whole batch refused (e.g. too many tokens)
                if not one_by_one and not isinstance(exc, DAEMON_GONE):
                    one_by_one = True
                    continue
                if not self._refused(sent[0], exc):
                    self._drop(ops[1:])
                    return
                ops = ops[1:]

    def _answer(self, done: Done) -> None:
        with self._answered:
            self._done.put(done)
            self._answered.notify_all()

    def _post(self, ops: list[Op], results: list[object]) -> None:
        for op, result in zip(ops, results, strict=True):
            if isinstance(op, Allocate):
                assert isinstance(result, Allocation), result
                self._answer(Done("allocated", op.req_id, op.seq, result))
            elif isinstance(op, Extend):
                assert isinstance(result, Extension), result
                self._answer(Done("extended", op.req_id, op.seq, result))

    def _refused(self, op: Op, exc: KVCoreError) -> bool:
        """One op failed; True if it was the op's own fault (the daemon is fine). Out of
        pages: logged at INFO (an allocation is a miss, asked again later); any other
        refusal: the request runs without kvcore, logged at WARNING once per code. The
        daemon gone: quiet for ``retry_s``, then attach again."""
        what = type(op).__name__.lower()
        if isinstance(exc, DAEMON_GONE):
            self._gone(what, exc)
            if isinstance(op, Allocate):
                self._answer(Done("failed", op.req_id, op.seq))
            return False
        if isinstance(exc, OutOfPages):
            log.info("kvcore: %s: %s", what, exc)
        elif exc.code not in self._warned:
            self._warned.add(exc.code)
            log.warning(
                "kvcore: %s refused (%s: %s); its request runs without kvcore (logged "
                "once per error code)",
                what,
                exc.code,
                exc,
            )
        if isinstance(op, Allocate | Extend):
            failed = isinstance(op, Allocate) and isinstance(exc, OutOfPages)
            self._answer(Done("failed" if failed else "refused", op.req_id, op.seq))
        return True

    def _drop(self, ops: list[Op]) -> None:
        """Ops that did not run (the daemon gone, or the link failed): allocations are
        answered as misses; the rest are dropped."""
        for op in ops:
            if isinstance(op, Allocate):
                self._answer(Done("failed", op.req_id, op.seq))

    def _gone(self, what: str, exc: KVCoreError) -> None:
        self._quiet_until = time.monotonic() + self._retry_s
        self._stale = True
        log.warning(
            "kvcore: %s failed (%s: %s); treating requests as misses for %.0f s",
            what,
            type(exc).__name__,
            exc,
            self._retry_s,
        )
        self._retry_s = min(2 * self._retry_s, MAX_RETRY_S)

    def _connected(self) -> bool:
        """Whether to call the daemon now; after a failure, first attach again."""
        if self.quiet():
            return False
        if self._stale:
            try:
                self.client.reconnect()
            except KVCoreError as exc:
                self._gone("attach", exc)
                return False
            self._stale = False
            self._retry_s = self._retry_first
            self._answer(Done("reconnected"))
        return True


def _queue(batch: Batch, ops: list[Op]) -> None:
    for op in ops:
        match op:
            case Allocate():
                batch.allocate(op.seq, op.tokens, salt=op.salt, lora=op.lora)
            case Extend():
                batch.extend(op.seq, op.num_tokens)
            case Commit():
                batch.commit(op.seq, op.tokens, start=op.start)
            case Free():
                batch.free(op.seq)
