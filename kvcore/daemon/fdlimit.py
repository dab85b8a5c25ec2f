"""The daemon's open-file limit: raised at start, and a reserve kept for ZeroMQ.

libzmq aborts the whole process when it cannot get a descriptor for a connection
it accepts ("Too many open files"), so nothing a client can make the daemon open
(metrics connections, the descriptors that watch client processes) may use up the
limit. Two parts:

* :func:`raise_soft_limit`, once at start: the soft ``RLIMIT_NOFILE`` goes up to the
  hard one (never down), as most servers do (nginx ``worker_rlimit_nofile``, systemd's
  ``LimitNOFILE`` soft=hard); the common soft limit of 1,024 is far below what the
  daemon may be given.
* :func:`spare`: descriptors left once ``RESERVE`` is kept back, for whatever opens
  descriptors on a client's behalf to check before it does (units: descriptors).
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

RESERVE = 128  # descriptors kept for ZeroMQ (its sockets, signalers, ipc:// peers), logs, files
NR_OPEN = "/proc/sys/fs/nr_open"  # Linux: the most a process may be allowed
UNLIMITED_CAP = 1 << 20  # an unlimited hard limit: raise to this (Linux's default nr_open)

log = logging.getLogger("kvcore.daemon")


@dataclass(frozen=True, slots=True)
class NofileLimit:
    """The process's open-file limits after :func:`raise_soft_limit` (descriptors)."""

    soft: int  # the soft limit now
    hard: int  # the hard limit (RLIM_INFINITY as resource reports it)
    was: int  # the soft limit before the call; soft >= was always


def raise_soft_limit() -> NofileLimit:
    """Raise the soft RLIMIT_NOFILE to the hard limit (never lower it) and log what was
    done. An unlimited hard limit raises it to the kernel's ``nr_open``; a refusal by
    the kernel leaves the limit as it was (logged as a warning)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _kernel_max()
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the soft limit of open files from %d: %s", soft, exc)
            return NofileLimit(soft, hard, soft)
        log.info("raised the soft limit of open files from %d to %d (the hard limit)", soft, target)
        return NofileLimit(target, hard, soft)
    log.debug("the soft limit of open files is %d (hard %d): kept", soft, hard)
    return NofileLimit(soft, hard, soft)


def _kernel_max() -> int:
    try:
        with open(NR_OPEN, encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return UNLIMITED_CAP


def open_descriptors() -> int | None:
    """How many descriptors the process has open now, or None where this cannot be
    counted (no /proc or /dev/fd). O(open descriptors): not for a per-request path."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder)) - 1  # listdir's own descriptor is listed too
        except OSError:
            continue
    return None


def spare(reserve: int = RESERVE) -> int | None:
    """Descriptors the process may still open and keep ``reserve`` of them free (may be
    negative: already inside the reserve), or None where the open ones cannot be counted."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = _kernel_max()
    used = open_descriptors()
    return None if used is None else soft - used - reserve
