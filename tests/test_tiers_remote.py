"""RemoteTier against a real Mooncake master on loopback (no mock of the store).

Skipped with a reason where the mooncake package or libibverbs1 is missing
(tests/mooncake_helpers.py says how to install them). No timed assertion:
"within the bound" is checked by the counters (``timeouts``) and by returning
at all (pytest-timeout guards a hang).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mooncake_helpers import SKIP_REASON, Master, _free_port, master_binary, start_master
from page_bytes import BYTE_LAYOUTS, byte_pages, same_bytes

from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.prefix import KeySpace, chain_keys, encode_tokens, root_key
from kvcore.tiers import RemoteConfig, RemoteTier, TierKey, layout_fingerprint, tier_keys
from kvcore.tiers.remote import object_key

pytestmark = [
    pytest.mark.skipif(master_binary() is None, reason=SKIP_REASON),
    pytest.mark.timeout(120),
]

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16", num_pages=16
)
PAGE = LAYOUT.stored_page_shape  # [L, parts, page_size, H, D]: layer-major
READY_S = 30.0


def chain(
    namespace: str, layout: KVLayout = LAYOUT, pages: int = 6, salt: int = 0
) -> list[TierKey]:
    tokens = encode_tokens([salt * 1000 + i for i in range(pages * layout.page_size)])
    keys = list(chain_keys(root_key(KeySpace(namespace)), tokens, layout.page_size))
    return tier_keys(layout_fingerprint(layout), keys)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    running = start_master(tmp_path_factory.mktemp("mooncake"))
    yield running
    running.stop()


def connect(master: Master, layout: KVLayout = LAYOUT, **bounds: float) -> RemoteTier:
    config = RemoteConfig(master.address, master.metadata_server, timeout_s=5.0)
    tier = RemoteTier(layout, dataclasses.replace(config, **bounds))
    assert tier.wait_ready(READY_S), "could not join the store"
    return tier


@pytest.mark.parametrize("layout", [pytest.param(LAYOUT, id="float16"), *BYTE_LAYOUTS])
def test_pages_published_by_one_daemon_are_hits_for_another(
    master: Master, layout: KVLayout
) -> None:
    """Byte for byte, every byte value (fp8 NaN and infinity patterns, latent pages)."""
    keys = chain("shared", layout)
    pages = byte_pages(layout, len(keys))
    writer, reader = connect(master, layout), connect(master, layout)
    try:
        assert writer.put_many(keys[:4], pages[:4]) == []
        assert writer.flush(READY_S)
        assert reader.match(keys) == 4
        got = reader.get_many(keys)
        assert same_bytes(got, pages[:4])
        stats = reader.stats()
        assert (stats.hits, stats.misses, stats.corrupt) == (4, 2, 0)
        assert stats.bytes_out == 4 * layout.page_bytes
        assert writer.stats().stored == 4
        writer.check_integrity()
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize(
    "layout, other_layout",  # the same bytes per page, another shape, dtype or kind
    [
        pytest.param(LAYOUT, dataclasses.replace(LAYOUT, num_kv_heads=1, head_dim=16), id="shape"),
        pytest.param(
            KVLayout(2, 2, 8, 4, "float8_e4m3fn", 8),
            KVLayout(2, 2, 8, 4, "float8_e5m2", 8),
            id="fp8",
        ),
        pytest.param(
            KVLayout(2, 1, 16, 4, "float16", 8, kind="latent"),
            KVLayout(2, 1, 8, 4, "float16", 8),
            id="latent",
        ),
    ],
)
def test_layouts_and_namespaces_stay_apart(
    master: Master, layout: KVLayout, other_layout: KVLayout
) -> None:
    assert other_layout.page_bytes == layout.page_bytes
    tier, other = connect(master, layout), connect(master, other_layout)
    try:
        keys = chain("apart", layout, salt=1)
        tier.put_many(keys, byte_pages(layout, len(keys)))
        assert tier.flush(READY_S)
        assert tier.match(keys) == len(keys)
        assert other.match(chain("apart", other_layout, salt=1)) == 0
        assert tier.match(chain("apart-2", layout, salt=1)) == 0
        with pytest.raises(BadRequest):
            other.match(keys)
    finally:
        tier.close()
        other.close()


def test_a_page_major_page_is_one_object_and_a_miss_for_another_order(master: Master) -> None:
    """A page-major pool's pages (one run each, published as one object each) come back
    byte for byte under its order, and are a miss for a layer-major reader of the same
    chain (the fingerprint holds the order)."""
    page_major = KVLayout(2, 2, 8, 4, "float8_e4m3fn", 8, order="PLHKT")
    layer_major = dataclasses.replace(page_major, order="LPKTH")
    keys = chain("orders", page_major, salt=2)
    pages = byte_pages(page_major, len(keys))
    writer, other = connect(master, page_major), connect(master, layer_major)
    try:
        writer.put_many(keys, pages)
        assert writer.flush(READY_S)
        assert writer.stats().stored == len(keys)  # one put per page: one object each
        assert same_bytes(writer.get_many(keys), pages)
        assert other.match(chain("orders", layer_major, salt=2)) == 0
    finally:
        writer.close()
        other.close()


def test_a_corrupt_object_is_a_counted_miss(master: Master) -> None:
    tier = connect(master)
    try:
        keys = chain("corrupt", salt=2)
        tier.put_many(keys[:1], torch.ones(1, *PAGE, dtype=torch.float16))
        assert tier.flush(READY_S)
        blob = bytearray(tier._store.get(object_key(keys[0])))
        blob[-1] ^= 0xFF
        assert (
            tier._store.put(object_key(keys[1]), bytes(blob)) == 0
        )  # a valid frame of another key
        assert tier._store.put(object_key(keys[2]), b"torn") == 0
        assert tier.match(keys[:3]) == 3
        assert tier.get_many(keys[:3]).shape[0] == 1
        assert tier.get_many(keys[2:3]).shape[0] == 0
        stats = tier.stats()
        assert stats.corrupt == 2 and stats.hits == 1
    finally:
        tier.close()


def test_a_full_queue_drops_and_counts(master: Master) -> None:
    tier = connect(master, queue_pages=2)
    try:
        keys = chain("full", salt=3)
        tier.put_many(keys[:3], torch.zeros(3, *PAGE, dtype=torch.float16))  # over the bound
        assert tier.stats().dropped == 3
        assert tier.flush(READY_S)
        assert tier.match(keys) == 0
    finally:
        tier.close()


def test_an_absent_master_is_a_miss_not_an_error(tmp_path: Path) -> None:
    config = RemoteConfig(f"127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}/metadata")
    tier = RemoteTier(LAYOUT, config)
    try:
        assert not tier.wait_ready(READY_S)
        keys = chain("absent")
        assert tier.match(keys) == 0
        assert tier.get_many(keys).shape[0] == 0
        tier.put_many(keys, torch.zeros(len(keys), *PAGE, dtype=torch.float16))
        assert tier.flush(READY_S)
        stats = tier.stats()
        assert stats.misses == len(keys) and stats.timeouts >= 2 and stats.dropped == len(keys)
    finally:
        tier.close()


def test_master_killed_mid_run(tmp_path: Path) -> None:
    doomed = start_master(tmp_path)
    tier = connect(doomed, timeout_s=1.0)
    try:
        keys = chain("killed", salt=4)
        pages = torch.randn(len(keys), *PAGE).to(torch.float16)
        tier.put_many(keys[:3], pages[:3])
        assert tier.flush(READY_S)
        assert torch.equal(tier.get_many(keys[:3]), pages[:3])
        doomed.kill()
        for _ in range(3):  # every call returns (within timeout_s) and misses
            assert tier.match(keys) == 0
            assert tier.get_many(keys).shape[0] == 0
        tier.put_many(keys[3:], pages[3:])
        assert tier.flush(READY_S)
        stats = tier.stats()
        assert stats.hits == 3 and stats.misses >= 3 * len(keys)
        assert stats.dropped == len(keys) - 3
    finally:
        tier.close()
        doomed.stop()
