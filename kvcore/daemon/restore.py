"""Re-adopting a host pool's segments after a restart: the manifest, and the decision.

A daemon that keeps a host pool's segments beyond its own life (untracked:
``HostRegion.create(tracked=False)``, kvcore_ipc.shm) records them in the pool's
manifest, one small JSON file per pool::

    runtime_dir()/pools/<segment prefix>-<sha256(pool name)[:12]>.manifest

The segment prefix is the endpoint's (``kvcore-<sha256(endpoint)[:12]>``), so only a
daemon of the same endpoint finds it. At start, :func:`reopen_pool` reads it and either
re-adopts the segments it names (:class:`Readopted`: each reopened and mapped) or
decides a cold start (:class:`ColdStart`: why, in one line naming the object and the
setting, and which of our old segments it unlinked). What the pages held (the index
segment named in the manifest) is opaque here. A tiered pool's manifest also names its
host tier's segment (kvcore.tiers.host_table) with the settings that fix its bytes
(:func:`host_tier_settings`); a difference there is a cold start of the host tier
alone (``Readopted.host_note`` says why), its old segment unlinked.

Invariants:

* A manifest is trusted only if its directory is this user's, mode 0700, not a
  symlink, and the file is a regular file (opened with O_NOFOLLOW) of this user with
  no group or other access, at most :data:`MAX_MANIFEST_BYTES`, decoding as a
  :class:`Manifest` of :data:`MANIFEST_VERSION` that names this uid and this pool.
  Anything else is :class:`~kvcore.errors.RestoreRefused`, never a crash.
* Segments are re-adopted only if the manifest is trusted, was written since this
  boot (``boot_id``), by a daemon that is gone (or is this process), for exactly this
  pool's :func:`settings_of` (the page shape and count, shards, device, group, tier
  layout fingerprint, prefix hash domain, byte order), names segments of this
  endpoint's prefix, and each segment passes ``HostRegion.reopen``: this uid, mode
  0600 (0660 of the pool's group), the recorded size. Any refusal is a cold start of
  that pool alone, with every segment it had reopened closed and kept.
* A cold start unlinks only what a *trusted* manifest of a daemon that no longer runs
  names, only names of this prefix, and only segments of this user (``unlink_own``);
  then the manifest itself.
  Anything else of the prefix is left to ``sweep`` (a dead creator's, of this user).
* A manifest is replaced whole (a temporary file, then ``os.replace``): a reader sees
  the old one or the new one, never a torn one; a torn temporary file is never read.

The file is over 400 lines on purpose: the manifest's trust checks and the re-adopt
decision they guard (shards, index table, host tier) are one set of invariants, read
together.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from kvcore_ipc.shm import HostRegion, pid_alive, unlink_own

from kvcore.config import PoolConfig
from kvcore.errors import RestoreRefused, UntrustedEndpoint
from kvcore.paths import runtime_dir
from kvcore.prefix import DOMAIN
from kvcore.tiers.base import layout_fingerprint
from kvcore.tiers.host_table import segment_bytes

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 16  # a manifest is a few hundred bytes; more is not ours
BOOT_ID = "/proc/sys/kernel/random/boot_id"

Setting = str | int | bool
Settings = dict[str, Setting]  # flat: one human line per changed key (differences)


_Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Pid = Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]


class Segment(msgspec.Struct, frozen=True):
    """One shared-memory segment: its name (no leading slash) and size in bytes."""

    name: str
    size: _Count


class TierSegment(msgspec.Struct, frozen=True, kw_only=True):
    """A tier's segment and the settings that fix its bytes (:func:`host_tier_settings`)."""

    name: str
    size: _Count
    settings: Settings


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """One host pool's record, written by the daemon that made (or re-adopted) its
    segments; read only by the next daemon of the same endpoint. Fields are fixed at
    write: a change is a new manifest, written whole."""

    version: int = MANIFEST_VERSION
    boot_id: str  # the kernel's boot id at write: segments do not outlive a reboot
    uid: _Count  # the daemon's user, who owns the file and the segments
    pool: str  # the pool's name
    settings: Settings  # settings_of(pool) at write: re-adopted only if equal
    segments: tuple[Segment, ...]  # one per shard, in shard order
    index: Segment | None = None  # the pool's index segment (its format is not ours)
    host_tier: TierSegment | None = None  # its host tier's (none in a manifest before it)
    epoch: _Count  # the writing daemon's epoch
    pid: _Pid  # the writing daemon's pid: a running one's segments are not taken


class _Version(msgspec.Struct):
    version: int


