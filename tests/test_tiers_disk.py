"""DiskTier against a dict model, across restarts and corruption; its directory rules."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from page_bytes import BYTE_LAYOUTS, byte_pages, same_bytes

from kvcore.errors import BadRequest
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.eviction import POLICIES
from kvcore.layout import KVLayout
from kvcore.prefix import PrefixKey
from kvcore.testing.eviction_model import MODELS
from kvcore.tiers import DiskTier, TierKey, layout_fingerprint, tier_key
from kvcore.tiers.codec import HEADER_BYTES

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32", num_pages=8
)
PAGE = LAYOUT.stored_page_shape  # [L, parts, page_size, H, D]: layer-major
FP = layout_fingerprint(LAYOUT)
KEYS = [tier_key(FP, PrefixKey(bytes([i]) * 32)) for i in range(10)]
ENTRY = HEADER_BYTES + LAYOUT.page_bytes


def page_of(key: TierKey, version: int) -> torch.Tensor:
    return torch.full(PAGE, float(key[-1] * 1000 + version))


def path_of(directory: Path, key: TierKey) -> Path:
    return directory / f"{key[:16].hex()}-{key[16:].hex()}.kv"


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte, keeping the file's mtime (its LRU position)."""
    info = path.stat()
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


class DiskModel(RuleBasedStateMachine):
    """The tier against a dict of its pages, their recency and the plain model of its
    eviction policy (kvcore/testing/eviction_model.py); a restart keeps the recency
    (mtimes) and starts the policy afresh from it."""

    eviction = DEFAULT_EVICTION

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp()) / "tier"
        self.capacity = 4
        self.tier = self.open(self.capacity * ENTRY + ENTRY // 2)
        self.pages: OrderedDict[TierKey, torch.Tensor] = OrderedDict()  # least recent first
        self.policy = MODELS[self.eviction](self.capacity)
        self.corrupt: set[TierKey] = set()  # held, but their payload was damaged
        self.version = 0

    def open(self, size: int) -> DiskTier:
        return DiskTier(LAYOUT, self.directory, size, eviction=self.eviction)

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.directory.parent)

    def touch(self, key: TierKey) -> None:
        self.pages.move_to_end(key)
        self.policy.pin([key])
        self.policy.hit([key])
        self.policy.release([(key, key)], True)

    @rule(picks=st.lists(st.sampled_from(KEYS), max_size=6))
    def put(self, picks: list[TierKey]) -> None:
        self.version += 1
        pages = (
            torch.stack([page_of(k, self.version) for k in picks])
            if picks
            else torch.empty(0, *PAGE)
        )
        evicted = self.tier.put_many(picks, pages)
        expected: list[TierKey] = []
        for key, page in zip(picks, pages, strict=True):
            if key in self.pages:
                self.touch(key)
                continue
            while len(self.pages) >= self.capacity:
                old = self.policy.evict()
                del self.pages[old]
                self.corrupt.discard(old)
                expected.append(old)
            self.pages[key] = page
            self.policy.release([(key, key)], True)
        assert evicted == expected

    @rule(picks=st.lists(st.sampled_from(KEYS), max_size=5))
    def get(self, picks: list[TierKey]) -> None:
        before = self.tier.stats()
        got = self.tier.get_many(picks)
        count = 0
        while (
            count < len(picks) and picks[count] in self.pages and picks[count] not in self.corrupt
        ):
            count += 1
        assert got.shape == (count, *PAGE)
        for row, key in enumerate(picks[:count]):
            assert torch.equal(got[row], self.pages[key])
            self.touch(key)
        broken = count < len(picks) and picks[count] in self.corrupt
        if broken:
            del self.pages[picks[count]]
            self.policy.drop(picks[count])
            self.corrupt.discard(picks[count])
        after = self.tier.stats()
        assert after.hits - before.hits == count
        assert after.misses - before.misses == len(picks) - count
        assert after.corrupt - before.corrupt == int(broken)

    @precondition(lambda self: bool(self.pages))
    @rule(data=st.data())
    def corrupt_payload(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pages)))
        if key in self.corrupt:
            return  # a second flip could undo the first
        offset = data.draw(st.integers(HEADER_BYTES, ENTRY - 1))
        flip_byte(path_of(self.directory, key), offset)
        self.corrupt.add(key)

    @rule()
    def restart(self) -> None:
        self.tier.close()
        self.tier = self.open(self.capacity * ENTRY)
        self.policy = MODELS[self.eviction](self.capacity)
        for key in self.pages:  # least recent first, as the files' mtimes say
            self.policy.release([(key, key)], True)

    @invariant()
    def agrees(self) -> None:
        self.tier.check_integrity()
        assert set(self.tier.keys()) == set(self.pages) == set(self.policy.evictable())
        assert self.tier.match(list(self.pages)) == len(self.pages)


