"""DiskTier trusts only what it checked: the directory by descriptor, its parents,
and (with a secret) only entries MAC'd by a holder of the secret (issue 18, point 5)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.prefix import PrefixKey
from kvcore.tiers import DiskTier, TierKey, layout_fingerprint, tier_key
from kvcore.tiers.codec import HEADER_BYTES, Checksummed
from kvcore.tiers.keyed import Keyed
from kvcore.tiers.secret import Keyring, TierSecret
from kvcore.tiers.transfer import byte_view

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32", num_pages=8
)
PAGE = LAYOUT.stored_page_shape  # [L, parts, page_size, H, D]: layer-major
FP = layout_fingerprint(LAYOUT)
KEYS = [tier_key(FP, PrefixKey(bytes([i]) * 32)) for i in range(4)]
ENTRY = HEADER_BYTES + LAYOUT.page_bytes
KEYRING = Keyring(TierSecret.of(b"k" * 32))


def path_of(directory: Path, key: TierKey) -> Path:
    return directory / f"{key[:16].hex()}-{key[16:].hex()}.kv"


def plant(directory: Path, key: TierKey, page: torch.Tensor, framing: Keyed | Checksummed) -> None:
    """Write a well-framed entry of ``page`` under ``key``'s file, as an intruder would."""
    header, body = framing.seal(key, byte_view(page.contiguous()))
    path = path_of(directory, key)
    path.write_bytes(header + bytes(body))
    os.chmod(path, 0o600)


@pytest.fixture
def tier_dir(tmp_path: Path) -> Path:
    return tmp_path / "tier"


def test_a_planted_entry_is_a_miss_with_a_secret(tier_dir: Path) -> None:
    """Files framed without the secret (the unkeyed checksum anyone can compute, or a MAC
    under another secret) never answer: a counted corrupt miss, at start or at read."""
    forged = torch.full(PAGE, 66.0)
    with DiskTier(LAYOUT, tier_dir, 8 * ENTRY, keyring=KEYRING) as tier:
        tier.put_many(KEYS[:1], torch.ones(1, *PAGE))
        plant(tier_dir, KEYS[0], forged, Checksummed())  # over a held entry
        assert tier.get_many(KEYS[:1]).shape[0] == 0
        assert tier.stats().corrupt == 1
        tier.check_integrity()
    plant(tier_dir, KEYS[1], forged, Checksummed())
    plant(tier_dir, KEYS[2], forged, Keyed(Keyring(TierSecret.of(b"x" * 32))))
    with DiskTier(LAYOUT, tier_dir, 8 * ENTRY, keyring=KEYRING) as tier:
        assert tier.match(KEYS[1:2]) == 0 and tier.stats().corrupt == 1  # unkeyed: dropped
        assert tier.match(KEYS[2:3]) == 1  # its header fits; its MAC does not
        assert tier.get_many(KEYS[2:3]).shape[0] == 0
        assert tier.stats().corrupt == 2 and not path_of(tier_dir, KEYS[2]).exists()
        pages = torch.randn(2, *PAGE)
        tier.put_many(KEYS[:2], pages)
        assert torch.equal(tier.get_many(KEYS[:2]), pages)
    with DiskTier(LAYOUT, tier_dir, 8 * ENTRY, keyring=KEYRING) as tier:  # a restart keeps them
        assert torch.equal(tier.get_many(KEYS[:2]), pages)


def test_the_directory_opened_is_used_after_its_path_is_swapped(tmp_path: Path) -> None:
    original, aside, intruder = tmp_path / "tier", tmp_path / "aside", tmp_path / "intruder"
    intruder.mkdir(0o700)
    pages = torch.randn(2, *PAGE)
    with DiskTier(LAYOUT, original, 8 * ENTRY) as tier:
        tier.put_many(KEYS[:1], pages[:1])
        original.rename(aside)
        intruder.rename(original)
        tier.put_many(KEYS[1:2], pages[1:2])
        assert torch.equal(tier.get_many(KEYS[:2]), pages)
        tier.check_integrity()
        assert path_of(aside, KEYS[1]).exists()
        assert not any(original.iterdir())


@pytest.fixture
def swap_at_open() -> Iterator[list[tuple[Path, Path]]]:
    """While the list holds (path, replacement), the first ``open`` of that path (or of
    its last component, relative to a parent's descriptor) swaps the replacement in
    first: the race another user wins between a check by path and the use."""
    armed: list[tuple[Path, Path]] = []

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event != "open" or not armed or not isinstance(args[0], str):
            return
        path, replacement = armed[0]
        if args[0] in (str(path), path.name):
            armed.clear()
            path.rename(path.with_name("aside"))
            replacement.rename(path)

    sys.addaudithook(hook)  # cannot be removed: disarmed by clearing the list
    yield armed
    armed.clear()


def test_a_directory_swapped_during_the_check_is_refused(
    tmp_path: Path, swap_at_open: list[tuple[Path, Path]]
) -> None:
    directory, intruder = tmp_path / "tier", tmp_path / "intruder"
    directory.mkdir(0o700)
    intruder.mkdir()
    os.chmod(intruder, 0o777)  # anyone may write it
    swap_at_open.append((directory, intruder))
    try:
        tier = DiskTier(LAYOUT, directory, 8 * ENTRY)
    except BadRequest as exc:
        assert "mode 0700" in str(exc)
    else:  # accepted: then it must not be the intruder's directory it writes into
        tier.put_many(KEYS[:1], torch.zeros(1, *PAGE))
        tier.close()
        assert not path_of(directory, KEYS[0]).exists(), "the tier wrote into the swapped path"
    assert not swap_at_open, "the tier never opened its directory"


def test_a_parent_others_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(BadRequest, match="writable by others"):
        DiskTier(LAYOUT, shared / "tier", ENTRY)
    with pytest.raises(BadRequest, match="writable by others"):
        DiskTier(LAYOUT, shared / "deeper" / "tier", ENTRY)  # any parent, not only the nearest
    os.chmod(shared, 0o1777)  # sticky, like /tmp: nobody renames what is not theirs
    with DiskTier(LAYOUT, shared / "tier", ENTRY) as tier:
        tier.put_many(KEYS[:1], torch.zeros(1, *PAGE))
    if os.getuid() == 0:
        os.chown(shared, 65534, -1)  # a parent another user owns could be replaced by them
        with pytest.raises(BadRequest, match="owned by uid 65534"):
            DiskTier(LAYOUT, shared / "tier", ENTRY)
