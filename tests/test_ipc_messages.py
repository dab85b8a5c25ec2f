"""kvcore_ipc on its own: typed messages, the codec's refusals, the schema, the layering."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_ipc import messages as msg
from kvcore_ipc.codec import ClientCodec, FrameError, ServerCodec
from kvcore_ipc.memory import HostRegion

from kvcore.errors import ERRORS

SPEC = Path(__file__).resolve().parents[1] / "spec"


def test_schema_file_is_in_sync_with_the_structs() -> None:
    on_disk = json.loads((SPEC / "protocol.schema.json").read_text())
    assert on_disk == json.loads(json.dumps(msg.json_schema())), (
        "spec/protocol.schema.json is stale: python -m kvcore_ipc.messages > spec/protocol.schema.json"
    )


def test_spec_documents_every_op_and_error_code() -> None:
    text = (SPEC / "protocol.md").read_text()
    for name in msg.OP_NAMES | set(msg.ERROR_CODES):
        assert f"`{name}`" in text, f"spec/protocol.md does not mention `{name}`"


def test_error_codes_match_kvcore_errors() -> None:
    assert set(msg.ERROR_CODES) == set(ERRORS)


def test_kvcore_ipc_imports_nothing_of_kvcore() -> None:
    code = (
        "import sys, kvcore_ipc.messages, kvcore_ipc.codec, kvcore_ipc.server, "
        "kvcore_ipc.channel, kvcore_ipc.memory, kvcore_ipc.shm, kvcore_ipc.cuda_ipc, "
        "kvcore_ipc.sockets, kvcore_ipc.events, kvcore_ipc.vllm_events\n"
        "bad = sorted(m for m in sys.modules if m == 'kvcore' or m.startswith('kvcore.') or m == 'torch')\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


U64 = st.integers(0, (1 << 64) - 1)
TOKENS = st.lists(st.integers(0, (1 << 32) - 1), max_size=40)
BODIES = st.one_of(
    st.builds(msg.Allocate, U64, TOKENS, st.none() | st.text(max_size=8)),
    st.builds(msg.Extend, U64, st.integers(0, 1 << 40)),
    st.builds(msg.Commit, U64, TOKENS),
    st.builds(msg.Fork, U64, U64),
    st.builds(msg.Free, U64),
    st.builds(msg.Lookup, TOKENS),
    st.builds(msg.BlockTable, U64),
    st.builds(msg.NumTokens, U64),
    st.just(msg.Heartbeat()),
    st.just(msg.Detach()),
    st.just(msg.GetStats()),
    st.just(msg.Check()),
)


@settings(max_examples=150, deadline=None)
@given(request_id=U64, body=BODIES, session=U64, epoch=U64)
def test_requests_round_trip(request_id: int, body: msg.Op, session: int, epoch: int) -> None:
    request = msg.Request(request_id, body, session, epoch)
    frame = ClientCodec().encode(request)
    assert ServerCodec().decode_request(frame) == request
    # ... and a plain msgpack library reads the same map (what spec/ promises)
    plain = msgpack.unpackb(frame)
    assert plain["id"] == request_id and plain["body"]["op"] == body.__struct_config__.tag


def _error(frame: bytes, codec: ServerCodec | None = None) -> FrameError:
    with pytest.raises(FrameError) as info:
        (codec or ServerCodec()).decode_request(frame)
    return info.value


def test_codec_refusals_carry_codes_and_salvaged_ids() -> None:
    assert _error(b"\xc1garbage").code == "bad_request"
    assert _error(b"").code == "bad_request"
    full = msgpack.packb({"id": 9, "body": {"op": "extend", "seq": 1, "num_tokens": 2}})
    assert _error(full[:-3]).code == "bad_request"  # truncated
    unknown = _error(msgpack.packb({"id": 7, "body": {"op": "teleport", "seq": 1}}))
    assert (unknown.code, unknown.request_id) == ("unknown_op", 7)
    wrong = _error(
        msgpack.packb({"id": 8, "body": {"op": "extend", "seq": "one", "num_tokens": 2}})
    )
    assert (wrong.code, wrong.request_id) == ("bad_request", 8)
    negative = _error(
        msgpack.packb({"id": 3, "body": {"op": "extend", "seq": 1, "num_tokens": -1}})
    )
    assert (negative.code, negative.request_id) == ("bad_request", 3)
    assert _error(msgpack.packb([1, 2, 3])).code == "bad_request"
    oversized = ServerCodec(max_frame_bytes=1024)
    big = msgpack.packb({"id": 4, "body": {"op": "lookup", "tokens": list(range(2000))}})
    assert "at most 1024" in _error(big, oversized).message
    batch = msgpack.packb({"id": 5, "body": {"op": "batch", "ops": [{"op": "free", "seq": 1}] * 9}})
    too_many = _error(batch, ServerCodec(max_batch=8))
    assert (too_many.code, too_many.request_id) == ("bad_request", 5)


def test_unknown_fields_are_ignored_and_missing_defaults_filled() -> None:
    """Schema evolution: a newer peer's extra field decodes; an older peer's omission too."""
    frame = msgpack.packb(
        {"id": 1, "body": {"op": "allocate", "seq": 2, "tokens": [1], "future": 1}, "trace": "x"}
    )
    request = ServerCodec().decode_request(frame)
    assert request.body == msg.Allocate(2, [1], None) and request.session == 0


def test_error_reply_shape() -> None:
    reply = msgpack.unpackb(ServerCodec().encode_error(3, "forbidden", "not yours"))
    assert reply == {"id": 3, "error": {"code": "forbidden", "message": "not yours"}}
    ok = msgpack.unpackb(ServerCodec().encode_result(4, msg.ExtendOk([5], [(1, 2)])))
    assert ok == {"id": 4, "result": {"new_pages": [5], "copies": [[1, 2]]}}
    typed = ClientCodec().decode_reply(
        msgspec.msgpack.encode(msg.Reply(4, msg.ExtendOk([5], [(1, 2)]))), msg.ExtendOk
    )
    assert typed.result == msg.ExtendOk([5], [(1, 2)])


def test_host_region_shares_bytes_and_unlinks() -> None:
    owner = HostRegion.create(4096)
    other = HostRegion.attach(owner.describe())
    owner.buffer()[10:14] = b"kvkv"
    assert bytes(other.buffer()[10:14]) == b"kvkv"
    name = owner.name
    other.close()
    owner.close()
    assert not (Path("/dev/shm") / name).exists()
    with pytest.raises(FileNotFoundError):
        HostRegion.attach(msg.HostMemory(name=name, size=4096))


def test_host_region_maps_from_the_exported_offset() -> None:
    """spec/protocol.md: a host pool is `size` bytes at `offset` into the shm segment."""
    from kvcore_ipc.memory import HostRegion
    from kvcore_ipc.messages import HostMemory

    owner = HostRegion.create(4096)
    try:
        owner.buffer()[:] = bytes(range(256)) * 16
        view = HostRegion.attach(HostMemory(name=owner.name, size=100, offset=1000))
        assert bytes(view.buffer()) == (bytes(range(256)) * 16)[1000:1100]
        assert view.describe() == HostMemory(name=owner.name, size=100, offset=1000)
        view.close()
    finally:
        owner.close()