for _name in POLICIES:  # one machine per eviction policy
    _machine = type(f"DiskModel_{_name}", (DiskModel,), {"eviction": _name})
    _machine.TestCase.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)
    globals()[f"TestDiskModel_{_name.replace('-', '_')}"] = _machine.TestCase


@pytest.fixture
def tier_dir(tmp_path: Path) -> Path:
    return tmp_path / "tier"


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(LAYOUT, id="float32"),
        *BYTE_LAYOUTS,
        *(pytest.param(dataclasses.replace(LAYOUT, order=o), id=o) for o in ("PLKTH", "PLHKT")),
        pytest.param(KVLayout(2, 2, 8, 4, "float8_e4m3fn", 8, order="LPHKT"), id="e4m3fn-LPHKT"),
    ],
)
def test_restart_serves_old_entries_after_verifying(tier_dir: Path, layout: KVLayout) -> None:
    """Every byte value comes back (fp8 NaN and infinity patterns, latent pages), in
    every order's stored form (page-major, head-outer)."""
    keys = [tier_key(layout_fingerprint(layout), PrefixKey(bytes([i]) * 32)) for i in range(3)]
    pages = byte_pages(layout, 3)
    size = 10 * (HEADER_BYTES + layout.page_bytes)
    with DiskTier(layout, tier_dir, size) as tier:
        tier.put_many(keys, pages)
    with DiskTier(layout, tier_dir, size) as tier:
        assert tier.match(keys) == 3
        assert same_bytes(tier.get_many(keys), pages)


@pytest.mark.parametrize(
    "written, asked",
    [
        pytest.param(
            KVLayout(2, 2, 8, 4, "float8_e4m3fn", 8),
            KVLayout(2, 2, 8, 4, "float8_e5m2", 8),
            id="fp8",
        ),
        pytest.param(
            KVLayout(2, 1, 16, 4, "bfloat16", 8, kind="latent"),
            KVLayout(2, 1, 8, 4, "bfloat16", 8),
            id="latent-vs-kv",
        ),
        pytest.param(
            KVLayout(2, 2, 8, 4, "float16", 8),
            KVLayout(2, 2, 8, 4, "float16", 8, order="PLKTH"),
            id="layer-vs-page-major",
        ),
        pytest.param(
            KVLayout(2, 2, 8, 4, "float16", 8, order="PLKTH"),
            KVLayout(2, 2, 8, 4, "float16", 8, order="PLHKT"),
            id="token-vs-head-outer",
        ),
    ],
)
def test_a_page_of_one_layout_is_a_miss_for_another_of_its_size(
    tier_dir: Path, written: KVLayout, asked: KVLayout
) -> None:
    """Same geometry and page bytes, another dtype, kind or order: never served across."""
    assert written.page_bytes == asked.page_bytes
    prefix = PrefixKey(bytes([9]) * 32)
    size = 4 * (HEADER_BYTES + written.page_bytes)
    with DiskTier(written, tier_dir, size) as tier:
        tier.put_many([tier_key(tier.fingerprint, prefix)], byte_pages(written, 1))
    with DiskTier(asked, tier_dir, size) as tier:
        key = [tier_key(tier.fingerprint, prefix)]
        assert tier.match(key) == 0 and len(tier.get_many(key)) == 0
        assert tier.stats().corrupt == 0


@pytest.mark.parametrize("damage", ["header", "truncate", "renamed", "symlink"])
def test_damaged_entries_are_misses(tier_dir: Path, damage: str) -> None:
    with DiskTier(LAYOUT, tier_dir, 10 * ENTRY) as tier:
        tier.put_many(KEYS[:2], torch.randn(2, *PAGE))
    victim = path_of(tier_dir, KEYS[0])
    if damage == "header":
        flip_byte(victim, 20)
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-1])
    elif damage == "renamed":  # another key's valid entry under this key's name
        shutil.copyfile(path_of(tier_dir, KEYS[1]), victim)
    else:
        victim.unlink()
        victim.symlink_to(path_of(tier_dir, KEYS[1]))
    with DiskTier(LAYOUT, tier_dir, 10 * ENTRY) as tier:
        assert tier.match(KEYS[:1]) == 0
        assert tier.get_many(KEYS[:1]).shape[0] == 0
        assert tier.stats().corrupt == 1
        assert not victim.exists() and not victim.is_symlink()
        tier.check_integrity()


