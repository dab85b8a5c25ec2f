"""HostTier against a dict model: capacity, eviction order (every policy), spills, exact bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from page_bytes import BYTE_LAYOUTS, ORDERS, byte_pages, same_bytes

from kvcore.errors import BadRequest
from kvcore.eviction import DEFAULT as DEFAULT_EVICTION
from kvcore.eviction import POLICIES
from kvcore.layout import KVLayout
from kvcore.prefix import PrefixKey
from kvcore.testing.eviction_model import MODELS
from kvcore.tiers import HostTier, TierKey, layout_fingerprint, tier_key

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32", num_pages=8
)
PAGE = LAYOUT.stored_page_shape  # [L, parts, page_size, H, D]: layer-major
FP = layout_fingerprint(LAYOUT)
KEYS = [tier_key(FP, PrefixKey(bytes([i]) * 32)) for i in range(12)]


def page_of(key: TierKey, version: int) -> torch.Tensor:
    """A page whose bytes name its key and a version (so a stale copy is caught)."""
    return torch.full(PAGE, float(key[-1] * 1000 + version))


class HostModel(RuleBasedStateMachine):
    """The tier against a dict of its pages and the plain model of its eviction policy
    (kvcore/testing/eviction_model.py): what it spills, in order, and the bytes."""

    eviction = DEFAULT_EVICTION

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 4
        self.tier = HostTier(LAYOUT, self.capacity, eviction=self.eviction)
        self.pages: dict[TierKey, torch.Tensor] = {}
        self.policy = MODELS[self.eviction](self.capacity)
        self.version = 0

    def touch(self, key: TierKey) -> None:
        self.policy.pin([key])
        self.policy.hit([key])
        self.policy.release([(key, key)], True)

    @rule(picks=st.lists(st.sampled_from(KEYS), max_size=7))
    def put(self, picks: list[TierKey]) -> None:
        self.version += 1
        pages = (
            torch.stack([page_of(k, self.version) for k in picks])
            if picks
            else torch.empty(0, *PAGE)
        )
        spilled = self.tier.put_spill(picks, pages)
        # the model: touch held keys, then store the new ones (first occurrence)
        new: dict[TierKey, torch.Tensor] = {}
        for key, page in zip(picks, pages, strict=True):
            if key in self.pages:
                self.touch(key)
            elif key not in new:
                new[key] = page
        overflow = max(len(new) - self.capacity, 0)
        expected = list(new.items())[:overflow]
        stored = list(new.items())[overflow:]
        free = self.capacity - len(self.pages)
        for _ in range(max(len(stored) - free, 0)):
            key = self.policy.evict()
            expected.append((key, self.pages.pop(key)))
        for key, page in stored:
            self.pages[key] = page
            self.policy.release([(key, key)], True)
        assert spilled.keys == [k for k, _ in expected]
        for row, (_, page) in enumerate(expected):
            assert torch.equal(spilled.pages[row], page)

    @rule(picks=st.lists(st.sampled_from(KEYS), max_size=5))
    def get(self, picks: list[TierKey]) -> None:
        before = self.tier.stats()
        assert self.tier.match(picks) == self.tier.match(picks)  # read-only
        got = self.tier.get_many(picks)
        count = 0
        while count < len(picks) and picks[count] in self.pages:
            count += 1
        assert got.shape == (count, *PAGE)
        for row, key in enumerate(picks[:count]):
            assert torch.equal(got[row], self.pages[key])
            self.touch(key)
        after = self.tier.stats()
        assert after.hits - before.hits == count
        assert after.misses - before.misses == len(picks) - count

    @rule(picks=st.lists(st.sampled_from(KEYS), max_size=3))
    def discard(self, picks: list[TierKey]) -> None:
        expected = len({k for k in picks if k in self.pages})
        assert self.tier.discard(picks) == expected
        for key in picks:
            if self.pages.pop(key, None) is not None:
                self.policy.drop(key)

    @invariant()
    def agrees(self) -> None:
        self.tier.check_integrity()
        assert set(self.tier.keys()) == set(self.pages) == set(self.policy.evictable())
        assert self.tier.stats().pages == len(self.pages)
        assert self.tier.eviction == self.eviction


for _name in POLICIES:  # one machine per eviction policy
    _machine = type(f"HostModel_{_name}", (HostModel,), {"eviction": _name})
    _machine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
    globals()[f"TestHostModel_{_name.replace('-', '_')}"] = _machine.TestCase


def test_host_rejects_foreign_keys_and_bad_pages() -> None:
    tier = HostTier(LAYOUT, 2)
    other = layout_fingerprint(KVLayout(2, 1, 8, 2, "float32", 8))
    with pytest.raises(BadRequest):
        tier.put_many([tier_key(other, PrefixKey(bytes(32)))], torch.zeros(1, *PAGE))
    with pytest.raises(BadRequest):
        tier.put_many(KEYS[:1], torch.zeros(1, *PAGE, dtype=torch.float16))
    with pytest.raises(BadRequest):
        tier.put_many(KEYS[:2], torch.zeros(1, *PAGE))
    with pytest.raises(BadRequest):
        HostTier(LAYOUT, 0)
    assert tier.stats().pages == 0


def test_host_counts_bytes() -> None:
    tier = HostTier(LAYOUT, 3)
    tier.put_many(KEYS[:2], torch.zeros(2, *PAGE))
    tier.get_many(KEYS[:3])
    stats = tier.stats()
    assert (stats.stored, stats.hits, stats.misses) == (2, 2, 1)
    assert stats.bytes_in == stats.bytes_out == 2 * LAYOUT.page_bytes
    assert stats.bytes_used == 2 * LAYOUT.page_bytes


def test_promote_and_staged_get_write_exact_pool_pages() -> None:
    from kvcore.tiers import gather_pages, scatter_pages

    tier = HostTier(LAYOUT, 4)
    pages = torch.randn(3, *PAGE)
    tier.put_many(KEYS[:3], pages)
    pool = LAYOUT.pages_view(torch.zeros(LAYOUT.total_bytes // 4))
    assert tier.promote([*KEYS[:2], KEYS[5]], pool, [6, 1, 3]) == 2
    assert torch.equal(gather_pages(pool, [6, 1]), pages[:2])
    assert torch.equal(gather_pages(pool, [3]), torch.zeros(1, *PAGE))
    staging = torch.empty(4, *PAGE)
    got = tier.get_many(KEYS[:3], out=staging)
    assert got.data_ptr() == staging.data_ptr() and torch.equal(got, pages)
    scatter_pages(pool, [0, 2, 4], got)
    assert torch.equal(gather_pages(pool, [0, 2, 4]), pages)
    with pytest.raises(BadRequest):
        tier.promote(KEYS[:2], pool, [0])
    with pytest.raises(BadRequest):
        tier.get_many(KEYS[:3], out=staging[:2])  # too small: refused before any count
    assert tier.stats().hits == 5 and tier.stats().misses == 1


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("layout", BYTE_LAYOUTS)
def test_fp8_and_latent_pages_come_back_byte_for_byte(layout: KVLayout, order: str) -> None:
    """In every order: a slot is the page's stored form, and every move keeps its bytes."""
    from kvcore.tiers import gather_pages, scatter_pages

    layout = dataclasses.replace(layout, order=order)
    keys = [tier_key(layout_fingerprint(layout), PrefixKey(bytes([i]) * 32)) for i in range(5)]
    pages = byte_pages(layout, 5)
    tier = HostTier(layout, 3)
    spilled = tier.put_spill(keys, pages)  # two overflow: the put's oldest pass through
    assert spilled.keys == keys[:2] and same_bytes(spilled.pages, pages[:2])
    assert same_bytes(tier.get_many(keys[2:]), pages[2:])
    spilled = tier.put_spill(keys[:1], pages[:1])  # pushes out the LRU entry's bytes
    assert spilled.keys == keys[2:3] and same_bytes(spilled.pages, pages[2:3])
    pool = layout.pages_view(torch.zeros(layout.total_bytes, dtype=torch.uint8))
    assert tier.promote([keys[3], keys[0]], pool, [5, 2]) == 2
    assert same_bytes(gather_pages(pool, [5, 2]), pages[[3, 0]])
    scatter_pages(pool, [7, 1], pages[1:3])
    assert same_bytes(gather_pages(pool, [7, 1]), pages[1:3])
    tier.check_integrity()


