"""kvcore events in vLLM's KV-event format: frames, decoding by vLLM's own structs, replay."""

from __future__ import annotations

import zmq
from kvcore_ipc.vllm_events import VllmEventPublisher, block_hash
from vllm_events_helpers import batch, chain, removed


def test_the_block_hash_is_the_low_64_bits_of_the_page_key() -> None:
    key = chain([1, 2, 3, 4], 4)[0].key  # spec/hashing.md's first vector
    assert key.hex() == "152c2a912d40b0a95101684912837768a1c4e55ab68da2524df427af941ca8d0"
    assert block_hash(key) == 0x4DF427AF941CA8D0 == 5617158270295517392  # spec/vllm-events.md


def subscriber(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def joined(sock: zmq.Socket[bytes], publisher: VllmEventPublisher) -> None:
    """Wait out ZeroMQ's slow joiner: publish AllBlocksCleared until one arrives, then
    drain the copies, so the next message published is the next one received."""
    for _ in range(100):
        publisher.cleared()
        if sock.poll(50):
            break
    else:
        raise AssertionError("the subscriber never joined")
    while sock.poll(200):
        sock.recv_multipart()


def test_frames_are_vllms_and_vllm_decodes_the_batch() -> None:
    import pytest

    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed")
    tokens = list(range(100, 112))
    stored = chain(tokens, 4)
    pub = VllmEventPublisher("tcp://127.0.0.1:*", page_size=4, medium="CPU", topic="kv")
    sub = subscriber(pub.endpoint)
    try:
        joined(sub, pub)
        pub.publish(batch(stored))
        topic, seq, payload = sub.recv_multipart()
        decoded = msgspec_decode(kv_events.KVEventBatch, payload)
        assert topic == b"kv" and len(seq) == 8
        (event,) = decoded.events
        assert isinstance(event, kv_events.BlockStored)  # one event for the whole chain
        assert event.block_hashes == [block_hash(e.key) for e in stored]
        assert event.parent_block_hash is None  # the chain starts at the namespace root
        assert event.token_ids == tokens and event.block_size == 4 and event.medium == "CPU"
        assert event.lora_name is None
        pub.publish(batch([removed(stored[2])]))
        _, seq2, payload = sub.recv_multipart()
        assert int.from_bytes(seq2, "big") == int.from_bytes(seq, "big") + 1
        (gone,) = msgspec_decode(kv_events.KVEventBatch, payload).events
        assert isinstance(gone, kv_events.BlockRemoved)
        assert gone.block_hashes == [block_hash(stored[2].key)]
        pub.publish(batch(chain(tokens, 4, namespace="tenant-a"), epoch=8))  # a new epoch
        _, _, payload = sub.recv_multipart()
        assert isinstance(
            msgspec_decode(kv_events.KVEventBatch, payload).events[0], kv_events.AllBlocksCleared
        )
        _, _, payload = sub.recv_multipart()
        (other,) = msgspec_decode(kv_events.KVEventBatch, payload).events
        assert other.lora_name == "tenant-a" and other.block_hashes[0] != event.block_hashes[0]
    finally:
        sub.close(linger=0)
        pub.close()


def msgspec_decode(kind: type, payload: bytes) -> object:
    import msgspec

    return msgspec.msgpack.decode(payload, type=kind)


def replayed(pub: VllmEventPublisher, start: int) -> list[int]:
    """The numbers of the messages the replay socket resends from ``start`` on."""
    assert pub.replay_endpoint is not None
    req: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(pub.replay_endpoint)
    try:
        req.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert req.poll(5000)
            _, _topic, seq, _payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return got
            got.append(int.from_bytes(seq, "big"))
    finally:
        req.close(linger=0)


def test_the_replay_socket_resends_from_a_sequence_number() -> None:
    pub = VllmEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", page_size=4)
    try:
        stored = chain(list(range(40)), 4)
        for event in stored:  # ten batches, numbered on from the first
            pub.publish(batch([event]))
        every = replayed(pub, 0)
        assert every == list(range(every[0], every[0] + 10))
        assert replayed(pub, every[7]) == every[7:]
    finally:
        pub.close()


def test_a_restarted_publisher_numbers_on_above_the_last_one() -> None:
    """Its subscribers drop numbers they have seen as stale (Dynamo's indexer does): a
    restarted daemon that counted from 0 again went unheard, its AllBlocksCleared too."""
    first = VllmEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", page_size=4)
    try:
        for event in chain(list(range(40)), 4):
            first.publish(batch([event]))
        last = replayed(first, 0)[-1]
    finally:
        first.close()
    second = VllmEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", page_size=4)
    try:
        second.cleared()  # a daemon's start
        assert replayed(second, 0)[0] > last
    finally:
        second.close()


def test_vllm_decodes_an_adapters_salted_chain_as_it_publishes_one() -> None:
    """A chain with a LoRA adapter and a cache salt: vLLM's own structs read the
    adapter as ``lora_name`` and, per block, ``extra_keys`` as vLLM fills them (the
    adapter on every block, the salt on the chain's first block only)."""
    import pytest

    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed")
    from kvcore_ipc.messages import EventBatch, PageStoredEvent
    from kvcore_ipc.vllm_events import VllmEventBatch, root_key, to_vllm
    from vllm_events_helpers import page_key

    parent, stored = root_key("default", "", "adapter-a", "u1"), []
    for i in range(3):
        page = list(range(4 * i, 4 * i + 4))
        key = page_key(parent, page)
        stored.append(PageStoredEvent(key, parent, i, page, "default", lora="adapter-a", salt="u1"))
        parent = key
    events = to_vllm(EventBatch("default", 1, 1, list(stored)), 4, "GPU")
    payload = msgspec_encode(VllmEventBatch(0.0, events))
    (event,) = msgspec_decode(kv_events.KVEventBatch, payload).events  # type: ignore[attr-defined]
    assert isinstance(event, kv_events.BlockStored)
    assert event.lora_name == "adapter-a" and event.parent_block_hash is None
    assert [list(k) if k else k for k in event.extra_keys] == [
        ["adapter-a", "u1"],
        ["adapter-a"],
        ["adapter-a"],
    ]


def msgspec_encode(value: object) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(value)
