"""DiskTier: pages in files of one directory, bounded by bytes, surviving restarts.

One file per entry, named by its key, holding the framed page (kvcore.tiers.codec)::

    <dir>/<fingerprint hex>-<prefix key hex>.kv     80-byte header + page_bytes bytes
    <dir>/.tmp-<fingerprint hex>-<random>           a write in progress
    <dir>/.lock-<fingerprint hex>                   flock: one DiskTier per directory and layout

* Writes are atomic: temp file, then rename over the final name. No fsync: a
  file torn by a crash fails its checksum and is a miss, never wrong bytes.
* Reads verify magic, key, length and checksum; a torn, corrupt or foreign
  file is a miss, counted in ``corrupt`` and deleted. With a ``keyring`` (the
  deployment's secret, kvcore.tiers.secret) entries are framed by
  kvcore.tiers.keyed instead: MAC'd with HMAC-SHA256 over the tier key, header
  and page, so a file planted by someone without the secret is a miss too
  (unkeyed entries left from before are deleted at start, and the reverse).
* Start-up scans the directory: each file of this layout whose size and header
  fit is indexed (recency = its mtime), everything else of this layout is
  deleted; files of other layouts are left to their own tier. So a new daemon
  on the same directory serves the old entries, each verified when read.
* Evicted by the pool's policy (kvcore.eviction); recency persisted as mtime (a
  hit touches the file), so a restart rebuilds the recency order (a policy's other
  state, such as which entries were hit, starts afresh); at most
  ``capacity_bytes // entry_bytes`` entries of this layout.
* The directory is the user's alone: opened once by descriptor, its parents
  walked and checked on their descriptors (kvcore.tiers.directory: created
  0700, refused if it is a symlink, another user's, open to group/others, or
  below a parent others may write that is not sticky); every file is opened,
  renamed, unlinked and listed relative to that descriptor, created 0600 with
  O_NOFOLLOW: no symlink is ever followed, and a path swapped after the check
  is never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.errors import BadRequest
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.eviction import make_policy
from kvcore.layout import KVLayout
from kvcore.tiers.base import (
    FINGERPRINT_BYTES,
    LocalKeys,
    TierKey,
    TierStats,
    check_keys,
    check_pages,
    layout_fingerprint,
)
from kvcore.tiers.codec import HEADER_BYTES, Checksummed, Framing
from kvcore.tiers.directory import open_private_dir
from kvcore.tiers.keyed import Keyed
from kvcore.tiers.secret import Keyring
from kvcore.tiers.transfer import byte_view, pages_from_bytes

if TYPE_CHECKING:
    import torch

_NAME = re.compile(r"([0-9a-f]{32})-([0-9a-f]{64})\.kv")
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskTier(LocalKeys):
    """Pages in files, evicted by the policy ``eviction`` names (kvcore.eviction). Not
    thread-safe (the daemon's thread). :meth:`close` it."""

    medium = "disk"

    def __init__(
        self,
        layout: KVLayout,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        keyring: Keyring | None = None,
        eviction: str = DEFAULT_EVICTION,
    ) -> None:
        self.layout = layout
        self.fingerprint = layout_fingerprint(layout)
        self.directory = os.fspath(directory)
        self._page_bytes = layout.page_bytes
        self.entry_bytes = HEADER_BYTES + layout.page_bytes
        if not isinstance(capacity_bytes, int) or capacity_bytes < self.entry_bytes:
            raise BadRequest(
                f"capacity_bytes must hold one entry of {self.entry_bytes} bytes, got {capacity_bytes!r}"
            )
        self.capacity_pages = capacity_bytes // self.entry_bytes
        self._framing: Framing = Checksummed() if keyring is None else Keyed(keyring)
        self._dir = open_private_dir(self.directory)
        self._fp_hex = self.fingerprint.hex()
        self._lock = self._take_lock()
        self._where: dict[TierKey, None] = {}  # held keys (each its own file)
        self._order = make_policy(eviction, self.capacity_pages)
        self._stats = TierStats()
        self._clock = 0  # ns; the newest mtime stamped (see _touch)
        self._scan()

    # -- the tier ---------------------------------------------------------------

    def match(self, keys: Sequence[TierKey]) -> int:
        where = self._where
        for i, key in enumerate(keys):
            if key not in where:
                return i
        return len(keys)

    def get_many(self, keys: Sequence[TierKey]) -> torch.Tensor:
        check_keys(self.fingerprint, keys)
        held = self.match(keys)
        page_bytes = self._page_bytes
        buffer = bytearray(held * page_bytes)
        view = memoryview(buffer)
        count = 0
        while count < held and self._read(
            keys[count], view[count * page_bytes : (count + 1) * page_bytes]
        ):
            self._order.touch(keys[count])
            self._touch(keys[count])
            count += 1
        stats = self._stats
        stats.hits += count
        stats.misses += len(keys) - count
        stats.bytes_out += count * page_bytes
        self._gauges()
        return pages_from_bytes(buffer, count, self.layout)

    def put_many(self, keys: Sequence[TierKey], pages: torch.Tensor) -> list[TierKey]:
        """Write each new key's page to its own file (temp + rename); a key held is
        touched. A failed write (disk full, I/O error) drops that page, counted."""
        check_keys(self.fingerprint, keys)
        check_pages(self.layout, keys, pages)
        pages = pages.contiguous()
        evicted: list[TierKey] = []
        for row, key in enumerate(keys):
            if key in self._where:
                self._order.touch(key)
                self._touch(key)
                continue
            while len(self._where) >= self.capacity_pages:
                old, _ = self._evict()
                self._unlink(self._name(old))
                evicted.append(old)
            if self._write(key, byte_view(pages[row])):
                self._store(key, None)
                self._touch(key)
                self._stats.stored += 1
                self._stats.bytes_in += self._page_bytes
            else:
                self._stats.dropped += 1
        self._stats.evicted += len(evicted)
        self._gauges()
        return evicted

    def close(self) -> None:
        """Release the directory (its lock and fd); the files stay for the next start."""
        if self._dir >= 0:
            os.close(self._lock)
            os.close(self._dir)
            self._dir = -1

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_integrity(self) -> None:
        names = {
            entry.name for entry in os.scandir(self._dir) if entry.name.startswith(self._fp_hex)
        }
        assert names == {self._name(key) for key in self._where}, "index and directory disagree"
        assert set(self._order) == set(self._where), "the policy and the files hold other keys"
        assert len(self._where) <= self.capacity_pages, "more entries than capacity"
        assert self._stats.pages == len(self._where), "stats.pages drifted"

    # -- files ------------------------------------------------------------------

    def _name(self, key: TierKey) -> str:
        return f"{self._fp_hex}-{key[FINGERPRINT_BYTES:].hex()}.kv"

    def _take_lock(self) -> int:
        lock = os.open(
            f".lock-{self._fp_hex}",
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=self._dir,
        )
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            os.close(self._dir)
            raise BadRequest(
                f"disk tier directory {self.directory!r} is in use by another tier of this layout"
            ) from None
        return lock

    def _scan(self) -> None:
        """Index this layout's valid-looking files by mtime; delete the rest of ours."""
        found: list[tuple[int, TierKey]] = []
        for entry in os.scandir(self._dir):
            name = entry.name
            if name.startswith(f".tmp-{self._fp_hex}"):
                self._unlink(name)  # a write a crash interrupted
                continue
            match = _NAME.fullmatch(name)
            if match is None or match.group(1) != self._fp_hex:
                continue
            key = TierKey(self.fingerprint + bytes.fromhex(match.group(2)))
            info = entry.stat(follow_symlinks=False)
            if (
                stat.S_ISREG(info.st_mode)
                and info.st_size == self.entry_bytes
                and self._header_ok(key)
            ):
                found.append((info.st_mtime_ns, key))
            else:
                self._unlink(name)
                self._stats.corrupt += 1
        found.sort()
        self._clock = found[-1][0] if found else 0
        for _, key in found[max(len(found) - self.capacity_pages, 0) :]:
            self._store(key, None)  # oldest first: the policy starts from recency alone
        for _, key in found[: max(len(found) - self.capacity_pages, 0)]:
            self._unlink(self._name(key))
        self._gauges()

    def _header_ok(self, key: TierKey) -> bool:
        try:
            fd = os.open(self._name(key), _OPEN_READ, dir_fd=self._dir)
        except OSError:
            return False
        with os.fdopen(fd, "rb", buffering=0) as file:
            return self._framing.header_fits(key, file.read(HEADER_BYTES), self._page_bytes)

    def _read(self, key: TierKey, payload: memoryview) -> bool:
        """Read and verify ``key``'s entry into ``payload``; on failure drop it (a miss)."""
        name = self._name(key)
        header = bytearray(HEADER_BYTES)
        try:
            fd = os.open(name, _OPEN_READ, dir_fd=self._dir)
            with os.fdopen(fd, "rb", buffering=0) as file:
                info = os.fstat(file.fileno())
                ok = (
                    stat.S_ISREG(info.st_mode)
                    and info.st_size == self.entry_bytes
                    and _read_full(file, memoryview(header))
                    and _read_full(file, payload)
                    and self._framing.unseal(key, header, payload, self._page_bytes)
                )
        except OSError:
            ok = False
        if not ok:
            self._stats.corrupt += 1
            self._forget(key)
            self._unlink(name)
        return ok

    def _write(self, key: TierKey, payload: memoryview) -> bool:
        temp = f".tmp-{self._fp_hex}-{secrets.token_hex(8)}"
        try:
            fd = os.open(temp, _OPEN_NEW, 0o600, dir_fd=self._dir)
            header, body = self._framing.seal(key, payload)
            with os.fdopen(fd, "wb") as file:
                file.write(header)
                file.write(body)
            os.replace(temp, self._name(key), src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError:
            self._unlink(temp)
            return False
        return True

    def _touch(self, key: TierKey) -> None:
        """Stamp ``key``'s file as the most recently used: mtime from a strictly
        increasing clock (file timestamps are coarser than a burst of writes), so a
        restart rebuilds the exact LRU order."""
        self._clock = max(time.time_ns(), self._clock + 1)
        with contextlib.suppress(OSError):
            os.utime(
                self._name(key),
                ns=(self._clock, self._clock),
                dir_fd=self._dir,
                follow_symlinks=False,
            )

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir)

    def _gauges(self) -> None:
        self._stats.pages = len(self._where)
        self._stats.bytes_used = len(self._where) * self.entry_bytes


def _read_full(file: io.FileIO, into: memoryview) -> bool:
    """Fill ``into`` from a raw file; False at a short file."""
    readinto = file.readinto
    done = 0
    while done < len(into):
        got = readinto(into[done:])
        if not got:
            return False
        done += got
    return True
