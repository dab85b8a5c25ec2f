"""The one reconnect policy (kvcore.integrations.reconnect), pure: a clock the test moves,
a client stand-in whose attach succeeds or fails on command. Both engines' use of it
through a real daemon restart: tests/test_vllm_recovery.py (vLLM) and
tests/test_sglang_faults.py (SGLang)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvcore.errors import (
    BadRequest,
    BatchFailed,
    Forbidden,
    LeaseLost,
    NotAttached,
    OutOfPages,
    QuotaExceeded,
    StaleEpoch,
    Timeout,
    batch_failed,
)
from kvcore.integrations.reconnect import (
    MAX_RETRY_S,
    SOON_S,
    Attachment,
    Backoff,
    Reconnector,
    daemon_gone,
)


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Daemon:
    """A client stand-in: ``reconnect`` attaches to the daemon of ``epoch`` with a new
    session, or raises ``down`` (a daemon not answering)."""

    epoch: int = 1
    session: int = 1
    down: Exception | None = None
    lost: bool = False
    attaches: list[int] = field(default_factory=list)  # the epoch of each attach

    @property
    def lease_lost(self) -> bool:
        return self.lost

    def reconnect(self) -> None:
        if self.down is not None:
            raise self.down
        self.session += 1
        self.lost = False
        self.attaches.append(self.epoch)


def reconnector(retry_s: float = 1.0) -> tuple[Reconnector, Daemon, Clock]:
    clock, daemon = Clock(), Daemon()
    return Reconnector.of(daemon, retry_s=retry_s, what="test", clock=clock), daemon, clock


@pytest.mark.parametrize("error", [Timeout, StaleEpoch, LeaseLost, NotAttached])
def test_these_mean_the_daemon_is_gone(error: type[Exception]) -> None:
    assert daemon_gone(error("x"))
    assert daemon_gone(batch_failed(error("x"), 2, [1, 2]))


@pytest.mark.parametrize("error", [OutOfPages, QuotaExceeded, Forbidden, BadRequest])
def test_these_are_one_calls_and_the_daemon_is_fine(error: type[Exception]) -> None:
    assert not daemon_gone(error("x"))
    failed = batch_failed(error("x"), 0, [])
    assert isinstance(failed, BatchFailed) and not daemon_gone(failed)


def test_the_quiet_period_doubles_per_failure_in_a_row_up_to_the_cap() -> None:
    clock = Clock()
    backoff = Backoff(5.0, clock=clock)
    periods = [backoff.failed() for _ in range(7)]
    assert periods == [5, 10, 20, 40, MAX_RETRY_S, MAX_RETRY_S, MAX_RETRY_S]
    assert backoff.quiet() and backoff.down
    clock.now += MAX_RETRY_S
    assert not backoff.quiet() and backoff.down  # quiet over; still to attach again
    backoff.succeeded()
    assert not backoff.down and backoff.failed() == 5  # the next row starts over
    assert Backoff(1.0, clock=clock).failed() == 1.0
    for _ in range(2000):  # no float overflow however long the daemon stays away
        backoff.failed()
    assert backoff.failed() == MAX_RETRY_S


def test_retry_s_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="retry_s"):
        Backoff(-1.0)
    with pytest.raises(ValueError, match="retry_s"):
        Backoff(MAX_RETRY_S + 1)


def test_nothing_is_sent_while_quiet_then_one_attach_and_calls_go_on() -> None:
    rec, daemon, clock = reconnector(retry_s=2.0)
    first = rec.attachment
    assert rec.ready() and daemon.attaches == []  # attached, nothing to do
    rec.gone(Timeout("no answer"), "allocate")
    assert rec.quiet() and not rec.ready()
    clock.now += 1.9
    assert not rec.ready() and daemon.attaches == []
    daemon.epoch = 7  # it restarted meanwhile
    clock.now += 0.1
    assert rec.due() and rec.ready()
    assert daemon.attaches == [7] and not rec.quiet() and not rec.due()
    assert rec.attachment == Attachment(7, daemon.session) != first
    assert rec.ready() and daemon.attaches == [7]  # once: calls go on


def test_a_failed_attach_is_one_more_failure_in_a_row() -> None:
    rec, daemon, clock = reconnector(retry_s=1.0)
    rec.gone(Timeout("no answer"), "commit")
    daemon.down = Timeout("still down")
    clock.now += 1.0
    assert not rec.ready()  # tried, failed: quiet for 2 s now
    clock.now += 1.5
    assert not rec.ready() and rec.quiet()
    daemon.down = None
    clock.now += 0.5
    assert rec.ready() and daemon.attaches == [1]
    rec.gone(Timeout("again"), "free")  # a new row: retry_s again
    clock.now += 1.0
    assert rec.ready() and daemon.attaches == [1, 1]


@pytest.mark.parametrize("wrap", [False, True], ids=["call", "batch"])
def test_a_row_that_starts_with_stale_epoch_attaches_soon_then_backs_off(wrap: bool) -> None:
    """A daemon answered StaleEpoch (a restarted one, or one stopping for a takeover):
    attach after SOON_S, not retry_s; attaches that fail double from there."""
    rec, daemon, clock = reconnector(retry_s=5.0)
    stale = StaleEpoch("restarted")
    rec.gone(batch_failed(stale, 0, []) if wrap else stale, "allocate")
    assert rec.quiet()
    daemon.down = Timeout("the successor is not bound yet")
    clock.now += SOON_S
    assert not rec.ready()  # tried: quiet 2 * SOON_S now
    clock.now += 2 * SOON_S - 0.001
    assert not rec.ready() and daemon.attaches == []
    daemon.down = None
    daemon.epoch = 3
    clock.now += 0.001
    assert rec.ready() and daemon.attaches == [3]
    rec.gone(Timeout("gone"), "free")  # a new row, not of StaleEpoch: retry_s
    clock.now += 5.0 - 0.001
    assert not rec.ready()


def test_a_session_known_over_attaches_again_at_once() -> None:
    rec, daemon, _ = reconnector()
    daemon.lost = True  # the heartbeat found the lease lost
    assert rec.due() and rec.ready() and daemon.attaches == [1]
    rec.stale()  # a vLLM worker saw a plan of a newer daemon
    daemon.epoch = 9
    assert rec.ready() and rec.attachment.epoch == 9


def test_a_stale_session_waits_out_a_quiet_period() -> None:
    rec, daemon, clock = reconnector(retry_s=3.0)
    rec.gone(Timeout("x"), "allocate")
    rec.stale()
    assert not rec.due() and not rec.ready()
    clock.now += 3.0
    assert rec.ready() and daemon.attaches == [1]


def test_an_attach_that_fails_in_the_environment_is_one_more_failure_never_raised() -> None:
    """Client.reconnect maps its own mapping failures to a KVCoreError (StaleEpoch), but
    an OSError of the environment (a segment gone, a socket) must not reach an engine's
    hooks either: a failed attach, a quiet period, the attachment the last that worked."""
    rec, daemon, clock = reconnector(retry_s=1.0)
    first = rec.attachment
    rec.gone(StaleEpoch("restarted"), "load")
    daemon.down = FileNotFoundError(2, "No such file or directory", "/dev/shm/kvcore-x")
    clock.now += 1.0
    assert not rec.ready() and rec.quiet() and rec.attachment == first
    daemon.down = OSError("mmap failed")
    clock.now += 2.0
    assert not rec.ready() and rec.attachment == first
    daemon.down = None
    clock.now += 4.0
    assert rec.ready() and daemon.attaches == [1] and rec.attachment != first
