"""Key spaces (spec/hashing.md): a model identity, a LoRA adapter and a cache salt
split a namespace's prefix cache. Different models, adapters or salts never share a
page, equal ones do; a sequence keeps its key space through commit and fork; the
events, the lower tiers and the daemon's wire path keep them apart too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvcore_ipc.messages import EventBatch, PageStoredEvent
from kvcore_ipc.vllm_events import BlockStored, lora_name_of, to_vllm

from kvcore import Client
from kvcore.daemon.tiering import TieredManager
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BadRequest
from kvcore.layout import KVLayout
from kvcore.manager import Manager
from kvcore.prefix import KeySpace, PageStored, chain_keys, encode_tokens, root_key
from kvcore.tiers import HostTier, TierStack

PAGE = 4
LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype="float32", num_pages=16
)
PROMPT = list(range(100, 100 + 3 * PAGE + 1))  # 3 full pages + 1 token: a hit covers 3 pages


def committed(manager: Manager, seq: int, tokens: list[int], space: KeySpace = KeySpace()) -> None:
    manager.allocate(seq, tokens, space)
    manager.commit(seq, tokens)
    manager.free(seq)


# -- the Manager ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "asked", "hit"),
    [
        ({"salt": "u1"}, {"salt": "u1"}, 3 * PAGE),
        ({"salt": "u1"}, {"salt": "u2"}, 0),
        ({"salt": "u1"}, {}, 0),
        ({}, {"salt": "u1"}, 0),
        ({"lora": "a"}, {"lora": "a"}, 3 * PAGE),
        ({"lora": "a"}, {"lora": "b"}, 0),
        ({"lora": "a"}, {}, 0),
        ({"lora": "a", "salt": "u1"}, {"lora": "a", "salt": "u1"}, 3 * PAGE),
        ({"lora": "a", "salt": "u1"}, {"lora": "a"}, 0),
        ({"lora": "a", "salt": "u1"}, {"salt": "u1"}, 0),
        ({"lora": "x"}, {"salt": "x"}, 0),  # an adapter never poses as a salt
        ({"salt": "u1"}, {"salt": "u1", "namespace": "other"}, 0),
        ({"model": "m1"}, {"model": "m1"}, 3 * PAGE),
        ({"model": "m1"}, {"model": "m2"}, 0),
        ({"model": "m1"}, {}, 0),
        ({}, {"model": "m1"}, 0),
        ({"model": "m1", "lora": "a"}, {"model": "m2", "lora": "a"}, 0),
        ({"model": "m1", "salt": "u1"}, {"model": "m1", "salt": "u1"}, 3 * PAGE),
        ({"model": "x"}, {"lora": "x"}, 0),  # a model never poses as an adapter
        ({"model": "x"}, {"salt": "x"}, 0),  # nor as a salt
        ({"model": "m1"}, {"model": "m1", "namespace": "other"}, 0),
    ],
)
def test_equal_key_spaces_share_and_others_never(
    stored: dict[str, str], asked: dict[str, str], hit: int
) -> None:
    manager = Manager(LAYOUT)
    committed(manager, 1, PROMPT, KeySpace(**stored))
    assert manager.lookup(PROMPT, KeySpace(**asked)).num_cached_tokens == hit
    assert manager.allocate(2, PROMPT, KeySpace(**asked)).num_cached_tokens == hit
    manager.check_integrity()


def test_a_sequence_keeps_its_key_space_through_commit_extend_and_fork() -> None:
    manager = Manager(LAYOUT)
    space = KeySpace(model="m1", lora="a", salt="u1")
    manager.allocate(1, PROMPT[:PAGE], space)
    manager.extend(1, len(PROMPT) - PAGE)
    manager.fork(1, 2)
    manager.commit(2, PROMPT)  # the child commits in the parent's key space
    events = [e for e in manager.take_events() if isinstance(e, PageStored)]
    resolved = space.resolved()
    assert resolved == KeySpace("default", "m1", "a", "u1")
    assert [e.space for e in events] == [resolved] * 3
    assert events[0].parent_key == root_key(resolved) == root_key(space)
    keys = chain_keys(root_key(resolved), encode_tokens(PROMPT), PAGE)
    assert [e.key for e in events] == list(keys)
    assert manager.lookup(PROMPT, space).num_cached_tokens == 3 * PAGE
    assert manager.lookup(PROMPT).num_cached_tokens == 0
    manager.check_integrity()


def test_without_model_salt_or_adapter_keys_are_the_namespaces_as_before() -> None:
    manager = Manager(LAYOUT)
    committed(manager, 1, PROMPT, KeySpace(model="", lora="", salt=""))
    events = [e for e in manager.take_events() if isinstance(e, PageStored)]
    assert events[0].parent_key == root_key(KeySpace("default"))
    assert events[0].space == KeySpace("default")


def test_a_key_space_that_is_not_a_keyspace_is_refused() -> None:
    """A str where a KeySpace belongs (the keyword API before KeySpace) would unpack
    into four one-letter parts: refused, never hashed."""
    manager = Manager(LAYOUT)
    with pytest.raises(BadRequest):
        manager.allocate(1, PROMPT, "abcd")  # type: ignore[arg-type]
    with pytest.raises(BadRequest):
        manager.lookup(PROMPT, ("default", "", "", ""))  # type: ignore[arg-type]
    assert 1 not in manager


@pytest.mark.parametrize("field", ["model", "salt", "lora"])
def test_a_key_space_field_over_256_bytes_is_a_bad_request_that_changes_nothing(
    field: str,
) -> None:
    manager = Manager(LAYOUT)
    with pytest.raises(BadRequest):
        manager.allocate(1, PROMPT, KeySpace(**{field: "\u20ac" * 86}))  # 258 bytes
    with pytest.raises(BadRequest):
        manager.lookup(PROMPT, KeySpace(**{field: 7}))  # type: ignore[arg-type]
    assert 1 not in manager and manager.take_events() == []
    manager.check_integrity()


def test_the_memos_never_lend_one_key_spaces_keys_to_another() -> None:
    """The root memo keys on the whole key space and the match memo on the root: a
    lookup in one key space right after another's of the same tokens hashes anew."""
    manager = Manager(LAYOUT)
    committed(manager, 1, PROMPT, KeySpace(salt="u1"))
    for _ in range(2):
        assert manager.lookup(PROMPT, KeySpace(salt="u1")).num_cached_tokens == 3 * PAGE
        assert manager.lookup(PROMPT, KeySpace(salt="u2")).num_cached_tokens == 0
        assert manager.lookup(PROMPT, KeySpace(lora="u1")).num_cached_tokens == 0
        assert manager.lookup(PROMPT, KeySpace(model="u1")).num_cached_tokens == 0
    manager.check_integrity()


