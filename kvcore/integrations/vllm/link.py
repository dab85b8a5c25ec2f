"""The scheduler side's line to the daemon: one I/O thread, so vLLM's scheduler never
waits for a round trip.

The scheduler :meth:`~DaemonLink.send`\\ s operations and returns at once; the thread
sends everything queued since its last round trip as one batch, in order, and posts
what the scheduler must learn as :data:`Done` records, one type per kind
(:class:`Allocated`: an allocation's pages; :class:`Extended`: an extension's new
pages; :class:`Refused`, :class:`Failed`: an op the daemon refused, or one that did
not run; :class:`Lost`, :class:`Reconnected`: the session's end, a new one), which the
scheduler :meth:`~DaemonLink.take`\\ s at its next hook and matches by type. Only the
thread uses the Client after start-up: the scheduler learns each new session from the
:class:`Reconnected` record, never by reading the client (whose epoch the thread
changes inside ``reconnect``, before it posts that record).

Failures: an op the daemon refuses (any error that does not mean the daemon gone:
out of pages, a quota, a forbidden namespace, too many tokens) fails that op alone;
the ops after it are sent again. The daemon gone (:mod:`kvcore.integrations.reconnect`,
the rule every integration shares): every queued op is dropped (allocations answered
as failed), nothing is sent while the quiet period runs, then the thread attaches
again and posts :class:`Reconnected` with the new
:class:`~kvcore.integrations.reconnect.Attachment`.

This session over while the daemon lives (its lease lost: a ``lease_lost`` or
``not_attached`` answer, or the client's heartbeat found it; the thread looks at
least every :data:`LOSS_POLL_S` while idle): the thread posts :class:`Lost` at once,
so the scheduler stops planning copies on the session's pages, and then waits, sending
nothing, for the scheduler's :class:`Retire` of that attachment (sent once every
plan built on it was reported run: :mod:`.session`). Only then does it attach
again, which acknowledges the loss (``Client.reconnect``): the daemon keeps a lost
session's pages fenced until then (a map-less client does not acknowledge at once:
:mod:`kvcore.client`), so no copy the worker still runs from an older plan writes a
page someone else was given, or loads one of their pages. The daemon's own bound
on that wait is its ``fence_timeout_s``.

Generations: every op carries the attachment of the state the scheduler built it
from, and every record the attachment it belongs to. The thread sends an op only on
its own attachment (one built on an older one names sequences that died with it: it
is dropped, an allocation answered as failed), so a sequence id never reaches a
session that does not own it, and the scheduler knows which records to ignore.

Bounded: at most :data:`MAX_QUEUED` ops wait; past that, commits are dropped
(their pages stay unpublished: a later miss, never a wrong hit); allocations,
extensions, frees and retires are kept (each is bounded by vLLM's live requests).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from kvcore.client import Batch, Client
from kvcore.errors import BatchFailed, KVCoreError, LeaseLost, NotAttached, OutOfPages
from kvcore.integrations.reconnect import Attachment, Reconnector, daemon_gone
from kvcore.prefix import KeySpace
from kvcore.results import Allocation, Extension

log = logging.getLogger("kvcore.vllm")
MAX_QUEUED = 4096  # ops waiting for the thread; commits past this are dropped
LOSS_POLL_S = 0.05  # seconds: how often the idle thread looks for a lease the heartbeat lost


@dataclass(frozen=True, slots=True)
class Allocate:
    """Start sequence ``seq`` for request ``req_id`` (a prefix lookup and its pin) in
    ``space`` (namespace None: the session's; :class:`.records.KeySpaces`)."""

    attachment: Attachment  # of the state the op was built from: sent on no other
    req_id: str
    seq: int
    tokens: list[int]
    space: KeySpace


@dataclass(frozen=True, slots=True)
class Extend:
    """Grow sequence ``seq`` by ``num_tokens`` tokens (room for generated pages)."""

    attachment: Attachment
    req_id: str
    seq: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Commit:
    """Publish ``tokens`` (from token ``start``, a page boundary) of sequence ``seq``."""

    attachment: Attachment
    seq: int
    tokens: list[int]
    start: int


@dataclass(frozen=True, slots=True)
class Free:
    attachment: Attachment
    seq: int


@dataclass(frozen=True, slots=True)
class Retire:
    """The scheduler holds nothing of ``attachment`` any more, a session the thread said
    is :class:`Lost`: no record, and no plan built on it that the worker has not reported.
    The thread may now attach again (which frees that session's pages)."""

    attachment: Attachment


Op = Allocate | Extend | Commit | Free | Retire


@dataclass(frozen=True, slots=True)
class Allocated:
    """Allocation ``seq`` of request ``req_id`` ran: ``result`` its pages and pinned hit."""

    attachment: Attachment  # the session the record belongs to (every record has one)
    req_id: str
    seq: int
    result: Allocation


@dataclass(frozen=True, slots=True)
class Extended:
    """Sequence ``seq`` of request ``req_id`` grew: ``result`` its new pages."""

    attachment: Attachment
    req_id: str
    seq: int
    result: Extension


@dataclass(frozen=True, slots=True)
class Refused:
    """The daemon refused the op (the link logged why). An allocation: its request runs
    without kvcore from now on (a quota, a forbidden namespace, too many tokens); an
    extension: the sequence cannot grow (out of pages too)."""

    attachment: Attachment
    req_id: str
    seq: int


@dataclass(frozen=True, slots=True)
class Failed:
    """An allocation that did not run (out of pages, the daemon gone, an older
    session's, the link failed): a miss; the request may be asked again later."""

    attachment: Attachment
    req_id: str
    seq: int


@dataclass(frozen=True, slots=True)
class Lost:
    """``attachment``'s session is over though the daemon lives: its sequences are gone,
    its pages fenced until the scheduler's :class:`Retire`."""

    attachment: Attachment


@dataclass(frozen=True, slots=True)
class Reconnected:
    """``attachment`` is a new session: every sequence of the old one is gone."""

    attachment: Attachment


Answer = Allocated | Extended | Refused | Failed
"""A record about one request's op (its ``req_id`` and sequence ``seq``)."""
Done = Answer | Lost | Reconnected
"""What the scheduler learns from the thread, each on the ``attachment`` it belongs
to; the scheduler matches them by type."""


class DaemonLink:
    """The I/O thread and its two queues (ops in, :class:`Done` out). The client's session
    at start-up is the first attachment; later ones arrive as :class:`Reconnected`."""

    def __init__(self, client: Client, *, retry_s: float, timeout_s: float) -> None:
        self.client = client
        self._timeout_s = timeout_s  # the bound on one round trip
        self._reconnect = Reconnector.of(client, retry_s=retry_s, what="vLLM scheduler")
        self._posted = self._reconnect.attachment  # of the last Reconnected posted
        self._over: Attachment | None = None  # the last session posted Lost
        self._retired: Attachment | None = None  # the last one the scheduler retired
        self._inbox: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._answered = threading.Condition()  # notified on each record posted
        self._pending = 0  # ops sent to the thread and not yet handled
        self._warned: set[str] = set()  # error codes logged at WARNING already
        self._trips = (0, 0.0)  # round trips since the last take_round_trips, their seconds
        self._trips_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvcore-link", daemon=True)
        self._thread.start()

    # -- the scheduler's side --------------------------------------------------------

    def quiet(self) -> bool:
        """Whether the daemon is taken for gone now (ask it nothing)."""
        return self._reconnect.quiet()

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

    def take_round_trips(self) -> tuple[int, float]:
        """The batches sent to the daemon since the last call and the seconds they took
        (each from send to answer, refused ones included)."""
        with self._trips_lock:
            trips, self._trips = self._trips, (0, 0.0)
        return trips

    def close(self) -> None:
        """Send what is queued, stop the thread, close the session."""
        self.wait_idle(self._timeout_s)
        self._inbox.put(None)
        self._thread.join(timeout=self._timeout_s)
        self.client.close()

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                first = self._inbox.get(timeout=LOSS_POLL_S)
            except queue.Empty:
                self._while_idle()
                continue
            if first is None:
                return
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
        for op in ops:
            if isinstance(op, Retire):
                self._retired = op.attachment
        ops = [op for op in ops if not isinstance(op, Retire)]
        self._notice_loss()
        if self._over == self._posted != self._retired or not self._attached():
            self._drop(ops)  # lost and not retired yet (its pages in use), or the daemon gone
            return
        now = self._posted
        self._drop([op for op in ops if op.attachment != now])  # sequences of a dead session
        ops = [op for op in ops if op.attachment == now]
        one_by_one = False
        while ops:
            sent = ops[:1] if one_by_one else ops
            try:
                self._post(sent, self._send(sent))
                ops = ops[len(sent) :]
            except BatchFailed as exc:
                self._post(sent[: exc.batch_index], exc.batch_results)
                if not self._refused(sent[exc.batch_index], exc):
                    self._drop(ops[exc.batch_index + 1 :])
                    return
                ops = ops[exc.batch_index + 1 :]
            except KVCoreError as exc:  # the whole batch refused (e.g. too many tokens)
                if not one_by_one and not daemon_gone(exc):
                    one_by_one = True
                    continue
                if not self._refused(sent[0], exc):
                    self._drop(ops[1:])
                    return
                ops = ops[1:]

    def _send(self, ops: list[Op]) -> list[object]:
        """One round trip: ``ops`` as one batch; their results (timed, answer or error:
        :meth:`take_round_trips`)."""
        start = time.perf_counter()
        try:
            with self.client.batch() as batch:
                _queue(batch, ops)
        finally:
            seconds = time.perf_counter() - start
            with self._trips_lock:
                trips, total = self._trips
                self._trips = (trips + 1, total + seconds)
        return batch.results

    def _attached(self) -> bool:
        """Whether to call the daemon now (attaching again first where due: the
        Reconnector's rule); a new session is posted :class:`Reconnected` before any answer."""
        if not self._reconnect.ready():
            return False
        now = self._reconnect.attachment
        if now != self._posted:
            self._posted = now
            self._answer(Reconnected(now))
        return True

    def _while_idle(self) -> None:
        """No op for :data:`LOSS_POLL_S`: post a lease the heartbeat found lost; attach
        again after a retired loss (the scheduler, sending nothing on a lost session,
        would otherwise wait for the :class:`Reconnected` forever)."""
        try:
            self._notice_loss()
            if self._over == self._posted == self._retired:
                self._attached()
        except Exception:  # never let the thread die: vLLM would wait forever
            log.exception("kvcore: the daemon link failed; requests are misses")

    def _notice_loss(self) -> None:
        """If the client learned its lease is lost (the heartbeat, or an answer), end the
        session posted last."""
        if self.client.lease_lost:
            self._end(self._posted)

    def _end(self, attachment: Attachment) -> None:
        """``attachment``'s session is over though the daemon lives: post :class:`Lost` (once);
        nothing is sent until the scheduler retires it."""
        if self._over != attachment:
            self._over = attachment
            log.warning(
                "kvcore: vLLM scheduler: the daemon ended this session (its lease ran out: "
                "the process was silent for longer than the lease); requests are misses "
                "until the copies planned on it are done, then it attaches again"
            )
            self._answer(Lost(attachment))

    def _answer(self, done: Done) -> None:
        with self._answered:
            self._done.put(done)
            self._answered.notify_all()

    def _post(self, ops: list[Op], results: list[object]) -> None:
        for op, result in zip(ops, results, strict=True):
            if isinstance(op, Allocate):
                assert isinstance(result, Allocation), result
                self._answer(Allocated(op.attachment, op.req_id, op.seq, result))
            elif isinstance(op, Extend):
                assert isinstance(result, Extension), result
                self._answer(Extended(op.attachment, op.req_id, op.seq, result))

    def _refused(self, op: Op, exc: KVCoreError) -> bool:
        """One op failed; True if it was the op's own fault (the daemon is fine). Out of
        pages: logged at INFO (an allocation is a miss, asked again later); any other
        refusal: the request runs without kvcore, logged at WARNING once per code. The
        daemon gone: quiet, then attach again (:class:`~.reconnect.Reconnector`)."""
        what = type(op).__name__.lower()
        if daemon_gone(exc):
            self._reconnect.gone(exc, what)
            if isinstance(op, Allocate):
                self._answer(Failed(op.attachment, op.req_id, op.seq))
            cause = exc.error if isinstance(exc, BatchFailed) else exc
            if isinstance(cause, LeaseLost | NotAttached):  # over, though the daemon lives
                self._end(op.attachment)
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
            answer = Failed if failed else Refused
            self._answer(answer(op.attachment, op.req_id, op.seq))
        return True

    def _drop(self, ops: list[Op]) -> None:
        """Ops that did not run (the daemon gone, an older attachment's, or the link
        failed): allocations are answered as misses; the rest are dropped."""
        for op in ops:
            if isinstance(op, Allocate):
                self._answer(Failed(op.attachment, op.req_id, op.seq))


def _queue(batch: Batch, ops: list[Op]) -> None:
    for op in ops:
        match op:
            case Allocate():
                batch.allocate(op.seq, op.tokens, op.space)
            case Extend():
                batch.extend(op.seq, op.num_tokens)
            case Commit():
                batch.commit(op.seq, op.tokens, start=op.start)
            case Free():
                batch.free(op.seq)
            case Retire():  # pragma: no cover - taken out by _handle
                raise AssertionError(op)
