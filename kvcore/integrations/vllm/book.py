"""The scheduler side's records of its session, and their side on the daemon.

:class:`RequestBook` keeps one :class:`~.records.RequestRecord` per vLLM request,
all of the session's attachment (:class:`~.session.Session`), and sends the ops on
their sequences: an extension ahead of the generated tokens to save
(:meth:`RequestBook.grow`), a commit of what the worker reported saved
(:meth:`RequestBook.saved`: of the very sequence planned, never before the copy),
a free once the request is done and no copy of it is in flight
(:meth:`RequestBook.release`, :meth:`RequestBook.copied`). The link's results
(:meth:`RequestBook.absorb`) are each matched by its type (:data:`~.link.Done`)::

    result        about                        does
    Reconnected   any attachment               every record dropped; Session.reattach
    Lost          the session's attachment     every record dropped; Session.lose
    (any other)   an attachment not held       nothing: its sequences are gone
    Allocated     a record's sequence          ASKED -> HELD (RequestRecord.allocated)
    Extended      a record's sequence          the sequence grew (RequestRecord.extended)
    Allocated,    a record's sequence, an      the request runs without kvcore (logged),
    Extended      answer that does not fit     its sequence freed once no copy is in flight
    Failed        an ASKED record              MISSED: 0 once, asked afresh later
    Refused       an ASKED record              WITHOUT, until it finishes
    Refused       an extending record          no room to grow: saves stop at a whole page
    Allocated     no record of that sequence   the sequence freed (finished meanwhile)

A record dropped with loads queued for the next plan turns them into load errors
(:meth:`RequestBook.take_failed`, by block; by request on a hybrid engine, whose loads
are asynchronous): vLLM recomputes those blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvcore.integrations.vllm.link import (
    Allocated,
    Answer,
    Commit,
    DaemonLink,
    Extend,
    Extended,
    Failed,
    Free,
    Lost,
    Reconnected,
    Refused,
)
from kvcore.integrations.vllm.metadata import Ticket
from kvcore.integrations.vllm.records import HOLDING, Phase, Reach, RequestRecord, tokens_of
from kvcore.integrations.vllm.session import Session

log = logging.getLogger("kvcore.vllm")
EXTEND_PAGES = 4  # pages a sequence grows by at a time for generated tokens


@dataclass(slots=True)
class RequestBook:
    """The records of the session (vLLM request id -> its one record) and the loads
    vLLM must be told failed; the ops they imply go to ``link``. Changed only by the
    scheduler side's thread."""

    session: Session
    link: DaemonLink
    page_size: int
    by_request: bool  # loads fail by request (several KV cache groups), else by block
    reach: Reach
    records: dict[str, RequestRecord] = field(default_factory=dict)
    failed_blocks: list[int] = field(default_factory=list)  # loads that will never run
    failed_recv: list[str] = field(default_factory=list)  # the same, by request id

    def absorb(self) -> None:
        """The link's results since the last call, in order; then the ops the session's
        transitions imply."""
        for done in self.link.take():
            match done:
                case Reconnected():
                    self._drop_all()
                    self.session.reattach(done.attachment)
                case Lost():
                    if self.session.lose(done.attachment):  # this session's end
                        self._drop_all()
                case _ if self.session.holds(done.attachment):
                    self._answered(done)
        self.flush()

    def flush(self) -> None:
        """Send what the session's transitions queued."""
        for op in self.session.take_ops():
            self.link.send(op)

    def planned(self, ticket: Ticket) -> RequestRecord | None:
        """The record a plan's ticket was built for, if it is still this side's."""
        record = self.records.get(ticket.req_id)
        if ticket.epoch != self.session.attachment.epoch or record is None:
            return None
        return record if record.seq == ticket.seq else None

    def grow(self, record: RequestRecord, computed: int) -> None:
        """Extend the sequence ahead of the generated tokens it will save: when the
        step's ``computed`` tokens come within a page of its end, by
        :data:`EXTEND_PAGES` pages at most (no further than ``limit``: the pages its
        ``max_tokens`` can fill)."""
        if record.extending or record.limit <= record.capacity:
            return
        if computed + self.page_size > record.capacity:
            record.extending = min(EXTEND_PAGES * self.page_size, record.limit - record.capacity)
            req_id = record.request.request_id
            self.link.send(Extend(self.session.attachment, req_id, record.seq, record.extending))

    def saved(self, ticket: Ticket, upto: int) -> None:
        """The worker saved the ticket's pages below ``upto``: commit those kvcore does
        not hold yet (of the very sequence planned only; once all their tokens are known)."""
        record = self.planned(ticket)
        if record is None or upto <= record.confirmed:
            return
        start = record.confirmed * self.page_size
        tokens = tokens_of(record.request)[start : upto * self.page_size]
        if len(tokens) < (upto - record.confirmed) * self.page_size:
            return  # not every token of the pages is known yet: commit later
        self.link.send(Commit(self.session.attachment, record.seq, tokens, start))
        record.confirmed = upto
        record.scheduled = max(record.scheduled, upto)  # never saved twice

    def copied(self, ticket: Ticket) -> bool:
        """A plan's copies of ``ticket`` ran (reported). True if that released a finished
        request which committed pages of its own."""
        record = self.planned(ticket)
        if record is None:  # dropped meanwhile (its sequence may be retiring)
            self.session.ticket_reported(ticket)
            return False
        assert record.in_flight > 0, record
        record.in_flight -= 1
        if record.phase is not Phase.FINISHED or record.in_flight:
            return False
        self.release(record)
        return record.confirmed > record.hit

    def ticket(self, record: RequestRecord) -> Ticket:
        return Ticket(record.request.request_id, self.session.attachment.epoch, record.seq)

    def release(self, record: RequestRecord) -> None:
        """Free the record's sequence and forget the request."""
        del self.records[record.request.request_id]
        self.link.send(Free(self.session.attachment, record.seq))

    def take_failed(self) -> tuple[list[int], list[str]]:
        """The loads that will never run, for the next plan: blocks, request ids."""
        failed = self.failed_blocks, self.failed_recv
        self.failed_blocks, self.failed_recv = [], []
        return failed

    def close(self) -> None:
        """Free every sequence held (and every dropped one still retiring)."""
        for record in list(self.records.values()):
            if record.phase in HOLDING:
                self.release(record)
        self.records.clear()
        self.session.close()
        self.flush()

    def check_integrity(self) -> None:
        """Every record's invariants (:meth:`RequestRecord.check`) and the session's."""
        for record in self.records.values():
            record.check(self.page_size)
        assert self.session.attached or not self.records, self.records  # lost: none
        self.session.check_integrity()

    def _answered(self, done: Answer) -> None:
        """An answer about one request's op, on the session held."""
        record = self.records.get(done.req_id)
        if record is None or record.seq != done.seq:  # finished meanwhile, or stale
            if isinstance(done, Allocated):
                self.link.send(Free(self.session.attachment, done.seq))
            return
        match done:
            case Allocated() | Extended() if not record.fits(done.result, self.page_size):
                self._misfit(record, done)
            case Allocated():
                record.allocated(done.result, self.page_size, self.reach.limit(record.request))
            case Extended():
                record.extended(done.result)
            case Failed() if record.phase is Phase.ASKED:  # a miss: asked afresh later
                record.phase, record.seq = Phase.MISSED, 0
            case Refused() if record.phase is Phase.ASKED:  # runs without kvcore
                record.phase, record.seq = Phase.WITHOUT, 0
            case Refused():  # an extension: no room to grow; saves stop at a whole page
                aligned = record.capacity // self.page_size * self.page_size
                record.limit = min(record.limit, aligned)
                record.extending = 0

    def _misfit(self, record: RequestRecord, done: Allocated | Extended) -> None:
        """The daemon's answer does not fit the record (RequestRecord.fits): the request
        runs without kvcore from now on, never an exception in vLLM's hooks. Its queued
        loads fail (vLLM recomputes them), nothing more of it is committed, and its
        sequence is freed once no plan with a copy of it is in flight (Session.drop)."""
        req_id = record.request.request_id
        log.warning(
            "kvcore: the daemon's %s answer for request %s does not fit what was asked "
            "(%r); the request runs without kvcore from now on",
            type(done).__name__.lower(),
            req_id,
            done.result,
        )
        self._fail_loads(record)
        self.session.drop(self.ticket(record), record.in_flight)
        if record.phase is Phase.FINISHED:
            del self.records[req_id]
        else:
            self.records[req_id] = RequestRecord(record.request, Phase.WITHOUT)

    def _drop_all(self) -> None:
        """Every record goes (their sequences died with the session); their queued loads
        become load errors."""
        for record in self.records.values():
            self._fail_loads(record)
        self.records.clear()

    def _fail_loads(self, record: RequestRecord) -> None:
        """The record's queued loads will never run: vLLM is told in the next plan (by
        block on one group; by request on several, whose loads are asynchronous)."""
        if record.loads and self.by_request:
            self.failed_recv.append(record.request.request_id)
        else:
            self.failed_blocks += [blocks[0] for _, blocks in record.loads]
        record.loads = []
