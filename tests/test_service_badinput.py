"""Bad input over the wire: each gets a typed error (or is dropped and counted), the daemon
keeps serving, and the pool's invariants still hold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_ipc.messages import ERROR_CODES, OP_NAMES

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.layout import KVLayout

LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16", num_pages=32
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp: Path = tmp_path_factory.mktemp("badinput")
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp / 'd.sock'}",
        "--max-frame-bytes",
        "4096",
        "--max-batch",
        "16",
        "--allow-ephemeral",
        "--pool",
        "num_pages=8",
    ) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with Client.connect(
        daemon.endpoint, pool="victim", layout=LAYOUT, ephemeral=True, map_memory=False
    ) as c:
        yield c


@pytest.fixture(scope="module")
def raw(daemon: DaemonProcess) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    yield sock
    sock.close()


def ask(sock: zmq.Socket[bytes], frame: bytes) -> dict[str, Any]:
    sock.send(frame)
    assert sock.poll(5000), "the daemon did not answer"
    reply = msgpack.unpackb(sock.recv(), strict_map_key=False)
    assert isinstance(reply, dict) and isinstance(reply.get("id"), int), reply
    assert ("result" in reply) != ("error" in reply), reply
    if "error" in reply:
        assert reply["error"]["code"] in ERROR_CODES, reply
    return reply


def code_of(reply: dict[str, Any]) -> str | None:
    return reply["error"]["code"] if "error" in reply else None


def pack(
    body: dict[str, Any], client: Client | None = None, request_id: int = 7, **env: Any
) -> bytes:
    envelope: dict[str, Any] = {"id": request_id, "body": body}
    if client is not None:
        envelope |= {"session": client.session, "epoch": client.epoch}
    return msgpack.packb(envelope | env)


def healthy(client: Client) -> None:
    client.check_integrity()
    stats = client.stats()
    assert stats.free_pages + stats.evictable_pages + stats.held_pages == stats.total_pages


def test_each_bad_request_gets_its_typed_error(client: Client, raw: zmq.Socket[bytes]) -> None:
    valid = pack({"op": "extend", "seq": 1, "num_tokens": 1}, client)
    cases: list[tuple[bytes, str, int]] = [
        (b"\xc1\xc1garbage", "bad_request", 0),
        (b"", "bad_request", 0),
        (valid[:-4], "bad_request", 0),  # truncated
        (msgpack.packb({"id": 3, "pad": b"x" * 5000}), "bad_request", 0),  # over 4096 bytes
        (pack({"op": "extend", "seq": "one", "num_tokens": 1}, client), "bad_request", 7),
        (pack({"op": "extend", "seq": 1, "num_tokens": -1}, client), "bad_request", 7),
        (pack({"op": "allocate", "seq": 1, "tokens": [1 << 32]}, client), "bad_request", 7),
        (pack({"op": "allocate", "seq": 1}, client), "bad_request", 7),  # missing field
        (pack({"op": "lookup", "tokens": [1], "namespace": "n" * 300}, client), "bad_request", 7),
        (pack({"op": "teleport", "seq": 1}, client), "unknown_op", 7),
        (pack({"op": "attach", "version": 1}), "version_mismatch", 7),  # v1: no model part
        (pack({"op": "extend", "seq": 1, "num_tokens": 1}), "not_attached", 7),
        (pack({"op": "extend", "seq": 1, "num_tokens": 1}, client, epoch=12345), "stale_epoch", 7),
        (pack({"op": "extend", "seq": 1, "num_tokens": 1}, client, session=99), "not_attached", 7),
        (pack({"op": "extend", "seq": 424242, "num_tokens": 1}, client), "unknown_sequence", 7),
        (pack({"op": "free", "seq": 424242}, client), "unknown_sequence", 7),
        (pack({"op": "batch", "ops": [{"op": "free", "seq": 1}] * 17}, client), "bad_request", 7),
        (msgpack.packb([1, 2, 3]), "bad_request", 0),
        (msgpack.packb("just a string"), "bad_request", 0),
    ]
    before = client.stats()
    for frame, code, request_id in cases:
        reply = ask(raw, frame)
        assert (code_of(reply), reply["id"]) == (code, request_id), (frame[:60], reply)
    assert client.stats() == before  # nothing changed
    healthy(client)


def test_double_free_and_batches_with_a_bad_op(client: Client, raw: zmq.Socket[bytes]) -> None:
    client.allocate(50, [1, 2, 3])
    client.free(50)
    assert code_of(ask(raw, pack({"op": "free", "seq": 50}, client))) == "unknown_sequence"
    # an op that does not decode: the whole batch is refused, nothing runs
    undecodable = pack(
        {
            "op": "batch",
            "ops": [
                {"op": "allocate", "seq": 51, "tokens": [1]},
                {"op": "extend", "seq": 51, "num_tokens": "x"},
            ],
        },
        client,
    )
    assert code_of(ask(raw, undecodable)) == "bad_request"
    assert 51 not in _live(client, [51])
    # an op that fails when it runs: the ops before it stay done, the rest does not run
    failing = pack(
        {
            "op": "batch",
            "ops": [
                {"op": "allocate", "seq": 52, "tokens": [1, 2]},
                {"op": "free", "seq": 999},
                {"op": "allocate", "seq": 53, "tokens": [1]},
            ],
        },
        client,
    )
    reply = ask(raw, failing)
    assert reply["result"]["error"]["code"] == "unknown_sequence"
    assert len(reply["result"]["results"]) == 1 and reply["result"]["results"][0]["pages"]
    assert _live(client, [52, 53]) == [52]
    client.free(52)
    healthy(client)


def _live(client: Client, seqs: list[int]) -> list[int]:
    live = []
    for seq in seqs:
        try:
            client.num_tokens(seq)
            live.append(seq)
        except Exception:
            pass
    return live


def test_unaddressable_frames_are_dropped_and_counted(
    client: Client, raw: zmq.Socket[bytes]
) -> None:
    before = client.daemon_stats().counters.dropped_frames
    raw.send_multipart([b"one", b"two"])  # the ROUTER sees [identity, one, two]
    raw.send_multipart([b"a", b"b", b"c"])
    assert ask(raw, pack({"op": "stats"}))["id"] == 7  # still serving, in order
    assert client.daemon_stats().counters.dropped_frames == before + 2


MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = st.dictionaries(
    st.sampled_from(
        [
            "seq",
            "tokens",
            "num_tokens",
            "parent",
            "child",
            "namespace",
            "ops",
            "version",
            "pool",
            "layout",
            "ephemeral",
        ]
    ),
    MSGPACK_VALUES | st.lists(st.integers(0, 40), max_size=6) | st.integers(0, 60),
    max_size=4,
)
OPS = st.sampled_from([*sorted(OP_NAMES - {"detach"}), "bogus"])


@st.composite
def frames(draw: st.DrawFn, session: int, epoch: int) -> bytes:
    kind = draw(st.sampled_from(["bytes", "value", "request"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "value":
        return msgpack.packb(draw(MSGPACK_VALUES))
    body = {"op": draw(OPS), **draw(FIELDS)}
    envelope = {
        "id": draw(st.integers(0, 1 << 20)),
        "body": body,
        "session": session,
        "epoch": epoch,
    }
    if draw(st.booleans()):
        del envelope[draw(st.sampled_from(sorted(envelope)))]
    return msgpack.packb(envelope)


def test_generated_frames_get_typed_replies_and_change_no_invariant(
    client: Client, raw: zmq.Socket[bytes]
) -> None:
    @settings(max_examples=300, deadline=None)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        frame = data.draw(frames(client.session, client.epoch))
        ask(raw, frame)

    run()
    healthy(client)
    assert client.daemon_stats().counters.requests > 300


@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k"])  # 1-element arrays, 1-entry maps
def test_deeply_nested_frame_is_a_bad_request_not_a_crash(opener: bytes) -> None:
    """Nesting deeper than Python's recursion limit once killed the daemon's decoder."""
    from kvcore_ipc.codec import FrameError, ServerCodec

    frame = b"\x82\xa2id\x01\xa4body" + opener * 200_000 + b"\xc0"
    with pytest.raises(FrameError) as info:
        ServerCodec().decode_request(frame)
    assert info.value.code == "bad_request"
