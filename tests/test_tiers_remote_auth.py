"""RemoteTier with the deployment's secret, against a real Mooncake master on loopback.

Every client of a master may put, upsert or list any object (issue 18, point 4).
Here a peer without the secret is a plain store client of the same master (the
test knows the names it attacks, as a peer listing the HTTP port would): what it
writes is a counted corrupt miss, never K/V, and the names it could compute hold
nothing. Skipped with a reason where Mooncake is missing (tests/mooncake_helpers.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from mooncake_helpers import SKIP_REASON, Master, master_binary, start_master

from kvcore.layout import KVLayout
from kvcore.prefix import KeySpace, chain_keys, encode_tokens, root_key
from kvcore.tiers import RemoteConfig, RemoteTier, TierKey, layout_fingerprint, tier_keys
from kvcore.tiers.codec import HEADER_BYTES, Checksummed
from kvcore.tiers.keyed import Keyed
from kvcore.tiers.remote import object_key, object_names
from kvcore.tiers.secret import Keyring, TierSecret
from kvcore.tiers.transfer import byte_view

pytestmark = [
    pytest.mark.skipif(master_binary() is None, reason=SKIP_REASON),
    pytest.mark.timeout(120),
]

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16", num_pages=16
)
PAGE = LAYOUT.stored_page_shape  # [L, parts, page_size, H, D]: layer-major
READY_S = 30.0
SECRET = TierSecret.of(b"deployment secret, 32 bytes long")
NEXT = TierSecret.of(b"the next secret, also 32 bytes..")


def chain(namespace: str, pages: int = 4) -> list[TierKey]:
    tokens = encode_tokens(list(range(pages * LAYOUT.page_size)))
    keys = list(chain_keys(root_key(KeySpace(namespace)), tokens, LAYOUT.page_size))
    return tier_keys(layout_fingerprint(LAYOUT), keys)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    running = start_master(tmp_path_factory.mktemp("mooncake"))
    yield running
    running.stop()


@pytest.fixture
def tiers(master: Master) -> Iterator[list[RemoteTier]]:
    opened: list[RemoteTier] = []
    yield opened
    for tier in opened:
        tier.close()


def join(master: Master, opened: list[RemoteTier], keyring: Keyring | None) -> RemoteTier:
    tier = RemoteTier(
        LAYOUT, RemoteConfig(master.address, master.metadata_server, timeout_s=5.0), keyring=keyring
    )
    opened.append(tier)
    assert tier.wait_ready(READY_S), "could not join the store"
    return tier


def frame(framing: Keyed | Checksummed, key: TierKey, page: torch.Tensor) -> bytes:
    header, body = framing.seal(key, byte_view(page.contiguous()))
    return header + bytes(body)


def test_a_forged_page_under_the_name_read_is_a_counted_miss(
    master: Master, tiers: list[RemoteTier]
) -> None:
    """A peer puts well-framed pages (the unkeyed framing, or a MAC under another secret)
    under the very names a daemon with the secret reads: misses, counted corrupt."""
    daemon = join(master, tiers, Keyring(SECRET))
    peer = join(master, tiers, None)
    keys = chain("forged")
    names = object_names(Keyring(SECRET), keys)[0]
    forged = torch.full(PAGE, 7.0, dtype=torch.float16)
    assert peer._store.put(names[0], frame(Checksummed(), keys[0], forged)) == 0
    other = Keyed(Keyring(TierSecret.of(b"a guess that is not the secret!!")))
    assert peer._store.put(names[1], frame(other, keys[1], forged)) == 0
    assert daemon.match(keys[:1]) == 1  # the object exists; it is still no hit
    assert daemon.get_many(keys[:1]).shape[0] == 0
    assert daemon.get_many(keys[1:2]).shape[0] == 0
    stats = daemon.stats()
    assert (stats.hits, stats.misses, stats.corrupt) == (0, 2, 2)


def test_an_overwrite_by_a_peer_without_the_secret_is_detected(
    master: Master, tiers: list[RemoteTier]
) -> None:
    """Mooncake's upsert replaces a published object: the replacement (the published
    header over other bytes, or another key's valid object) fails the MAC."""
    writer, reader = join(master, tiers, Keyring(SECRET)), join(master, tiers, Keyring(SECRET))
    peer = join(master, tiers, None)
    keys = chain("overwritten")
    pages = torch.randn(len(keys), *PAGE).to(torch.float16)
    writer.put_many(keys, pages)
    assert writer.flush(READY_S)
    assert torch.equal(reader.get_many(keys), pages)
    names = object_names(Keyring(SECRET), keys)[0]
    published = bytearray(peer._store.get(names[1]))
    published[HEADER_BYTES:] = bytes(byte_view(torch.zeros(PAGE, dtype=torch.float16)))
    assert peer._store.upsert(names[1], bytes(published)) == 0
    assert peer._store.upsert(names[2], peer._store.get(names[0])) == 0  # a valid page, moved
    got = reader.get_many(keys)
    assert torch.equal(got, pages[:1])
    assert reader.get_many(keys[2:3]).shape[0] == 0
    assert reader.stats().corrupt == 2