def boot_id() -> str:
    """The kernel's boot id (Linux), or "" where there is none: then nothing is re-adopted."""
    try:
        return Path(BOOT_ID).read_text().strip()
    except OSError:
        return ""


def settings_of(pool: PoolConfig) -> Settings:
    """What must be equal for a pool's old pages to mean the same thing now: its device,
    shards, group, layout (every field, ``num_pages`` too), one shard's bytes, the tier
    layout fingerprint, the prefix hash domain and the byte order. Not compared: eviction,
    quotas, tiers (they change what stays, never what a page holds)."""
    layout = pool.layout()
    settings: Settings = {"device": pool.device, "shards": pool.shards, "group": pool.group}
    settings.update(layout.to_dict())
    settings["shard_bytes"] = layout.total_bytes
    settings["layout_fingerprint"] = layout_fingerprint(layout).hex()
    settings["hash_domain"] = DOMAIN.decode()
    settings["byte_order"] = sys.byteorder
    return settings


def host_tier_settings(pool: PoolConfig) -> Settings | None:
    """What must be equal for a kept host tier's entries to mean the same thing now (its
    capacity in pages, its page bytes, the layout fingerprint, the byte order); None if
    the pool declares no host tier."""
    layout = pool.layout()
    capacity = pool.tiers.host_bytes() // layout.page_bytes
    if capacity < 1:
        return None
    return {
        "capacity_pages": capacity,
        "page_bytes": layout.page_bytes,
        "layout_fingerprint": layout_fingerprint(layout).hex(),
        "byte_order": sys.byteorder,
    }


def differences(old: Mapping[str, Setting], new: Mapping[str, Setting]) -> list[str]:
    """One line per key whose value differs (a key on one side only too), e.g.
    ``"num_pages 4096 -> 8192"``; empty iff equal. 1 and True differ (types count)."""
    keys = [*new, *(key for key in old if key not in new)]
    return [
        f"{key} {_show(old, key)} -> {_show(new, key)}" for key in keys if not _same(old, new, key)
    ]


def _same(old: Mapping[str, Setting], new: Mapping[str, Setting], key: str) -> bool:
    if key not in old or key not in new:
        return False
    a, b = old[key], new[key]
    return type(a) is type(b) and a == b


def _show(settings: Mapping[str, Setting], key: str) -> str:
    if key not in settings:
        return "(none)"
    value = settings[key]
    return repr(value) if value == "" else str(value)


def pools_dir() -> Path:
    """Where manifests live: ``runtime_dir()/pools``."""
    return runtime_dir() / "pools"


def manifest_path(prefix: str, pool: str, directory: Path | None = None) -> Path:
    """The manifest of pool ``pool`` of the endpoint whose segment prefix is ``prefix``
    (``directory``: :func:`pools_dir` if None)."""
    digest = hashlib.sha256(pool.encode()).hexdigest()[:12]
    return (directory or pools_dir()) / f"{prefix}-{digest}.manifest"


