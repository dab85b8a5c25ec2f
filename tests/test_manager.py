"""Manager semantics, one promise per test (the state machine covers combinations)."""

from __future__ import annotations

import pytest

from kvcore import KVLayout, Manager, PrefixHit, prefix
from kvcore.errors import BadRequest, OutOfPages, SequenceExists, UnknownSequence
from kvcore.prefix import (
    KeySpace,
    PageRemoved,
    PageStored,
    chain_keys,
    encode_tokens,
    root_key,
)

PAGE = 4


def make(num_pages: int = 16) -> Manager:
    return Manager(KVLayout(2, 2, 8, PAGE, "float16", num_pages))


def cached(m: Manager, tokens: list[int], namespace: str = "default") -> int:
    return m.lookup(tokens, KeySpace(namespace=namespace)).num_cached_tokens


def snapshot(m: Manager) -> tuple[object, ...]:
    return (m.stats(), {s: m.block_table(s) for s in range(100) if s in m}, m.prefix_snapshot())


def test_allocate_pages_and_refcounts() -> None:
    m = make()
    a = m.allocate(1, list(range(10)))
    assert len(a.pages) == 3 and a.num_cached_tokens == 0
    assert m.block_table(1) == a.pages and m.num_tokens(1) == 10
    s = m.stats()
    assert (s.held_pages, s.free_pages, s.evictable_pages, s.num_sequences) == (3, 13, 0, 1)
    m.check_integrity()


def test_hit_after_commit_and_free_never_covers_last_token() -> None:
    m = make()
    prompt = list(range(12))  # exactly three pages
    m.allocate(1, prompt)
    m.commit(1, prompt)
    m.free(1)
    assert m.stats().evictable_pages == 3
    b = m.allocate(2, prompt)
    # The last token must be computed by the engine: only two of the three pages hit.
    assert b.num_cached_tokens == 8
    assert cached(m, prompt) == 8
    assert cached(m, [*prompt, 99]) == 12
    m.check_integrity()


def test_pages_visible_only_after_commit() -> None:
    m = make()
    prompt = list(range(9))
    m.allocate(1, prompt)
    assert cached(m, prompt) == 0
    assert m.commit(1, prompt[:5]) == 1  # one full page published
    assert cached(m, prompt) == 4
    assert m.commit(1, prompt) == 2
    assert cached(m, prompt) == 8
    assert m.allocate(2, prompt).num_cached_tokens == 8  # shared while still held by 1
    assert m.stats().held_pages == 3 + 1


def test_namespaces_isolate() -> None:
    m = make()
    prompt = list(range(9))
    m.allocate(1, prompt, KeySpace(namespace="a"))
    m.commit(1, prompt)
    assert cached(m, prompt, "a") == 8
    assert cached(m, prompt, "b") == 0
    assert m.allocate(2, prompt, KeySpace(namespace="b")).num_cached_tokens == 0


def test_fork_shares_and_never_allocates() -> None:
    m = make(num_pages=3)
    m.allocate(1, list(range(10)))  # 3 pages: the pool is full
    assert m.fork(1, 2) == m.block_table(1)
    assert m.stats().held_pages == 3 and m.stats().free_pages == 0
    m.check_integrity()


def test_copy_on_write_of_shared_last_page() -> None:
    m = make()
    m.allocate(1, list(range(6)))  # last page half full
    m.fork(1, 2)
    ext = m.extend(2, 1)
    ((src, dst),) = ext.copies
    assert src == m.block_table(1)[-1] and dst == m.block_table(2)[-1] and src != dst
    assert ext.new_pages == []
    # The parent's page is now private again: extending it copies nothing.
    assert m.extend(1, 1).copies == []
    m.check_integrity()


def test_no_copy_when_last_page_full_or_nothing_written() -> None:
    m = make()
    m.allocate(1, list(range(8)))  # two full pages
    m.fork(1, 2)
    ext = m.extend(2, 1)
    assert ext.copies == [] and len(ext.new_pages) == 1
    m.allocate(3, list(range(5)))
    m.fork(3, 4)
    assert m.extend(4, 0) == m.extend(4, 0)  # nothing written: no copy
    assert m.extend(4, 0).copies == []


def test_eviction_lru_and_tails_first_only_when_free_queue_empty() -> None:
    m = make(num_pages=6)
    a = list(range(8))
    b = list(range(100, 108))
    m.allocate(1, a)
    m.commit(1, a)
    m.free(1)
    m.allocate(2, b)
    m.commit(2, b)
    m.free(2)
    assert m.stats().evictable_pages == 4 and m.stats().free_pages == 2
    m.allocate(3, [7] * 8)  # takes the two free pages: no eviction
    assert m.stats().evictions == 0
    m.allocate(4, [9])  # free queue empty: evict the least recently released chain's tail
    assert m.stats().evictions == 1
    assert cached(m, [*a, 0]) == 4  # a's tail page went first, its head stays
    assert cached(m, [*b, 0]) == 8
    assert [type(e) for e in m.take_events()] == [PageStored] * 4 + [PageRemoved]
    assert m.take_events() == []
    m.check_integrity()


