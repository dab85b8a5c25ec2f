"""Who still maps a pool's segment through a mapping no session of this daemon accounts for.

A daemon that re-adopted a host pool's segment after a restart (kvcore.daemon.restore)
withholds every page it did not restore (free, held or being written when the last
daemon ended) while a process that attached to that daemon may still write them
through its old mapping: an engine mid-step does not know yet that the daemon is
gone. A client fences its old mapping (private scratch pages at the same address) at
the first StaleEpoch it reads (kvcore.client.Client.fence), so a fenced mapping no
longer names the segment; a client that attaches again maps it anew, and says so
(``Attach.maps``).

So the rule: a process holds a stale mapping while it maps the segment more times
than it has sessions on the pool that said they map it (SessionTable.mappers). Only
this uid's processes are read (``/proc/<pid>/maps``): a 0600 segment maps for no
other user; a pool shared with a group is never judged this way (its other users'
maps are unreadable), it waits for the fence timeout. Linux only; elsewhere
:func:`segment_mappings` answers None (unknown: keep withholding).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

PROC = Path("/proc")


def segment_mappings(name: str, proc: Path = PROC) -> Counter[int] | None:
    """Per process of this uid but this one, how many mappings of the POSIX shared-memory
    segment ``name`` it holds (lines of its ``maps`` naming ``/dev/shm/<name>``, deleted
    or not; a mapping split by ``mprotect`` counts more than once, which only withholds
    longer). None where ``proc`` cannot be read (not Linux). A process that exits while
    it is read counts as holding none."""
    try:
        entries = os.listdir(proc)
    except OSError:
        return None
    me, uid = os.getpid(), os.getuid()
    path = f"/dev/shm/{name}"
    found: Counter[int] = Counter()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(proc / entry).st_uid != uid:
                continue
            with open(proc / entry / "maps", encoding="utf-8", errors="replace") as maps:
                count = sum(1 for line in maps if _names(line, path))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if count:
            found[int(entry)] = count
    return found


def _names(line: str, path: str) -> bool:
    """Whether one ``maps`` line maps ``path`` (its sixth field, "(deleted)" aside)."""
    fields = line.split(maxsplit=5)
    return len(fields) == 6 and fields[5].rstrip("\n").removesuffix(" (deleted)") == path


def stale_mappers(mappings: Counter[int], mappers: Counter[int]) -> dict[int, int]:
    """The processes of ``mappings`` (pid -> mappings of the segment) holding more than
    ``mappers`` accounts for (pid -> its sessions that said they map it): pid -> how
    many more. Empty: every mapping of the segment is a current session's."""
    return {pid: n - mappers[pid] for pid, n in mappings.items() if n > mappers[pid]}
