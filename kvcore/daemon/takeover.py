"""``kvcore serve --takeover``: start in place of the daemon that serves the endpoint.

The new daemon, its configuration read and checked and its code loaded, asks the
running one to stop with SIGTERM, its clean stop: it refuses what it read but
did not serve (``stale_epoch``), marks its kept pools clean and releases the
endpoint's locks. The new one takes each lock as soon as it is free, then starts
as any daemon does, re-adopting the pools the old one kept
(kvcore.daemon.restart). Engines see one StaleEpoch and attach again; the pause
a new client sees is the old daemon's stop plus the new one's re-adopt and bind
(``kvcore bench restart``; docs/benchmarks.md, "Restarts").

Whom it signals: the pid that the endpoint's lock file names, only while that
lock is held and the file is this user's alone (``EndpointLock.holder``), and
only a process of this user. With nothing to take over it starts as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass

from kvcore_ipc.server import EndpointBusy, EndpointLock
from kvcore_ipc.shm import pid_alive

from kvcore.errors import BadRequest

from .notify import notify

log = logging.getLogger("kvcore.daemon")

TAKEOVER_TIMEOUT_S = 60.0  # how long the old daemon may take to stop (it frees its sessions)
POLL_S = 0.002  # how often a lock it holds is tried meanwhile


@dataclass(frozen=True, slots=True)
class Takeover:
    """The locks taken, and from whom: ``pid`` 0 when nothing held them; ``stopped_s``:
    seconds from the signal to the last lock."""

    locks: list[EndpointLock]
    pid: int = 0
    stopped_s: float = 0.0


def take_over(endpoints: list[str], timeout_s: float = TAKEOVER_TIMEOUT_S) -> Takeover:
    """The locks of ``endpoints`` (ipc://; the request endpoint first, whose lock names
    the daemon), taken from the daemon that holds them. BadRequest for a request
    endpoint that is not ipc:// (it has no lock that names its daemon) or a holder
    that is not this user's; EndpointBusy if it has not let go within ``timeout_s``."""
    if not endpoints[0].startswith("ipc://"):
        raise BadRequest(
            f"--takeover finds the running daemon by its ipc:// endpoint's lock; "
            f"{endpoints[0]} has none: stop that daemon, then start this one"
        )
    pid = EndpointLock.holder(endpoints[0]) or 0
    start = time.monotonic()
    locks: list[EndpointLock] = []
    if not pid:  # free, or held by a daemon whose lock names no pid (an older kvcore)
        try:
            locks.append(EndpointLock(endpoints[0]))
        except EndpointBusy:
            raise EndpointBusy(
                f"a daemon holds {endpoints[0]}, but its lock file names no pid to ask "
                "to stop (an older kvcore?): stop it, then start this one"
            ) from None
    else:
        _check_ours(pid)
        notify(f"MAINPID={os.getpid()}")  # the service's main process from now on
        os.kill(pid, signal.SIGTERM)
        log.info("takeover: asked the daemon of %s (pid %d) to stop", endpoints[0], pid)
    try:
        for endpoint in endpoints[len(locks) :]:
            locks.append(_wait_for(endpoint, start + timeout_s, pid))
        while pid and pid_alive(pid):  # its pools' manifests name it until it is gone
            if time.monotonic() >= start + timeout_s:
                raise EndpointBusy(
                    f"the daemon (pid {pid}) let go of {endpoints[0]} but did not exit"
                )
            time.sleep(POLL_S)
    except BaseException:
        for lock in locks:
            lock.release()
        if pid:
            notify(f"MAINPID={pid}")
        raise
    return Takeover(locks, pid, time.monotonic() - start)


def _check_ours(pid: int) -> None:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return  # gone already: its lock is free in a moment
    if uid != os.getuid():
        raise BadRequest(f"the lock of the endpoint names pid {pid}, a process of uid {uid}")


def _wait_for(endpoint: str, deadline: float, pid: int) -> EndpointLock:
    while True:
        with contextlib.suppress(EndpointBusy):
            return EndpointLock(endpoint)
        if time.monotonic() >= deadline:
            who = f"the daemon (pid {pid})" if pid else "a daemon"
            raise EndpointBusy(
                f"{who} on {endpoint} did not let go of it in time (it was asked to stop)"
            )
        time.sleep(POLL_S)