def test_hit_refreshes_lru_position() -> None:
    m = make(num_pages=4)
    a, b = list(range(4)), list(range(50, 54))
    for seq, toks in ((1, a), (2, b)):
        m.allocate(seq, toks)
        m.commit(seq, toks)
        m.free(seq)
    m.allocate(3, [*a, 1])
    m.free(3)
    m.allocate(4, [1] * 12)  # needs 3 pages: 2 free + 1 eviction, which must hit b
    assert cached(m, [*a, 1]) == 4 and cached(m, [*b, 1]) == 0


def test_failures_are_typed_and_atomic() -> None:
    m = make(num_pages=4)
    m.allocate(1, list(range(6)))
    m.commit(1, list(range(6)))
    m.take_events()
    before = snapshot(m)
    cases = [
        (OutOfPages, lambda: m.allocate(2, list(range(20)))),
        (OutOfPages, lambda: m.extend(1, 100)),
        (SequenceExists, lambda: m.allocate(1, [1])),
        (SequenceExists, lambda: m.fork(1, 1)),
        (UnknownSequence, lambda: m.extend(9, 1)),
        (UnknownSequence, lambda: m.free(9)),
        (UnknownSequence, lambda: m.commit(9, [])),
        (UnknownSequence, lambda: m.fork(9, 10)),
        (BadRequest, lambda: m.allocate(3, [1, 2**32])),
        (BadRequest, lambda: m.allocate(3, [1, "x"])),  # type: ignore[list-item]
        (BadRequest, lambda: m.allocate(-1, [1])),
        (BadRequest, lambda: m.extend(1, -2)),
        (BadRequest, lambda: m.commit(1, list(range(7)))),
        (BadRequest, lambda: m.commit(1, [], start=8)),  # start past the committed page
        (BadRequest, lambda: m.commit(1, [1, 2], start=2)),  # not a page boundary
        (BadRequest, lambda: m.commit(1, [], start=-4)),
        (BadRequest, lambda: m.commit(1, list(range(3)), start=4)),  # past num_tokens
        (BadRequest, lambda: m.lookup([1], KeySpace(namespace=7))),  # type: ignore[arg-type]
        (BadRequest, lambda: m.plan([1], KeySpace(namespace=7))),  # type: ignore[arg-type]
        (UnknownSequence, lambda: m.extend(True, 1)),  # hashes like the live sequence 1
        (UnknownSequence, lambda: m.free(1.0)),  # type: ignore[arg-type]
        (BadRequest, lambda: m.extend(1, True)),
        (BadRequest, lambda: m.commit(1, [], start=False)),
        (SequenceExists, lambda: m.check_new(1)),
        (BadRequest, lambda: m.check_new(True)),
        (BadRequest, lambda: m.adopt(list(range(6)), 1)),  # would cover the last token
    ]
    for error, call in cases:
        with pytest.raises(error) as info:
            call()
        assert info.value.code == error.code
        assert snapshot(m) == before
        assert m.take_events() == [], f"{call} failed but queued events"
    m.check_integrity()


def test_commit_contradicting_published_tokens_is_rejected() -> None:
    m = make()
    m.allocate(1, list(range(8)))
    m.fork(1, 2)
    m.commit(1, list(range(8)))
    with pytest.raises(BadRequest):
        m.commit(2, [5] * 8)  # same page, other tokens
    assert m.commit(2, list(range(8))) == 2


def test_duplicate_commit_keeps_first_page() -> None:
    m = make()
    prompt = list(range(9))
    m.allocate(1, prompt)
    m.allocate(2, prompt)  # computed independently: no hit yet
    m.commit(1, prompt)
    m.commit(2, prompt)
    assert m.stats().cached_pages == 2
    m.free(2)
    assert m.stats().evictable_pages == 0  # 2's pages were private: back to the free queue
    m.free(1)
    assert m.stats().evictable_pages == 2
    m.check_integrity()


def test_stats_count_tokens() -> None:
    m = make()
    p = list(range(9))
    m.allocate(1, p)
    m.commit(1, p)
    m.allocate(2, p)
    s = m.stats()
    assert (s.query_tokens, s.hit_tokens) == (18, 8)
    assert s.hit_rate == pytest.approx(8 / 18)