def manifest_for(
    pool: PoolConfig,
    regions: Sequence[HostRegion],
    epoch: int,
    index: HostRegion | None = None,
    host_tier: HostRegion | None = None,
) -> Manifest:
    """The manifest of ``pool`` served from ``regions`` (one per shard) by this process,
    its index table in ``index``, its host tier in ``host_tier``."""
    tier_settings = host_tier_settings(pool)
    tier = None
    if host_tier is not None and tier_settings is not None:
        tier = TierSegment(name=host_tier.name, size=host_tier.size, settings=tier_settings)
    return Manifest(
        boot_id=boot_id(),
        uid=os.getuid(),
        pool=pool.name,
        settings=settings_of(pool),
        segments=tuple(Segment(r.name, r.size) for r in regions),
        index=None if index is None else Segment(index.name, index.size),
        host_tier=tier,
        epoch=epoch,
        pid=os.getpid(),
    )


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Replace ``path`` by ``manifest``, whole: a temporary file beside it (0600, O_EXCL,
    O_NOFOLLOW), then ``os.replace``. The directory is made 0700 if missing;
    UntrustedEndpoint unless it is then a real directory of this user, mode 0700."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path.parent, 0o700)  # never through a symlink: mkdir does not follow one
    why = _directory_refusal(path.parent)
    if why is not None:
        raise UntrustedEndpoint(
            f"manifest directory {path.parent} {why}: remove it (as its owner or root)"
        )
    tmp = path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            data = memoryview(msgspec.json.encode(manifest))
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(path: Path) -> Manifest:
    """The manifest at ``path``; FileNotFoundError if there is none, RestoreRefused (naming
    the file and why) unless it is trusted (the module's first invariant)."""
    why = _directory_refusal(path.parent)
    if why is not None:
        raise RestoreRefused(f"manifest directory {path.parent} {why}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise RestoreRefused(f"manifest {path} {why}") from None
    try:
        raw = _read_private(fd, path)
    finally:
        os.close(fd)
    try:
        version = msgspec.json.decode(raw, type=_Version).version
        if version != MANIFEST_VERSION:
            raise RestoreRefused(f"manifest {path} has version {version}, not {MANIFEST_VERSION}")
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.MsgspecError as exc:
        raise RestoreRefused(f"manifest {path} is not a manifest ({exc})") from None


def _read_private(fd: int, path: Path) -> bytes:
    """The bytes of an open manifest, after the file checks (type, owner, mode, size)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RestoreRefused(f"manifest {path} is not a regular file")
    if st.st_uid != os.getuid():
        raise RestoreRefused(f"manifest {path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        raise RestoreRefused(
            f"manifest {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may have written it"
        )
    chunks, left = [], MAX_MANIFEST_BYTES + 1
    while left > 0 and (chunk := os.read(fd, left)):
        chunks.append(chunk)
        left -= len(chunk)
    if left <= 0:
        raise RestoreRefused(f"manifest {path} is over {MAX_MANIFEST_BYTES} bytes")
    return b"".join(chunks)


def remove_manifest(path: Path) -> bool:
    """Remove ``path`` (never what a symlink there points to); whether there was one."""
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError):
        return False
    return True


def _directory_refusal(path: Path) -> str | None:
    """Why ``path`` is not a directory of this user's alone (as kvcore.paths checks the
    runtime directory), or None. FileNotFoundError if it does not exist."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}"
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


@dataclass(slots=True)
class Readopted:
    """A pool's segments, reopened and mapped, as its manifest records them. The caller
    owns the regions: ``close(unlink=False)`` keeps them for the next start."""

    manifest: Manifest
    regions: list[HostRegion]  # one per shard, in shard order; owners, untracked
    index: HostRegion | None  # the index segment the manifest names, or None
    host_tier: HostRegion | None = None  # the host tier's segment, if re-adopted
    host_note: str = ""  # why the host tier starts empty ("": re-adopted, or none)

    @property
    def names(self) -> list[str]:
        """Every segment re-adopted (``sweep(prefix, keep=names)`` leaves them)."""
        return [r.name for r in self._all()]

    def close(self, *, unlink: bool) -> None:
        for region in self._all():
            region.close(unlink=unlink)

    def _all(self) -> list[HostRegion]:
        extra = [region for region in (self.index, self.host_tier) if region is not None]
        return [*self.regions, *extra]


@dataclass(slots=True, frozen=True)
class ColdStart:
    """The pool starts empty. ``reason``: ``"pool 'x': <object> <setting>: starting empty"``;
    ``removed``: our old segments unlinked (the stale manifest is gone too)."""

    reason: str
    removed: list[str]


def reopen_pool(
    pool: PoolConfig, prefix: str, directory: Path | None = None
) -> Readopted | ColdStart:
    """Re-adopt ``pool``'s segments of the endpoint with segment prefix ``prefix``, or
    decide a cold start, which unlinks what the old manifest names (ours only) and the
    manifest (the module's invariants). ``directory``: :func:`pools_dir` if None."""
    path = manifest_path(prefix, pool.name, directory)
    manifest: Manifest | None = None
    try:
        manifest = read_manifest(path)
        return _readopt(pool, prefix, manifest, path)
    except FileNotFoundError:
        return ColdStart(f"pool {pool.name!r}: no manifest at {path}: starting empty", [])
    except RestoreRefused as exc:
        removed = [] if manifest is None or _running(manifest) else _unlink_named(prefix, manifest)
        remove_manifest(path)
        return ColdStart(f"pool {pool.name!r}: {exc}: starting empty", removed)


