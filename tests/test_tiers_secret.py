"""The deployment's tier secret: its file's rules, the keyed framing, the object names.

No store and no daemon: kvcore.tiers.secret and kvcore.tiers.keyed alone (the
tiers that use them: tests/test_tiers_remote_auth.py, tests/test_tiers_disk_trust.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcore.config import TierConfig
from kvcore.errors import BadRequest
from kvcore.prefix import PrefixKey
from kvcore.tiers import tier_key
from kvcore.tiers.codec import HEADER_BYTES, Checksummed
from kvcore.tiers.keyed import Keyed
from kvcore.tiers.remote import object_key, object_names
from kvcore.tiers.secret import Keyring, TierSecret, keyring_of, load_keyring, read_secret

FP = bytes(range(16))
KEY = tier_key(FP, PrefixKey(b"\x01" * 32))
OTHER = tier_key(FP, PrefixKey(b"\x02" * 32))
PAYLOAD = bytes(range(256)) * 4
OLD = TierSecret.of(b"o" * 32)
NEW = TierSecret.of(b"n" * 32)


def secret_file(directory: Path, name: str = "tier.secret", body: bytes = b"s" * 44) -> Path:
    path = directory / name
    path.write_bytes(body + b"\n")
    os.chmod(path, 0o600)
    return path


def entry(framing: Keyed | Checksummed, key: bytes = KEY) -> tuple[bytes, bytearray]:
    header, body = framing.seal(key, PAYLOAD)  # type: ignore[arg-type]
    return header, bytearray(body)


def test_a_secret_file_is_read_stripped(tmp_path: Path) -> None:
    assert read_secret(str(secret_file(tmp_path))) == b"s" * 44
    keyring = load_keyring(str(secret_file(tmp_path)))
    assert keyring is not None and keyring.previous is None and not keyring.encrypt
    assert load_keyring("") is None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_secret_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = secret_file(tmp_path)
    os.chmod(path, mode)
    with pytest.raises(BadRequest, match="readable by its owner only"):
        read_secret(str(path))


def test_a_short_missing_or_linked_secret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="fewer than 32"):
        read_secret(str(secret_file(tmp_path, body=b"short")))
    with pytest.raises(BadRequest):
        read_secret(str(tmp_path / "absent"))
    link = tmp_path / "link"
    link.symlink_to(secret_file(tmp_path, "real"))
    with pytest.raises(BadRequest):
        read_secret(str(link))
    with pytest.raises(BadRequest):
        read_secret(str(tmp_path))  # a directory
    with pytest.raises(BadRequest, match="need a secret_file"):
        load_keyring("", str(secret_file(tmp_path)))
    with pytest.raises(BadRequest, match="need a secret_file"):
        TierConfig(previous_secret_file="/x").validate("p", 16)


def test_keyed_entries_verify_only_under_their_key_and_secret() -> None:
    framing = Keyed(Keyring(NEW))
    header, body = entry(framing)
    assert len(header) == HEADER_BYTES and bytes(body) == PAYLOAD
    assert framing.unseal(KEY, header, memoryview(body), len(PAYLOAD))
    assert framing.header_fits(KEY, header, len(PAYLOAD))
    assert KEY[16:] not in header  # the header does not say which prefix it holds
    # the same entry moved to another key, under another secret, or tampered: a miss
    assert not framing.unseal(OTHER, header, memoryview(body), len(PAYLOAD))
    assert not Keyed(Keyring(OLD)).unseal(KEY, header, memoryview(body), len(PAYLOAD))
    body[7] ^= 1
    assert not framing.unseal(KEY, header, memoryview(body), len(PAYLOAD))
    # a well-framed unkeyed entry (what anyone can compute) is no keyed entry
    plain_header, plain_body = entry(Checksummed())
    assert not framing.header_fits(KEY, plain_header, len(PAYLOAD))
    assert not framing.unseal(KEY, plain_header, memoryview(plain_body), len(PAYLOAD))


def test_rotation_reads_the_previous_secret_and_writes_the_current() -> None:
    old_header, old_body = entry(Keyed(Keyring(OLD)))
    rotating = Keyed(Keyring(NEW, OLD))
    assert rotating.unseal(KEY, old_header, memoryview(old_body), len(PAYLOAD))
    new_header, new_body = entry(rotating)
    assert Keyed(Keyring(NEW)).unseal(KEY, new_header, memoryview(new_body), len(PAYLOAD))
    assert not Keyed(Keyring(OLD)).unseal(KEY, new_header, memoryview(new_body), len(PAYLOAD))


def test_encrypted_entries_hide_the_page() -> None:
    pytest.importorskip("cryptography")
    framing = Keyed(Keyring(NEW, encrypt=True))
    header, body = entry(framing)
    other_header, other_body = entry(framing)
    assert len(body) == len(PAYLOAD) and bytes(body) != PAYLOAD
    assert bytes(other_body) != bytes(body)  # a fresh key per entry
    assert framing.unseal(KEY, header, memoryview(body), len(PAYLOAD))
    assert bytes(body) == PAYLOAD
    assert not Keyed(Keyring(NEW)).unseal(KEY, other_header, memoryview(other_body), len(PAYLOAD))
    assert not framing.unseal(OTHER, other_header, memoryview(other_body), len(PAYLOAD))


def test_object_names_need_the_secret() -> None:
    """Names differ from the unkeyed ones, depend on the secret, and are stable."""
    plain = object_names(None, [KEY, OTHER])
    assert plain == [[object_key(KEY), object_key(OTHER)]]
    new = object_names(Keyring(NEW), [KEY, OTHER])[0]
    old = object_names(Keyring(OLD), [KEY, OTHER])[0]
    assert len({*new, *old, *plain[0]}) == 6
    assert all(KEY.hex() not in name and KEY[16:].hex() not in name for name in new)
    assert object_names(Keyring(NEW, OLD), [KEY, OTHER]) == [new, old]
    assert new == [TierSecret.of(b"n" * 32).object_name(k) for k in (KEY, OTHER)]


def test_a_tier_config_declares_its_keyring(tmp_path: Path) -> None:
    current, previous = secret_file(tmp_path), secret_file(tmp_path, "old", b"o" * 32)
    config = TierConfig(secret_file=str(current), previous_secret_file=str(previous), encrypt=True)
    keyring = keyring_of(config)
    assert keyring is not None and keyring.encrypt
    assert keyring.accepted() == (TierSecret.of(b"s" * 44), OLD)
    assert keyring_of(TierConfig()) is None