def test_object_names_are_not_derivable_without_the_secret(
    master: Master, tiers: list[RemoteTier]
) -> None:
    """What a daemon with the secret publishes is found under no name computable
    without it (the unkeyed names, another secret's names): nothing to enumerate by
    guessing prompts, and a daemon without the secret reads nothing of it."""
    writer = join(master, tiers, Keyring(SECRET))
    keys = chain("hidden")
    writer.put_many(keys, torch.ones(len(keys), *PAGE, dtype=torch.float16))
    assert writer.flush(READY_S)
    peer = join(master, tiers, None)
    assert list(peer._store.batch_is_exist([object_key(k) for k in keys])) == [0] * len(keys)
    assert peer.match(keys) == 0
    assert join(master, tiers, Keyring(NEXT)).match(keys) == 0
    assert writer.match(keys) == len(keys)
    assert list(peer._store.batch_is_exist(object_names(Keyring(SECRET), keys)[0])) == [1] * 4


def test_rotation_reads_pages_of_the_previous_secret(
    master: Master, tiers: list[RemoteTier]
) -> None:
    """current = NEXT, previous = SECRET: pages written under either are hits, in one
    chain; new writes go under NEXT only."""
    keys = chain("rotation")
    pages = torch.randn(len(keys), *PAGE).to(torch.float16)
    before = join(master, tiers, Keyring(SECRET))
    before.put_many(keys[:2], pages[:2])
    assert before.flush(READY_S)
    rotating = join(master, tiers, Keyring(NEXT, SECRET))
    assert rotating.match(keys) == 2
    rotating.put_many(keys[2:], pages[2:])
    assert rotating.flush(READY_S)
    assert rotating.match(keys) == len(keys)
    assert torch.equal(rotating.get_many(keys), pages)
    assert rotating.stats().corrupt == 0
    assert before.match(keys) == 2  # a daemon not yet rotated misses the new pages
    assert join(master, tiers, Keyring(NEXT)).match(keys[2:]) == 2


def test_without_a_secret_the_start_warns(
    master: Master, tiers: list[RemoteTier], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcore.tiers"):
        join(master, tiers, None)
    assert any("trusts every client of the master" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcore.tiers"):
        join(master, tiers, Keyring(SECRET))
    assert not caplog.records


def test_encrypted_pages_round_trip_and_are_not_stored_in_the_clear(
    master: Master, tiers: list[RemoteTier]
) -> None:
    pytest.importorskip("cryptography")
    keyring = Keyring(SECRET, encrypt=True)
    writer, reader = join(master, tiers, keyring), join(master, tiers, keyring)
    keys = chain("encrypted", pages=2)
    pages = torch.randn(len(keys), *PAGE).to(torch.float16)
    writer.put_many(keys, pages)
    assert writer.flush(READY_S)
    assert torch.equal(reader.get_many(keys), pages)
    stored = writer._store.get(object_names(keyring, keys)[0][0])
    assert bytes(byte_view(pages[0].contiguous())) not in stored
    assert join(master, tiers, Keyring(SECRET)).get_many(keys).shape[0] == 0  # MAC'd only: no
