"""Eviction policies (kvcore/eviction.py): what each keeps, that tails go before their
heads however pages were shared, and how a pool names its policy. The Manager's,
the TieredManager's and the tiers' state machines run under every policy too
(test_manager_conformance.py, test_daemon_tiers_manager.py, test_tiers_*.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.config import PoolConfig, load_toml, parse_pool_spec
from kvcore.errors import BadRequest
from kvcore.eviction import DEFAULT, POLICIES, AdaptiveSLRU, make_policy
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.testing.eviction_model import MODELS


def test_every_policy_has_a_plain_model_and_the_default_is_one() -> None:
    assert set(POLICIES) == set(MODELS)
    assert DEFAULT in POLICIES
    assert all(make_policy(name, 4).name == name for name in POLICIES)


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(BadRequest, match="unknown eviction policy 'mru'; known: lru, adaptive"):
        make_policy("mru", 4)
    with pytest.raises(BadRequest, match="eviction is one of lru, adaptive-slru, not 'mru'"):
        parse_pool_spec("eviction=mru").validate()


def test_the_pool_setting_is_one_field_in_flags_toml_and_environment(tmp_path: object) -> None:
    from pathlib import Path

    from kvcore.config import ServiceConfig, apply_env

    assert PoolConfig().eviction == DEFAULT
    toml = Path(str(tmp_path)) / "kvcore.toml"
    toml.write_text('[[pools]]\nname = "a"\neviction = "lru"\n')
    assert load_toml(toml).pools[0].eviction == "lru"
    assert parse_pool_spec("name=a,eviction=lru").eviction == "lru"
    env = apply_env(ServiceConfig(), {"KVCORE_POOL_EVICTION": "lru"})
    assert env.pools[0].eviction == "lru"


def _layout(num_pages: int, page_size: int = 1) -> KVLayout:
    return KVLayout(1, 1, 8, page_size, "float16", num_pages)


def _serve(manager: Manager, seq: int, tokens: list[int]) -> int:
    """One request as an engine runs it: allocate, commit every full page, free."""
    hit = manager.allocate(seq, tokens).num_cached_tokens
    manager.commit(seq, tokens)
    manager.free(seq)
    return hit


def test_a_prefix_hit_once_outlives_a_scan_of_one_time_prompts() -> None:
    """LRU gives a twice-used prefix up to a burst of prompts nobody sends again; the
    adaptive SLRU keeps it (it was hit: protected), and evicts the one-time pages."""
    hits = {}
    for name in POLICIES:
        manager = Manager(_layout(8), eviction=name)
        shared = [1, 2, 3, 4, 5]  # four full pages and the last token
        _serve(manager, 0, shared)
        _serve(manager, 1, shared)  # a hit: the four pages are protected now
        for i in range(3):  # a scan: 3 x 3 pages of prompts never seen again
            _serve(manager, 10 + i, [100 + i] * 3)
        hits[name] = _serve(manager, 2, shared)
        manager.check_integrity()
    assert hits == {"lru": 0, "adaptive-slru": 4}


def test_a_key_that_comes_back_from_its_ghost_is_protected() -> None:
    policy: AdaptiveSLRU[int] = AdaptiveSLRU(4)
    policy.add([(1, b"a")])
    assert policy.evict(1) == [1]  # evicted unhit: its key enters the first ghost
    policy.add([(2, b"b"), (1, b"a")])  # released together: 1 is the head, from a ghost
    policy.add([(3, b"c")])
    assert policy.evict(3) == [2, 3, 1]  # 1 was protected


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 12),
    ops=st.lists(st.tuples(st.sampled_from("ahrp"), st.integers(0, 30)), max_size=120),
)
def test_the_adaptive_state_stays_bounded(capacity: int, ops: list[tuple[str, int]]) -> None:
    """Whatever comes and goes: the protected target within [0.1, 0.9] of the capacity,
    each ghost at most GHOST x capacity keys, every entry in exactly one list."""
    policy: AdaptiveSLRU[int] = AdaptiveSLRU(capacity)
    held: set[int] = set()
    for op, item in ops:
        if op == "a" and item not in policy and len(policy) < capacity:
            policy.add([(item, bytes([item]))])
            held.add(item)
        elif op == "h":
            policy.hit([item])
        elif op == "r" and item in policy:
            policy.remove(item)
            held.discard(item)
        elif op == "p" and len(policy):  # one at a time, as a tier evicts
            held.discard(*policy.evict(1))
        assert 0.1 * capacity <= policy.target <= 0.9 * capacity
        assert policy.num_ghosts <= 2 * max(int(AdaptiveSLRU.GHOST * capacity), 1)
        assert set(policy) == held


def test_a_ghost_key_is_protected_only_with_its_whole_chain() -> None:
    """A release that is not the whole chain (a page before it stayed held, or was a
    private copy of its head) cannot know the head goes to the protected list too:
    its pages start unprotected, whatever their ghosts say, so their head cannot be
    evicted before them for being less protected."""
    for whole, expected in ((True, [3, 1, 2]), (False, [1, 2, 3])):
        policy: AdaptiveSLRU[int] = AdaptiveSLRU(4)
        policy.hit([1, 2])  # a request was served both
        policy.add([(1, b"t"), (2, b"h")])
        assert policy.evict(2) == [1, 2]  # tail first, into the hit ghost
        policy.add([(1, b"t"), (2, b"h")], whole)  # back together (head last)
        policy.add([(3, b"x")])  # a newcomer
        assert policy.evict(3) == expected


@pytest.mark.parametrize("eviction", list(POLICIES))
def test_a_page_held_elsewhere_that_is_hit_counts_as_hit(eviction: str) -> None:
    """A hit on a page another sequence still holds is a hit for the policy too: a
    shared system prompt that many concurrent requests hit is protected."""
    manager = Manager(_layout(8), eviction=eviction)
    shared = [1, 2, 3]  # two full pages and the last token
    manager.allocate(0, shared)
    manager.commit(0, shared)
    assert manager.allocate(1, shared).num_cached_tokens == 2  # hit while 0 holds them
    manager.free(1)
    manager.free(0)
    for i in range(3):  # a scan of prompts never seen again
        _serve(manager, 10 + i, [100 + i] * 3)
    assert manager.lookup(shared).num_cached_tokens == (2 if eviction != "lru" else 0)
    manager.check_integrity()