def test_a_failed_read_is_an_empty_batch_that_pins_no_scratch(tier_dir: Path) -> None:
    """A held entry whose payload fails its checksum is a miss at read time; the batch
    of no pages is a fresh empty tensor, not a view of the scratch buffer the failed
    read filled (the disk and remote tiers once differed here: kvcore.tiers.transfer's
    pages_from_bytes is now their one conversion)."""
    with DiskTier(LAYOUT, tier_dir, 10 * ENTRY) as tier:
        tier.put_many(KEYS[:2], torch.randn(2, *PAGE))
        flip_byte(path_of(tier_dir, KEYS[0]), HEADER_BYTES + 5)
        assert tier.match(KEYS[:2]) == 2  # match reads no bytes
        pages = tier.get_many(KEYS[:2])
        assert pages.shape == (0, *PAGE) and pages.dtype == LAYOUT.torch_dtype()
        assert pages.untyped_storage().nbytes() == 0
        assert tier.stats().corrupt == 1 and tier.match(KEYS[1:2]) == 1
        tier.check_integrity()


def test_a_partial_read_holds_only_the_pages_read(tier_dir: Path) -> None:
    pages = torch.randn(3, *PAGE)
    with DiskTier(LAYOUT, tier_dir, 10 * ENTRY) as tier:
        tier.put_many(KEYS[:3], pages)
        flip_byte(path_of(tier_dir, KEYS[1]), HEADER_BYTES + 5)
        got = tier.get_many(KEYS[:3])
        assert torch.equal(got, pages[:1])
        assert got.untyped_storage().nbytes() == LAYOUT.page_bytes


def test_other_layouts_share_a_directory_apart(tier_dir: Path) -> None:
    wide = KVLayout(2, 1, 8, 2, "float32", 8)
    wide_keys = [tier_key(layout_fingerprint(wide), PrefixKey(bytes([i]) * 32)) for i in range(2)]
    with (
        DiskTier(LAYOUT, tier_dir, 10 * ENTRY) as narrow,
        DiskTier(wide, tier_dir, 1 << 20) as other,
    ):
        narrow.put_many(KEYS[:2], torch.randn(2, *PAGE))
        other.put_many(wide_keys, torch.randn(2, *wide.stored_page_shape))
        assert other.match([tier_key(other.fingerprint, PrefixKey(bytes([0]) * 32))]) == 1
        with pytest.raises(BadRequest):
            other.get_many(KEYS[:1])
    with DiskTier(LAYOUT, tier_dir, 10 * ENTRY) as narrow:
        assert narrow.keys() == KEYS[:2]
        assert narrow.stats().corrupt == 0


def test_directory_is_private(tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    with DiskTier(LAYOUT, directory, ENTRY) as tier:
        tier.put_many(KEYS[:1], torch.zeros(1, *PAGE))
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE(path_of(directory, KEYS[0]).stat().st_mode) == 0o600
        with pytest.raises(BadRequest):
            DiskTier(LAYOUT, directory, ENTRY)  # one tier per directory and layout
    os.chmod(directory, 0o755)
    with pytest.raises(BadRequest):
        DiskTier(LAYOUT, directory, ENTRY)
    os.chmod(directory, 0o700)
    link = tmp_path / "link"
    link.symlink_to(directory)
    with pytest.raises(BadRequest):
        DiskTier(LAYOUT, link, ENTRY)
    with pytest.raises(BadRequest):
        DiskTier(LAYOUT, directory, ENTRY - 1)


def test_a_shrunk_capacity_keeps_the_newest(tier_dir: Path) -> None:
    with DiskTier(LAYOUT, tier_dir, 5 * ENTRY) as tier:
        for key in KEYS[:5]:
            tier.put_many([key], torch.zeros(1, *PAGE))
    with DiskTier(LAYOUT, tier_dir, 2 * ENTRY) as tier:
        assert tier.keys() == KEYS[3:5]
        tier.check_integrity()