def test_layout_sizes_and_budget() -> None:
    layout = KVLayout(32, 8, 128, 16, "bfloat16", 100)
    assert layout.layer_shape == (100, 2, 16, 8, 128)
    assert layout.page_bytes_per_layer == 2 * 16 * 8 * 128 * 2
    assert layout.total_bytes == 32 * 100 * layout.page_bytes_per_layer
    fit = KVLayout.for_budget(
        10 * layout.page_bytes + 1,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype="bfloat16",
    )
    assert fit.num_pages == 10
    with pytest.raises(BadRequest):
        KVLayout.for_budget(
            10, num_layers=1, num_kv_heads=1, head_dim=8, page_size=1, dtype="float32"
        )
    with pytest.raises(BadRequest):
        KVLayout(1, 1, 8, 0, "float16", 4)
    with pytest.raises(BadRequest):
        KVLayout(1, 1, 8, 4, "int8", 4)


def test_layer_views_are_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    layout = KVLayout(3, 2, 8, 4, "float16", 5)
    pool = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    views = layout.layer_views(pool)
    assert len(views) == 3 and views[1].shape == layout.layer_shape
    views[2][4, 1, 3, 1, 7] = 1.5
    assert pool.view(torch.float16).reshape(-1)[-1] == 1.5


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = "import sys, kvcore; m = kvcore.Manager; print(sorted({'torch', 'zmq', 'triton'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_commit_with_start_sends_only_what_is_new() -> None:
    m = make()
    tokens = list(range(13))
    m.allocate(1, tokens)
    assert m.commit(1, tokens[:5]) == 1
    assert m.commit(1, tokens[4:9], start=4) == 2  # tokens [4, 9): page 1 is new
    assert m.commit(1, tokens[4:13], start=4) == 3  # page 1 again: neither hashed nor checked
    assert m.commit(1, [], start=12) == 3
    whole = make()
    whole.allocate(1, tokens)
    whole.commit(1, tokens)
    assert m.prefix_snapshot() == whole.prefix_snapshot()  # same keys, parents and pages
    assert cached(m, [*tokens[:12], 0]) == 12


def test_lookup_counts_the_evictable_pages_of_its_hit() -> None:
    m = make(num_pages=6)
    prompt = list(range(13))  # four pages, three of them full
    m.allocate(1, prompt)
    m.commit(1, prompt)
    m.allocate(2, prompt[:9])  # holds pages 0 and 1 of the hit (page 2 is not covered)
    m.free(1)  # pages 3 (private) free again, 2 evictable; 0 and 1 still held by 2
    hit = m.lookup(prompt)
    assert hit == PrefixHit(num_cached_tokens=12, num_evictable_pages=1)
    s = m.stats()
    # allocate fits iff pages_for(n) - hit_pages <= free + evictable - num_evictable_pages
    assert s.free_pages + s.evictable_pages - hit.num_evictable_pages >= 4 - 3
    m.allocate(3, prompt)
    assert m.lookup(prompt).num_evictable_pages == 0  # now pinned


def test_events_are_queued_in_order_and_taken_once() -> None:
    m = make(num_pages=3)
    a = list(range(8))
    m.allocate(1, a)
    assert m.commit(1, a) == 2
    k0, k1 = (e.key for e in m.prefix_snapshot())
    p0, p1 = m.block_table(1)
    root = root_key(KeySpace("default"))
    t0, t1 = encode_tokens(a[:4]), encode_tokens(a[4:])  # the pages' tokens label the events
    assert m.take_events() == [
        PageStored(k0, root, p0, t0, KeySpace("default")),
        PageStored(k1, k0, p1, t1, KeySpace("default")),
    ]
    assert m.take_events() == []
    m.free(1)
    m.allocate(2, [9] * 9)  # one free page, then the LRU: p1 (the tail) before p0
    assert m.take_events() == [PageRemoved(k1, p1), PageRemoved(k0, p0)]
    assert m.prefix_snapshot() == []


def test_prefix_snapshot_lists_parents_before_children() -> None:
    m = make(num_pages=8)
    prompt = list(range(9))
    m.allocate(1, prompt[:5])
    m.allocate(2, prompt)
    m.commit(1, prompt[:5])  # 1 publishes page 0 first
    m.commit(2, prompt)  # 2's page 0 stays private; its page 1 is indexed under 1's page 0
    m.free(1)
    m.allocate(3, [7] * 4 * 5)  # 3 free pages + 2 evicted: 1's page 0 (the parent) goes
    assert [type(e) for e in m.take_events()] == [PageStored] * 2 + [PageRemoved]
    m.free(3)
    m.allocate(4, prompt[:5])
    m.commit(4, prompt[:5])  # page 0 indexed again, after its child
    entries = m.prefix_snapshot()
    keys = [e.key for e in entries]
    assert len(entries) == 2 and entries[1].parent_key == entries[0].key
    assert keys == [e.key for e in chain_entries(m, prompt)]