@pytest.mark.parametrize("order", ORDERS)
def test_a_spill_from_the_pool_stores_its_pages_and_returns_what_it_pushed_out(
    order: str,
) -> None:
    """spill_from copies pool pages straight into slots, with put_spill's rules: the
    overflow passes through, the LRU entries' bytes come back, repeats stored once."""
    from kvcore.tiers import scatter_pages

    layout = dataclasses.replace(BYTE_LAYOUTS[0].values[0], order=order)
    keys = [tier_key(layout_fingerprint(layout), PrefixKey(bytes([i]) * 32)) for i in range(6)]
    pages = byte_pages(layout, 6)
    pool = layout.pages_view(torch.zeros(layout.total_bytes, dtype=torch.uint8))
    scatter_pages(pool, [4, 0, 7, 2, 5, 1], pages)
    tier = HostTier(layout, 3, eviction="lru")
    first = tier.spill_from(keys[:2], pool, [4, 0])
    assert first.keys == [] and len(first.pages) == 0
    spilled = tier.spill_from([keys[2], keys[2], keys[3]], pool, [7, 7, 2])
    assert spilled.keys == keys[:1] and same_bytes(spilled.pages, pages[:1])
    assert same_bytes(tier.get_many(keys[1:4]), pages[1:4])
    spilled = tier.spill_from(keys, pool, [4, 0, 7, 2, 5, 1])  # 3 new, 0 free: 3 pushed out
    assert spilled.keys == keys[1:4] and same_bytes(spilled.pages, pages[1:4])
    assert same_bytes(tier.get_many([keys[0], *keys[4:]]), pages[[0, 4, 5]])
    small = HostTier(layout, 2, eviction="lru")
    spilled = small.spill_from(keys[:3], pool, [4, 0, 7])  # the oldest passes through
    assert spilled.keys == keys[:1] and same_bytes(spilled.pages, pages[:1])
    assert same_bytes(small.get_many(keys[1:3]), pages[1:3])
    with pytest.raises(BadRequest):
        tier.spill_from(keys[:2], pool, [0])
    with pytest.raises(BadRequest):
        tier.spill_from(keys[:1], pool, [layout.num_pages])
    with pytest.raises(BadRequest):
        tier.spill_from(keys[:1], pool.view(torch.uint8), [0])
    tier.check_integrity()