# -- lower tiers ----------------------------------------------------------------------


def test_salted_pages_stay_apart_in_the_lower_tiers() -> None:
    """Tier keys derive from prefix keys: a page spilled to the host tier comes back
    for its own model, salt and adapter only."""
    small = KVLayout(1, 1, 4, PAGE, "float32", 4)
    memory = torch.zeros(small.total_bytes, dtype=torch.uint8)
    manager = TieredManager(small, memory, TierStack(HostTier(small, 16)))
    prompt = PROMPT[: 2 * PAGE + 1]
    space = KeySpace(model="m1", lora="a", salt="u1")
    manager.allocate(1, prompt, space)
    manager.commit(1, prompt)
    manager.free(1)
    for i in range(3):  # push the salted pages out of the pool, into the host tier
        other = [500 + i] * (2 * PAGE + 1)
        manager.allocate(10 + i, other)
        manager.commit(10 + i, other)
        manager.free(10 + i)
    assert manager.manager.lookup(prompt, space).num_cached_tokens == 0  # below
    for other in (
        space._replace(salt="u2"),
        space._replace(model="m2"),
        space._replace(model=""),
        space._replace(salt=""),
    ):
        assert manager.lookup(prompt, other).num_cached_tokens == 0
    assert manager.tier_stats()["host"].hits == 0
    assert manager.lookup(prompt, space).num_cached_tokens == 2 * PAGE
    assert manager.tier_stats()["host"].hits == 2
    manager.check_integrity()
    manager.close()


# -- vLLM-format events ---------------------------------------------------------------


def stored_events(space: dict[str, str], tokens: list[int]) -> list[PageStoredEvent]:
    manager = Manager(LAYOUT)
    committed(manager, 1, tokens, KeySpace(**space))
    return [
        PageStoredEvent(
            e.key,
            e.parent_key,
            e.page,
            memoryview(e.tokens).cast("I").tolist(),
            e.space.namespace or "",
            lora=e.space.lora,
            salt=e.space.salt,
            model=e.space.model,
        )
        for e in manager.take_events()
        if isinstance(e, PageStored)
    ]


def vllm_stored(events: list[PageStoredEvent]) -> list[BlockStored]:
    out = to_vllm(EventBatch("default", 1, 1, list(events)), PAGE, "GPU")
    assert all(isinstance(e, BlockStored) for e in out)
    return out  # type: ignore[return-value]


def test_vllm_events_carry_the_adapter_as_lora_name_and_the_salt_on_the_first_block() -> None:
    events = stored_events({"lora": "adapter-a", "salt": "dynamo-cache-salt:u1"}, PROMPT)
    (block,) = vllm_stored(events)
    assert block.lora_name == "adapter-a" and block.parent_block_hash is None
    assert block.extra_keys == [
        ["adapter-a", "dynamo-cache-salt:u1"],
        ["adapter-a"],
        ["adapter-a"],
    ]
    (tail,) = vllm_stored(events[1:])  # a later event of the chain: no salt, a parent
    assert tail.parent_block_hash is not None and tail.extra_keys == [["adapter-a"]] * 2