def chain_entries(m: Manager, tokens: list[int]) -> list[PageStored]:
    by_key = {e.key: e for e in m.prefix_snapshot()}
    keys = chain_keys(root_key(KeySpace("default")), encode_tokens(tokens), PAGE)
    return [by_key[k] for k in keys if k in by_key]


def test_lookup_then_allocate_hashes_the_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most once, in fact never: a match finds each page by its parent key and its
    tokens, so lookups and allocates hash no page, whatever came before them."""
    m = make(num_pages=32)
    prompt = list(range(40))  # ten pages
    m.allocate(1, prompt)
    m.commit(1, prompt)
    m.free(1)
    calls = 0
    real = prefix._sha256

    def counting(message: bytes) -> object:
        nonlocal calls
        calls += 1
        return real(message)

    monkeypatch.setattr(prefix, "_sha256", counting)  # every page key: page_key, page_keys
    query = [*prompt[:30], 99, 98, 97]  # pages 0-6 hit, page 7 differs
    assert m.lookup(query, KeySpace(namespace="b")).num_cached_tokens == 0  # nothing in "b"
    assert m.lookup(query).num_cached_tokens == 28
    assert m.allocate(2, list(query)).num_cached_tokens == 28  # an equal list, not the same
    assert m.lookup(tuple(query)).num_cached_tokens == 28
    other = [*query[:28], 5, 5, 5, 5, 5]  # pages 0-6 as query's, page 7 other bytes
    assert m.lookup(other).num_cached_tokens == 28
    assert m.lookup(query, KeySpace(namespace="b")).num_cached_tokens == 0
    assert calls == 0
    assert m.commit(2, query[28:32], start=28) == 8  # a commit hashes its new page
    assert calls == 1
    m.check_integrity()  # which also checks every indexed key against its tokens


def test_commit_that_contradicts_a_prefix_hit_or_an_earlier_commit_is_refused() -> None:
    m = make(num_pages=16)
    prompt = list(range(21))  # five full pages of 4 tokens, and one token more
    m.allocate(1, prompt)
    m.commit(1, prompt)
    hit = m.allocate(2, prompt)
    assert hit.num_cached_tokens == 20
    forged = [7, *prompt[1:]]
    with pytest.raises(BadRequest, match="other tokens"):
        m.commit(2, forged)  # the hit pages hold other tokens: refused, nothing changes
    assert m.commit(2, prompt) == 5 and m.commit(2, prompt[8:], start=8) == 5
    with pytest.raises(BadRequest, match="other tokens"):
        m.commit(1, [*prompt[:8], 0, 0, 0, 0], start=0)  # re-sends page 2 with other tokens
    assert m.take_events() != [] and m.commit(1, prompt[20:], start=20) == 5
    m.check_integrity()


def test_plan_names_the_keys_a_hit_may_cover_and_the_room_beside_it() -> None:
    m = make(num_pages=8)
    prompt = list(range(17))  # four full pages and one token: a hit covers at most four
    m.allocate(1, prompt[:8])
    m.commit(1, prompt[:8])
    m.free(1)  # pages 0 and 1 of the chain cached (evictable), 6 free
    m.take_events()
    before = snapshot(m)
    plan = m.plan(prompt)
    assert plan.keys == list(
        chain_keys(root_key(KeySpace("default")), encode_tokens(prompt[:16]), PAGE)
    )
    assert (plan.num_hit, plan.room, plan.num_new) == (2, 8 - 2, 5 - 2)
    assert plan.num_hit * PAGE == cached(m, prompt)
    assert snapshot(m) == before and m.take_events() == []  # read-only
    assert m.plan(prompt[:4]).keys == []  # one page of tokens: its last token is not covered


def test_adopt_indexes_the_pages_after_the_hit_as_cached() -> None:
    m = make(num_pages=8)
    prompt = list(range(17))
    m.allocate(1, prompt[:4])
    m.commit(1, prompt[:4])
    m.free(1)
    m.take_events()
    pages = m.adopt(prompt, 2, medium="host")  # pages 1 and 2 of the chain, from below
    assert len(pages) == 2 and cached(m, prompt) == 3 * PAGE
    assert [(type(e), e.medium) for e in m.take_events()] == [(PageStored, "host")] * 2
    s = m.stats()
    assert (s.held_pages, s.evictable_pages, s.num_sequences) == (0, 3, 0)
    assert m.adopt(prompt, 0) == [] and m.take_events() == []
    m.allocate(2, [*prompt[:12], 0])  # holds the chain's first three pages
    m.commit(2, prompt[:12])
    with pytest.raises(BadRequest):
        m.adopt(prompt, 2)  # three hits and two more would cover the last token
    m.check_integrity()
