"""Process watching: one pidfd per peer process, shared by its sessions, polled at once.

The daemon learns that a client process exited from a pidfd of the pid the
kernel reported for its ipc:// connection (a pidfd polls readable once its
process has exited). A process may open many sessions, so descriptors are per
process, not per session: :meth:`Watcher.watch` hands out a refcounted
:class:`Watch`, and the descriptor is closed when the process is seen to exit
or its last session lets go, whichever comes first. Descriptors are polled
with ``select.poll`` (``select.select`` fails on descriptors >= 1024).

A watch is in one of three states::

    watching    fd open, polled, _by_pid[pid] is it       --(exit seen)--> exited
    unwatchable fd None (no pidfd here, out of fds, or    (never seen to exit)
                only the reserve for ZeroMQ left: fdlimit),
                _by_pid[pid] is it
    exited      fd None, not in _by_pid (a later process with this pid gets a new watch)

Invariants (checked by :meth:`Watcher.check_integrity`): every watch has
``refs >= 1`` and is in ``_watches``; ``fd is not None`` exactly for the
watches in ``_by_fd``, each registered once with the poller; a watch is in
``_by_pid`` exactly when it has not exited, so at most one per pid.
"""

from __future__ import annotations

import errno
import os
import select
from collections.abc import Mapping
from dataclasses import dataclass

from . import fdlimit


@dataclass(slots=True, eq=False)
class Watch:
    """One watched peer process. Only the :class:`Watcher` changes it."""

    pid: int  # the kernel-reported pid, in the daemon's pid namespace
    fd: int | None  # its pidfd while it is watched; None once exited, or if unwatchable
    refs: int = 1  # sessions that hold this watch
    exited: bool = False  # the process was seen to exit (never reset)


class Watcher:
    """Every watched process, at most one descriptor each."""

    __slots__ = ("_by_fd", "_by_pid", "_poller", "_watches")

    def __init__(self) -> None:
        self._poller = select.poll()
        self._watches: set[Watch] = set()
        self._by_pid: dict[int, Watch] = {}  # pid -> its watch, while it has not exited
        self._by_fd: dict[int, Watch] = {}  # pidfd -> its watch

    def __len__(self) -> int:
        """How many watches are held (exited ones included, until released)."""
        return len(self._watches)

    @property
    def descriptors(self) -> int:
        """How many pidfds are open."""
        return len(self._by_fd)

    def held(self, pid: int) -> int:
        """How many sessions hold the watch of the live process ``pid`` (0 if none)."""
        watch = self._current(pid)
        return watch.refs if watch is not None else 0

    def watch(self, pid: int) -> Watch:
        """A reference to the watch of process ``pid``, shared with its other sessions;
        a new pidfd only for a process not watched yet. A process that is gone already
        gets an exited watch; one that cannot be watched (no pidfd on this system, or no
        descriptor left) an unwatchable one, never seen to exit."""
        watch = self._current(pid)
        if watch is not None:
            watch.refs += 1
            return watch
        room = fdlimit.spare()
        try:
            if room is not None and room < 1:  # the reserve is ZeroMQ's: do not dip into it
                raise OSError(errno.EMFILE, "descriptors kept in reserve")
            fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            watch = Watch(pid, None, exited=True)
            self._watches.add(watch)
            return watch
        except (OSError, AttributeError):  # EMFILE, reserve, ENOSYS, no os.pidfd_open
            fd = None
        watch = Watch(pid, fd)
        self._watches.add(watch)
        self._by_pid[pid] = watch
        if fd is not None:
            self._by_fd[fd] = watch
            self._poller.register(fd, select.POLLIN)
        return watch

    def release(self, watch: Watch) -> None:
        """One session of ``watch`` ended; the last one closes its descriptor."""
        assert watch in self._watches and watch.refs > 0, f"release of a dead watch of {watch.pid}"
        watch.refs -= 1
        if watch.refs == 0:
            self._close(watch)
            self._watches.discard(watch)
            if self._by_pid.get(watch.pid) is watch:
                del self._by_pid[watch.pid]

    def poll(self) -> None:
        """Mark every watched process that has exited since the last call (one ``poll``
        system call for all of them; closes their descriptors)."""
        if self._by_fd:
            for fd, _events in self._poller.poll(0):
                self._exit(self._by_fd[fd])

    def close_all(self) -> None:
        """Close every descriptor (the daemon stops)."""
        for watch in list(self._by_fd.values()):
            self._close(watch)

    def check_integrity(self, refs: Mapping[Watch, int]) -> None:
        """Assert the module's invariants, and that ``refs`` (sessions per watch, counted
        by the session table) are the refcounts of exactly the watches held."""
        assert set(refs) == self._watches, (
            f"{len(self._watches)} watches held, {len(refs)} named by sessions"
        )
        for watch in self._watches:
            assert watch.refs == refs[watch] >= 1, (
                f"pid {watch.pid}: refcount {watch.refs}, named by {refs[watch]} sessions"
            )
            polled = watch.fd is not None and self._by_fd.get(watch.fd) is watch
            assert (watch.fd is not None) == polled, f"pid {watch.pid}: fd {watch.fd} not polled"

            assert (self._by_pid.get(watch.pid) is watch) != watch.exited, (
                f"pid {watch.pid}: exited={watch.exited} disagrees with the pid map"
            )
            assert not watch.exited or watch.fd is None, f"pid {watch.pid}: exited, fd open"
        assert len(self._by_fd) == len({w.fd for w in self._by_fd.values()}), "fd reused"

    # -- internals ------------------------------------------------------------------------

    def _current(self, pid: int) -> Watch | None:
        """The watch of the process now running as ``pid``: one whose process exited
        (the pid may have been reused since) is retired first."""
        watch = self._by_pid.get(pid)
        if watch is not None and watch.fd is not None and _ready(watch.fd):
            self._exit(watch)
            return None
        return watch

    def _exit(self, watch: Watch) -> None:
        watch.exited = True
        self._close(watch)
        if self._by_pid.get(watch.pid) is watch:
            del self._by_pid[watch.pid]

    def _close(self, watch: Watch) -> None:
        if watch.fd is not None:
            self._poller.unregister(watch.fd)
            del self._by_fd[watch.fd]
            os.close(watch.fd)
            watch.fd = None


def _ready(fd: int) -> bool:
    """True if the pidfd ``fd`` polls readable (its process exited)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