def _readopt(pool: PoolConfig, prefix: str, m: Manifest, path: Path) -> Readopted:
    """The segments of a trusted manifest, reopened; RestoreRefused naming the first
    check that fails (every region reopened before it closed, kept)."""
    _check_record(pool, m, path)
    changed = differences(m.settings, settings_of(pool))
    if changed:
        raise RestoreRefused(f"settings changed ({', '.join(changed)})")
    if pool.device != "cpu":
        raise RestoreRefused(f"device {pool.device}: only host pools are re-adopted")
    shard_bytes = pool.layout().total_bytes
    if len(m.segments) != pool.shards:
        raise RestoreRefused(f"manifest {path} names {len(m.segments)} segments, not {pool.shards}")
    for seg in _named(m):
        if not _of_prefix(prefix, seg.name):
            raise RestoreRefused(f"manifest {path} names segment {seg.name!r}, not of {prefix}")
    for seg in m.segments:
        if seg.size != shard_bytes:
            raise RestoreRefused(f"segment {seg.name} has {seg.size} bytes, not {shard_bytes}")
    regions: list[HostRegion] = []
    try:
        for seg in m.segments:
            regions.append(_reopen(seg, pool.group))
        index = None if m.index is None else _reopen(m.index, "")  # the daemon's alone: 0600
    except BaseException:
        for region in regions:
            region.close(unlink=False)
        raise
    host_tier, note = _reopen_host_tier(pool, m, path)
    return Readopted(m, regions, index, host_tier, note)


def _reopen_host_tier(pool: PoolConfig, m: Manifest, path: Path) -> tuple[HostRegion | None, str]:
    """The host tier's segment a trusted manifest names (of this prefix: checked), reopened,
    or None and why it starts empty ("" if the pool has none and the manifest names
    none); a segment refused is unlinked (ours only: ``unlink_own``)."""
    wanted, seg = host_tier_settings(pool), m.host_tier
    if seg is None:
        why = f"manifest {path} names no host tier segment" if wanted is not None else ""
        return None, why
    if wanted is None:
        why = f"host tier segment {seg.name}: the pool has no host tier now"
    elif changed := differences(seg.settings, wanted):
        why = f"host tier settings changed ({', '.join(changed)})"
    elif seg.size != (
        size := segment_bytes(int(wanted["capacity_pages"]), int(wanted["page_bytes"]))
    ):
        why = f"host tier segment {seg.name} has {seg.size} bytes, not {size}"
    else:
        try:
            return _reopen(Segment(seg.name, seg.size), ""), ""  # the daemon's alone: 0600
        except RestoreRefused as exc:
            why = f"host tier {exc}"
    unlink_own(seg.name)
    return None, why


def _check_record(pool: PoolConfig, m: Manifest, path: Path) -> None:
    """RestoreRefused unless the manifest is this user's record of this pool, written
    since this boot by a daemon that no longer runs (or by this process)."""
    if m.uid != os.getuid():
        raise RestoreRefused(f"manifest {path} names uid {m.uid}, not {os.getuid()}")
    if m.pool != pool.name:
        raise RestoreRefused(f"manifest {path} names pool {m.pool!r}")
    now = boot_id()
    if not now or m.boot_id != now:
        old, new = m.boot_id or "(none)", now or "(none)"
        raise RestoreRefused(f"manifest {path} is of another boot (boot id {old} -> {new})")
    if _running(m):
        raise RestoreRefused(f"its daemon, pid {m.pid}, is still running")


def _running(m: Manifest) -> bool:
    """Whether the manifest's daemon, not this process, still runs (its segments are
    its own, never ours to unlink; a reused pid only costs a cold start)."""
    return m.pid != os.getpid() and pid_alive(m.pid)


def _reopen(seg: Segment, group: str) -> HostRegion:
    """``HostRegion.reopen`` of one recorded segment, its refusals as RestoreRefused."""
    try:
        return HostRegion.reopen(seg.name, seg.size, group=group)
    except FileNotFoundError:
        raise RestoreRefused(f"segment {seg.name} is gone") from None
    except (PermissionError, ValueError) as exc:
        raise RestoreRefused(str(exc)) from None
    except KeyError:
        raise RestoreRefused(f"group {group!r} of segment {seg.name} does not exist") from None
    except OSError as exc:
        why = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise RestoreRefused(f"segment {seg.name} {why}") from None


def _unlink_named(prefix: str, m: Manifest) -> list[str]:
    """Unlink the segments a trusted manifest names: only names of ``prefix``, only ours."""
    return [seg.name for seg in _named(m) if _of_prefix(prefix, seg.name) and unlink_own(seg.name)]


def _named(m: Manifest) -> list[Segment | TierSegment]:
    """Every segment a manifest names: shards, index table, host tier."""
    return [*m.segments, *(seg for seg in (m.index, m.host_tier) if seg is not None)]


def _of_prefix(prefix: str, name: str) -> bool:
    """Whether ``name`` is ``<prefix>-<pid>-<12 hex>``, as ``HostRegion.create`` names one."""
    return re.fullmatch(rf"{re.escape(prefix)}-\d+-[0-9a-f]{{12}}", name) is not None