def test_vllm_events_of_a_salt_alone_and_of_neither() -> None:
    (salted,) = vllm_stored(stored_events({"salt": "u1"}, PROMPT))
    assert salted.lora_name is None and salted.extra_keys == [["u1"], None, None]
    (plain,) = vllm_stored(stored_events({}, PROMPT))
    assert plain.lora_name is None and plain.extra_keys is None


def test_lora_name_of_keeps_namespaces_and_adapters_apart() -> None:
    assert lora_name_of("default", "") is None
    assert lora_name_of("", "") is None
    assert lora_name_of("default", "a") == "a"
    assert lora_name_of("tenant-x", "") == "tenant-x"  # as before adapters existed
    assert lora_name_of("tenant-x", "a") == "tenant-x\0a"
    (block,) = vllm_stored(stored_events({"namespace": "tenant-x", "lora": "a"}, PROMPT))
    assert block.lora_name == "tenant-x\0a" and block.extra_keys == [["tenant-x\0a"]] * 3


def test_vllm_events_keep_models_apart() -> None:
    """A model's pages carry namespace, adapter and model in lora_name (three parts:
    never one of the forms without a model), on every block, the salt on the first."""
    assert lora_name_of("default", "", "m1") == "default\0\0m1"
    assert lora_name_of("tenant-x", "a", "m1") == "tenant-x\0a\0m1"
    (one,) = vllm_stored(stored_events({"model": "m1", "salt": "u1"}, PROMPT))
    (two,) = vllm_stored(stored_events({"model": "m2", "salt": "u1"}, PROMPT))
    assert one.lora_name == "default\0\0m1" and two.lora_name == "default\0\0m2"
    assert one.parent_block_hash is None  # the chain's first block: its root was recognised
    assert one.extra_keys == [["default\0\0m1", "u1"], ["default\0\0m1"], ["default\0\0m1"]]
    assert not set(one.block_hashes) & set(two.block_hashes)


# -- through a real daemon ------------------------------------------------------------

POOL = f"name=default,num_layers=1,num_kv_heads=1,head_dim=4,page_size={PAGE},dtype=float32,num_pages=32"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess.private("--pool", POOL) as d:
        yield d


def test_key_spaces_over_the_wire(daemon: DaemonProcess) -> None:
    """One session commits under a model, a salt and an adapter; another session
    (same namespace) hits only with all three equal."""
    with Client.connect(daemon.endpoint, map_memory=False) as writer:
        writer.allocate(1, PROMPT, KeySpace(model="m1", salt="u1", lora="a"))
        writer.commit(1, PROMPT)
        writer.fork(1, 2)  # the child keeps the key space
        writer.free(1)
        with Client.connect(daemon.endpoint, map_memory=False) as reader:
            space = KeySpace(model="m1", salt="u1", lora="a")
            assert reader.lookup(PROMPT, space).num_cached_tokens == 3 * PAGE
            for other in (
                space._replace(salt="u2"),
                space._replace(lora="b"),
                space._replace(model="m2"),
                space._replace(model=""),
                KeySpace(salt="u1"),
                KeySpace(),
            ):
                assert reader.lookup(PROMPT, other).num_cached_tokens == 0
            hit = reader.allocate(3, PROMPT, space)
            assert hit.num_cached_tokens == 3 * PAGE
            assert reader.allocate(4, PROMPT, space._replace(model="m2")).num_cached_tokens == 0
            batch = reader.batch()
            batch.lookup(PROMPT, space)
            batch.lookup(PROMPT, space._replace(salt="u2"))
            batch.allocate(5, PROMPT, space)
            hits = batch.run()
            assert [hits[0].num_cached_tokens, hits[1].num_cached_tokens] == [3 * PAGE, 0]
            assert hits[2].num_cached_tokens == 3 * PAGE
            for seq in (3, 4, 5):
                reader.free(seq)
        writer.free(2)


def test_over_long_key_space_fields_are_bad_requests_on_the_wire(daemon: DaemonProcess) -> None:
    with Client.connect(daemon.endpoint, map_memory=False) as client:
        with pytest.raises(BadRequest):
            client.allocate(9, PROMPT, KeySpace(salt="\u20ac" * 86))  # 86 chars, 258 bytes
        with pytest.raises(BadRequest):
            client.lookup(PROMPT, KeySpace(model="\u20ac" * 86))
        with pytest.raises(BadRequest):
            client.lookup(PROMPT, KeySpace(lora="x" * 257))  # over the schema's bound
        assert client.lookup(PROMPT, KeySpace(salt="\u20ac" * 85)).num_cached_tokens == 0
