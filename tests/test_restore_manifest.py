"""Issue 40, the segment and manifest layer: segments that outlive the daemon, and the
decision to re-adopt them or start a pool empty (kvcore.daemon.restore).

Real segments in /dev/shm and real files, no mocks. Every segment a test makes is
named with the test's own prefix and unlinked at teardown (the ``prefix`` fixture),
whatever the test did. Tests that give a file or segment to another uid need root.

Over 400 lines on purpose: every check of the manifest layer (segments, manifests, the
re-adopt decision, the host tier's segment) against real files, with one set of fixtures.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcore_ipc.shm import SHM_DIR, HostRegion, sweep

from kvcore.config import PoolConfig
from kvcore.daemon import restore
from kvcore.daemon.restore import (
    ColdStart,
    Manifest,
    Readopted,
    differences,
    manifest_for,
    manifest_path,
    read_manifest,
    reopen_pool,
    settings_of,
    write_manifest,
)
from kvcore.errors import RestoreRefused

OTHER_UID = 1001
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="gives a file to another uid: root")


def _pool(**changes: object) -> PoolConfig:
    """A host pool of 1 KiB a shard (4 pages of 1 layer, 1 head of 8 float32, 4 tokens)."""
    fields: dict[str, object] = {
        "name": "p",
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 8,
        "page_size": 4,
        "dtype": "float32",
        "num_pages": 4,
    }
    fields.update(changes)
    return msgspec.convert(fields, PoolConfig)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A segment prefix of this test alone; every segment of it is unlinked afterwards."""
    name = f"kvcore-{secrets.token_hex(6)}"
    try:
        yield name
    finally:
        for entry in os.listdir(SHM_DIR):
            if entry.startswith(f"{name}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, entry))


@pytest.fixture
def pools(tmp_path: Path) -> Path:
    """The manifests' directory (made 0700 by write_manifest)."""
    return tmp_path / "pools"


def _exists(name: str) -> bool:
    return os.path.lexists(os.path.join(SHM_DIR, name))


def _serve(pool: PoolConfig, prefix: str, pools: Path, fill: bytes = b"page") -> list[str]:
    """What a daemon that is then SIGKILLed leaves: untracked segments (one per shard,
    each starting with ``fill``) and the pool's manifest. Their names."""
    size = pool.layout().total_bytes
    regions = [HostRegion.create(size, prefix, tracked=False) for _ in range(pool.shards)]
    try:
        for region in regions:
            region.buffer()[: len(fill)] = fill
            if pool.group:
                region.share_with_group(pool.group)
        write_manifest(manifest_path(prefix, pool.name, pools), manifest_for(pool, regions, 7))
    finally:
        for region in regions:
            region.close(unlink=False)
    return [region.name for region in regions]


def _rewrite(prefix: str, pool: PoolConfig, pools: Path, **fields: object) -> None:
    """Replace fields of the pool's manifest, written back as the daemon writes one."""
    path = manifest_path(prefix, pool.name, pools)
    write_manifest(path, msgspec.structs.replace(read_manifest(path), **fields))


def _cold(result: Readopted | ColdStart) -> ColdStart:
    if isinstance(result, Readopted):
        result.close(unlink=False)
        raise AssertionError(f"re-adopted {result.names}")
    return result


# --- the resource tracker: why segments that must outlive the daemon are untracked ------

_CHILD = textwrap.dedent(
    """
    import sys, time
    from kvcore_ipc.shm import HostRegion

    untracked = HostRegion.create(4096, sys.argv[1], tracked=False)
    tracked = HostRegion.create(4096, sys.argv[1])
    kept = HostRegion.create(4096, sys.argv[1])  # tracked, then closed and kept
    for region, fill in ((untracked, b"live"), (tracked, b"lost"), (kept, b"kept")):
        region.buffer()[:4] = fill
    kept.close(unlink=False)
    print(untracked.name, tracked.name, kept.name, flush=True)
    time.sleep(600)
    """
)


def test_an_untracked_segment_outlives_a_sigkill_of_its_creator_and_a_tracked_one_does_not(
    prefix: str,
) -> None:
    """The daemon alone SIGKILLed (not its process group): its resource tracker lives on,
    sees the pipe close and unlinks every segment still registered, within about a
    second. An untracked segment, or a tracked one closed with unlink=False, stays with
    its bytes."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, prefix],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        untracked, tracked, kept = child.stdout.readline().split()
        assert all(map(_exists, (untracked, tracked, kept)))
        child.send_signal(signal.SIGKILL)  # the child alone: its tracker survives it
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        if child.stdout is not None:
            child.stdout.close()
    deadline = time.monotonic() + 30
    while _exists(tracked) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _exists(tracked), "the tracker did not unlink a tracked segment: proves nothing"
    for name, fill in ((untracked, b"live"), (kept, b"kept")):
        region = HostRegion.reopen(name, 4096)
        try:
            assert bytes(region.buffer()[:4]) == fill
        finally:
            region.close(unlink=False)
    assert sorted(sweep(prefix, keep={untracked})) == [kept]  # its creator is dead
    assert _exists(untracked)


@pytest.mark.parametrize("tracked", [True, False])
@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_a_new_segment_is_0600_whatever_the_umask(prefix: str, tracked: bool, umask: int) -> None:
    old = os.umask(umask)
    try:
        region = HostRegion.create(100, prefix, tracked=tracked)
    finally:
        os.umask(old)
    try:
        st = os.stat(os.path.join(SHM_DIR, region.name))
        assert (st.st_mode & 0o777, st.st_uid, st.st_size) == (0o600, os.getuid(), 100)
        assert region.owner and region.tracked == tracked
    finally:
        region.close()
    assert not _exists(region.name)


def test_sweep_survives_names_no_process_can_have(prefix: str) -> None:
    """Anyone may name a file in /dev/shm: a pid over the kernel's range is no process
    (it used to overflow kill()), and 0 is not this process group."""
    names = [f"{prefix}-99999999999999999999-0", f"{prefix}-0-0"]
    for name in names:
        Path(SHM_DIR, name).touch(0o600)
    assert sorted(sweep(prefix)) == sorted(names)


# --- reopen ------------------------------------------------------------------------------


def test_reopen_maps_the_same_bytes_and_close_keeps_or_unlinks(prefix: str) -> None:
    first = HostRegion.create(1000, prefix, tracked=False)
    first.buffer()[:5] = b"bytes"
    first.close(unlink=False)
    again = HostRegion.reopen(first.name, 1000)
    assert again.owner and not again.tracked
    assert bytes(again.buffer()[:5]) == b"bytes"
    again.close()  # the default: unlink
    assert not _exists(first.name)
    with pytest.raises(FileNotFoundError):
        HostRegion.reopen(first.name, 1000)


def test_reopen_refuses_another_size_mode_group_or_a_symlink(prefix: str) -> None:
    region = HostRegion.create(1000, prefix, tracked=False)
    region.close(unlink=False)
    path = os.path.join(SHM_DIR, region.name)
    with pytest.raises(ValueError, match=rf"segment {region.name} has 1000 bytes, not 2000"):
        HostRegion.reopen(region.name, 2000)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match=rf"segment {region.name} has mode 0644, not 0600"):
        HostRegion.reopen(region.name, 1000)
    os.chmod(path, 0o600)
    with pytest.raises(PermissionError, match="mode 0600, not 0660"):
        HostRegion.reopen(region.name, 1000, group=str(os.getgid()))
    link = f"{prefix}-1-link"
    os.symlink(path, os.path.join(SHM_DIR, link))
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        HostRegion.reopen(link, 1000)
    HostRegion.reopen(region.name, 1000).close()


def test_a_group_segment_is_reopened_0660_of_its_group(prefix: str) -> None:
    group = str(os.getgid())
    region = HostRegion.create(64, prefix, tracked=False)
    region.share_with_group(group)
    region.close(unlink=False)
    st = os.stat(os.path.join(SHM_DIR, region.name))
    assert (st.st_mode & 0o777, st.st_gid) == (0o660, os.getgid())
    HostRegion.reopen(region.name, 64, group=group).close()


@needs_root
def test_reopen_refuses_a_segment_of_another_uid(prefix: str) -> None:
    region = HostRegion.create(64, prefix, tracked=False)
    region.close(unlink=False)
    os.chown(os.path.join(SHM_DIR, region.name), OTHER_UID, -1)
    with pytest.raises(PermissionError, match=f"belongs to uid {OTHER_UID}, not 0"):
        HostRegion.reopen(region.name, 64)


# --- the manifest ------------------------------------------------------------------------


def test_a_manifest_round_trips_0600_in_a_0700_directory(prefix: str, pools: Path) -> None:
    pool = _pool(shards=2)
    names = _serve(pool, prefix, pools)
    path = manifest_path(prefix, "p", pools)
    got = read_manifest(path)
    assert got.pool == "p" and got.uid == os.getuid() and got.pid == os.getpid()
    assert got.epoch == 7 and got.boot_id == restore.boot_id() != ""
    assert [s.name for s in got.segments] == names and got.settings == settings_of(pool)
    assert [s.size for s in got.segments] == [pool.layout().total_bytes] * 2
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(pools).st_mode & 0o777 == 0o700
    assert os.listdir(pools) == [path.name]  # no temporary file left
    write_manifest(path, got)
    assert read_manifest(path) == got and os.listdir(pools) == [path.name]


def test_the_manifest_lives_in_the_runtime_directory(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    path = manifest_path(prefix, "p")
    assert path.parent == tmp_path / "run" / "kvcore" / "pools"
    assert path.name.startswith(f"{prefix}-") and path.name.endswith(".manifest")
    assert path != manifest_path(prefix, "q") and path != manifest_path(f"{prefix}0", "p")
    _serve(_pool(), prefix, path.parent)
    result = reopen_pool(_pool(), prefix)
    assert isinstance(result, Readopted)
    result.close(unlink=True)


def _refused(path: Path, match: str) -> None:
    with pytest.raises(RestoreRefused, match=match):
        read_manifest(path)


def test_a_manifest_is_refused_unless_a_private_regular_file(prefix: str, pools: Path) -> None:
    _serve(_pool(), prefix, pools)
    path = manifest_path(prefix, "p", pools)
    good = path.read_bytes()
    os.chmod(path, 0o644)
    _refused(path, "has mode 0644: others may have written it")
    os.chmod(path, 0o600)
    target = pools / "elsewhere"
    os.rename(path, target)
    path.symlink_to(target)
    _refused(path, "is a symlink")
    path.unlink()
    os.mkfifo(path, 0o600)
    _refused(path, "is not a regular file")  # and never waits on the FIFO
    path.unlink()
    path.mkdir(0o700)
    _refused(path, "is not a regular file")
    path.rmdir()
    path.write_bytes(good)
    os.chmod(path, 0o600)
    os.chmod(pools, 0o755)
    _refused(path, "has mode 0755, not 0700")
    os.chmod(pools, 0o700)
    read_manifest(path)


def test_a_manifest_of_garbage_or_another_version_is_refused(prefix: str, pools: Path) -> None:
    _serve(_pool(), prefix, pools)
    path = manifest_path(prefix, "p", pools)
    good = msgspec.json.decode(path.read_bytes())
    path.write_bytes(b"\x00garbage")
    _refused(path, "is not a manifest")
    path.write_bytes(msgspec.json.encode({**good, "version": 2}))
    _refused(path, "has version 2, not 1")
    path.write_bytes(msgspec.json.encode({**good, "pid": 0}))
    _refused(path, "is not a manifest")
    path.write_bytes(b" " * (restore.MAX_MANIFEST_BYTES + 1))
    _refused(path, "is over 65536 bytes")
    result = _cold(reopen_pool(_pool(), prefix, pools))
    assert result.reason.startswith("pool 'p': manifest ") and "over 65536" in result.reason
    assert not path.exists()


@needs_root
def test_a_manifest_of_another_uid_is_refused(prefix: str, pools: Path) -> None:
    _serve(_pool(), prefix, pools)
    path = manifest_path(prefix, "p", pools)
    os.chown(path, OTHER_UID, -1)
    _refused(path, f"belongs to uid {OTHER_UID}, not 0")


_BINARY = st.binary(max_size=300)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_BINARY | _JSON.map(msgspec.json.encode))
def test_garbage_manifests_are_refused_never_crash(pools: Path, raw: bytes) -> None:
    pools.mkdir(0o700, exist_ok=True)
    path = pools / "garbage.manifest"
    path.write_bytes(raw)
    os.chmod(path, 0o600)
    with pytest.raises(RestoreRefused):
        read_manifest(path)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(Manifest.__struct_fields__), value=_JSON)
def test_a_manifest_with_any_field_replaced_is_a_decision_never_a_crash(
    pools: Path, field: str, value: object
) -> None:
    """Whatever one field holds, reopen_pool decides: re-adopted (the field is harmless,
    an epoch) or a cold start that removes the manifest."""
    prefix = f"kvcore-{secrets.token_hex(6)}"
    try:
        names = _serve(_pool(), prefix, pools)
        path = manifest_path(prefix, "p", pools)
        path.write_bytes(
            msgspec.json.encode({**msgspec.json.decode(path.read_bytes()), field: value})
        )
        result = reopen_pool(_pool(), prefix, pools)
        if isinstance(result, Readopted):
            assert result.names == names
            result.close(unlink=True)
        else:
            assert result.reason.startswith("pool 'p': ") and not path.exists()
    finally:
        for name in os.listdir(SHM_DIR):
            if name.startswith(f"{prefix}-"):
                os.unlink(os.path.join(SHM_DIR, name))


# --- settings --------------------------------------------------------------------------

_KEYS = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
_SETTINGS = st.dictionaries(_KEYS, st.text(max_size=6) | st.integers() | st.booleans(), max_size=6)


@given(old=_SETTINGS, new=_SETTINGS)
def test_differences_names_exactly_the_changed_fields(
    old: dict[str, str | int | bool], new: dict[str, str | int | bool]
) -> None:
    changed = {
        key
        for key in old.keys() | new.keys()
        if key not in old
        or key not in new
        or (type(old[key]), old[key]) != (type(new[key]), new[key])
    }
    named = [line.split(" ", 1)[0] for line in differences(old, new)]
    assert sorted(named) == sorted(changed)
    assert differences(old, old) == [] == differences(new, dict(new))


def test_differences_reads_as_old_to_new() -> None:
    old = {"num_pages": 4096, "order": "PLKTH", "group": "", "gone": 1}
    new = {"num_pages": 8192, "order": "PLKTH", "group": "kv", "flag": True}
    assert differences(old, new) == [
        "num_pages 4096 -> 8192",
        "group '' -> kv",
        "flag (none) -> True",
        "gone 1 -> (none)",
    ]


CHANGES = [
    ("num_layers", 2),
    ("num_kv_heads", 2),
    ("head_dim", 16),
    ("page_size", 8),
    ("dtype", "bfloat16"),
    ("kind", "latent"),
    ("order", "LPKTH"),
    ("num_pages", 8),
    ("shards", 2),
    ("group", str(os.getgid())),
    ("device", "cuda:0"),
]


@pytest.mark.parametrize(("field", "value"), CHANGES, ids=[c[0] for c in CHANGES])
def test_each_changed_setting_is_named_and_the_old_segments_go(
    prefix: str, pools: Path, field: str, value: object
) -> None:
    old = _pool()
    (name,) = _serve(old, prefix, pools)
    before = settings_of(old)[field]
    shown = repr(before) if before == "" else before
    result = _cold(reopen_pool(_pool(**{field: value}), prefix, pools))
    assert result.reason.startswith("pool 'p': settings changed (")
    assert f"{field} {shown} -> {value}" in result.reason
    assert result.reason.endswith(": starting empty")
    assert result.removed == [name] and not _exists(name)
    assert not manifest_path(prefix, "p", pools).exists()


def test_the_settings_are_those_that_fix_a_page() -> None:
    got = settings_of(_pool())
    assert got.keys() >= {"device", "shards", "group", "layout_fingerprint", "hash_domain"}
    assert got.keys() >= _pool().layout().to_dict().keys() | {"byte_order", "shard_bytes"}
    assert settings_of(_pool(eviction="lru", session_max_pages=3)) == got  # not compared


# --- the decision ------------------------------------------------------------------------


def test_a_pool_as_it_was_is_readopted_with_its_bytes(prefix: str, pools: Path) -> None:
    pool = _pool(shards=2, group=str(os.getgid()))
    names = _serve(pool, prefix, pools, fill=b"kept bytes")
    index = HostRegion.create(512, prefix, tracked=False)
    regions = [HostRegion.reopen(n, pool.layout().total_bytes, group=pool.group) for n in names]
    path = manifest_path(prefix, "p", pools)
    write_manifest(path, manifest_for(pool, regions, 9, index))
    for region in [*regions, index]:
        region.close(unlink=False)
    result = reopen_pool(pool, prefix, pools)
    assert isinstance(result, Readopted), result
    try:
        assert [r.name for r in result.regions] == names and result.manifest.epoch == 9
        assert result.index is not None and result.index.size == 512
        assert result.names == [*names, index.name]
        assert all(bytes(r.buffer()[:10]) == b"kept bytes" for r in result.regions)
        assert sweep(prefix, keep=result.names) == []
    finally:
        result.close(unlink=False)
    assert all(map(_exists, result.names)) and path.exists()


def test_no_manifest_is_a_cold_start_that_removes_nothing(prefix: str, pools: Path) -> None:
    stray = HostRegion.create(64, prefix, tracked=False)
    stray.close(unlink=False)
    result = _cold(reopen_pool(_pool(), prefix, pools))
    assert result.reason == (
        f"pool 'p': no manifest at {manifest_path(prefix, 'p', pools)}: starting empty"
    )
    assert result.removed == [] and _exists(stray.name)


def test_another_boot_is_a_cold_start(prefix: str, pools: Path) -> None:
    (name,) = _serve(_pool(), prefix, pools)
    _rewrite(prefix, _pool(), pools, boot_id="00000000-0000-0000-0000-000000000000")
    result = _cold(reopen_pool(_pool(), prefix, pools))
    assert "is of another boot (boot id 00000000-0000-0000-0000-000000000000 -> " in result.reason
    assert result.removed == [name] and not _exists(name)


def test_a_missing_wrong_size_or_wrong_mode_segment_is_a_cold_start(
    prefix: str, pools: Path
) -> None:
    pool = _pool(shards=2)
    for damage, why in [
        (lambda p: os.unlink(p), "is gone"),
        (lambda p: os.truncate(p, 10), "has 10 bytes, not 1024"),
        (lambda p: os.chmod(p, 0o604), "has mode 0604, not 0600"),
    ]:
        first, second = _serve(pool, prefix, pools)
        damage(os.path.join(SHM_DIR, second))
        result = _cold(reopen_pool(pool, prefix, pools))
        assert result.reason == f"pool 'p': segment {second} {why}: starting empty"
        assert not _exists(first) and not _exists(second)  # both ours: both go


def test_a_running_daemons_segments_are_never_taken(prefix: str, pools: Path) -> None:
    (name,) = _serve(_pool(), prefix, pools)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _rewrite(prefix, _pool(), pools, pid=other.pid)
        result = _cold(reopen_pool(_pool(), prefix, pools))
    finally:
        other.kill()
        other.wait(30)
    assert f"its daemon, pid {other.pid}, is still running" in result.reason
    assert result.removed == [] and _exists(name)


def test_names_outside_the_prefix_are_refused_and_left(prefix: str, pools: Path) -> None:
    pool = _pool()
    (name,) = _serve(pool, prefix, pools)
    foreign = HostRegion.create(pool.layout().total_bytes, f"{prefix}x", tracked=False)
    try:
        foreign.close(unlink=False)
        segment = restore.Segment(foreign.name, foreign.size)
        _rewrite(prefix, pool, pools, segments=(segment,))
        result = _cold(reopen_pool(pool, prefix, pools))
        assert f"names segment {foreign.name!r}, not of {prefix}" in result.reason
        assert result.removed == [] and _exists(foreign.name) and _exists(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, foreign.name))


@needs_root
def test_a_cold_start_removes_only_our_own_segments(prefix: str, pools: Path) -> None:
    pool = _pool(shards=2)
    ours, theirs = _serve(pool, prefix, pools)
    os.chown(os.path.join(SHM_DIR, theirs), OTHER_UID, -1)
    stray = HostRegion.create(64, prefix, tracked=False)  # named by no manifest: sweep's
    stray.close(unlink=False)
    result = _cold(reopen_pool(pool, prefix, pools))
    assert result.reason == (
        f"pool 'p': segment {theirs} belongs to uid {OTHER_UID}, not 0: starting empty"
    )
    assert result.removed == [ours] and not _exists(ours)
    assert _exists(theirs) and _exists(stray.name)
    assert not manifest_path(prefix, "p", pools).exists()


# --- a tiered pool's host tier segment (kvcore.tiers.host_table) -------------------------


def _tiered(host_pages: int, **changes: object) -> PoolConfig:
    """:func:`_pool` with a host tier of ``host_pages`` pages (256 bytes a page)."""
    return _pool(tiers={"host": host_pages * 256}, **changes)


def _serve_tiered(pool: PoolConfig, prefix: str, pools: Path) -> tuple[list[str], str]:
    """:func:`_serve`, and a host tier segment named in the manifest: (shards, host tier)."""
    from kvcore.tiers.host_table import segment_bytes

    names = _serve(pool, prefix, pools)
    settings = restore.host_tier_settings(pool)
    assert settings is not None
    size = segment_bytes(int(settings["capacity_pages"]), int(settings["page_bytes"]))
    host = HostRegion.create(size, prefix, tracked=False)
    regions = [HostRegion.reopen(n, pool.layout().total_bytes) for n in names]
    write_manifest(manifest_path(prefix, "p", pools), manifest_for(pool, regions, 8, None, host))
    for region in [*regions, host]:
        region.close(unlink=False)
    return names, host.name


def test_a_host_tier_segment_is_readopted_with_its_pool(prefix: str, pools: Path) -> None:
    pool = _tiered(4)
    names, host = _serve_tiered(pool, prefix, pools)
    manifest = read_manifest(manifest_path(prefix, "p", pools))
    assert manifest.host_tier is not None and manifest.host_tier.settings["capacity_pages"] == 4
    result = reopen_pool(pool, prefix, pools)
    assert isinstance(result, Readopted), result
    try:
        assert result.host_tier is not None and result.host_tier.name == host
        assert result.host_note == "" and result.names == [*names, host]
    finally:
        result.close(unlink=False)


def test_a_changed_host_tier_capacity_starts_the_tier_alone_empty(prefix: str, pools: Path) -> None:
    names, host = _serve_tiered(_tiered(4), prefix, pools)
    result = reopen_pool(_tiered(8), prefix, pools)  # the pool's own settings are equal
    assert isinstance(result, Readopted), result
    try:
        assert result.host_tier is None and not _exists(host)
        assert result.host_note == "host tier settings changed (capacity_pages 4 -> 8)"
        assert all(map(_exists, names))
    finally:
        result.close(unlink=False)


def test_a_manifest_without_a_host_tier_is_read_and_names_why(prefix: str, pools: Path) -> None:
    """A manifest of the shape before host tiers were kept: read, the pool re-adopted,
    the host tier started empty with the reason."""
    _serve(_pool(), prefix, pools)
    path = manifest_path(prefix, "p", pools)
    raw = msgspec.json.decode(path.read_bytes())
    raw.pop("host_tier", None)
    path.write_bytes(msgspec.json.encode(raw))
    result = reopen_pool(_tiered(4), prefix, pools)
    assert isinstance(result, Readopted), result
    try:
        assert result.host_tier is None and "names no host tier segment" in result.host_note
    finally:
        result.close(unlink=False)


def test_a_refused_manifest_unlinks_the_host_tier_too(prefix: str, pools: Path) -> None:
    names, host = _serve_tiered(_tiered(4), prefix, pools)
    _cold(reopen_pool(_tiered(4, num_pages=8), prefix, pools))
    assert not any(map(_exists, [*names, host]))


def test_a_host_tier_entry_of_the_wrong_type_is_refused_cleanly(prefix: str, pools: Path) -> None:
    _serve_tiered(_tiered(4), prefix, pools)
    path = manifest_path(prefix, "p", pools)
    raw = msgspec.json.decode(path.read_bytes())
    raw["host_tier"] = "kvcore-x"
    path.write_bytes(msgspec.json.encode(raw))
    assert "is not a manifest" in _cold(reopen_pool(_tiered(4), prefix, pools)).reason
