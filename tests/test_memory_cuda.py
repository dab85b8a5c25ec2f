"""CUDA IPC bytes on the CPU: what the daemon puts on the wire for a ``cuda`` pool (the
64-byte ``cudaIpcMemHandle_t`` spec/protocol.md promises, not torch's versioned share
handle), what an importer hands torch, and that a pool is exported once.

torch's share handle (c10 CUDACachingAllocator::shareIpcHandle) is
``[version][b"c"][64-byte cudaIpcMemHandle_t]`` for a cudaMalloc block and
``[version][b"e"][pid, sizes, fds...]`` for an expandable segment; its importer takes a
handle of exactly 64 bytes as a raw cudaMalloc handle. The GPU half (a spec-only
process opening the handle) is in tests/test_client_gpu.py.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import msgspec
import pytest
from kvcore_ipc.memory import (
    CUDA_IPC_HANDLE_SIZE,
    CudaRegion,
    cuda_memory_from_share,
    ipc_mem_handle,
    new_shared_cuda_args,
)
from kvcore_ipc.messages import CudaMemory

MEM_HANDLE = bytes(range(0x40, 0x40 + CUDA_IPC_HANDLE_SIZE))  # distinct bytes: a shift shows
EVENT_HANDLE = bytes(range(0x80, 0x80 + CUDA_IPC_HANDLE_SIZE))
UUID = "5a1e0c2d-0000-1111-2222-333344445555"


def torch_share(
    handle: bytes, event: bytes | None = None, size: int = 4096, offset: int = 512
) -> tuple[Any, ...]:
    """What ``UntypedStorage._share_cuda_()`` returns (event handle None when no sync)."""
    return (0, handle, size, offset, b"/torch_123_456_0", 7, event, event is not None)


def versioned(version: int, kind: bytes, payload: bytes = MEM_HANDLE) -> bytes:
    return bytes([version]) + kind + payload


@pytest.mark.parametrize("version", [1, 2, 3, 200])
def test_the_wire_handle_is_the_raw_64_bytes_of_any_torch_version(version: int) -> None:
    assert ipc_mem_handle(versioned(version, b"c")) == MEM_HANDLE
    assert ipc_mem_handle(MEM_HANDLE) == MEM_HANDLE  # torch < 2.2 already sent it raw


def test_an_expandable_segment_is_refused_by_name() -> None:
    fds = (12345).to_bytes(4, "little") + (1 << 21).to_bytes(8, "little") + b"\x03\x00"
    with pytest.raises(ValueError, match="expandable"):
        ipc_mem_handle(versioned(2, b"e", fds))
    with pytest.raises(ValueError, match="expandable"):
        cuda_memory_from_share(torch_share(versioned(2, b"e", MEM_HANDLE)), UUID, 4096)


@pytest.mark.parametrize(
    "handle",
    [b"", b"\x02c", versioned(2, b"c", MEM_HANDLE[:63]), versioned(2, b"x"), MEM_HANDLE + b"\x00"],
)
def test_malformed_torch_handles_are_refused(handle: bytes) -> None:
    with pytest.raises(ValueError):
        ipc_mem_handle(handle)


def test_a_spec_only_decoder_reads_the_handle_at_the_right_offset() -> None:
    memory = cuda_memory_from_share(torch_share(versioned(3, b"c"), EVENT_HANDLE), UUID, 4096)
    wire = msgpack.unpackb(msgspec.msgpack.encode(memory))  # plain msgpack, no kvcore types
    assert wire["kind"] == "cuda" and wire["device_uuid"] == "GPU-" + UUID
    assert isinstance(wire["handle"], bytes) and len(wire["handle"]) == 64
    assert wire["handle"] == MEM_HANDLE  # byte 0 of the wire handle is byte 0 of the handle
    assert (wire["size"], wire["offset"]) == (4096, 512)
    assert wire["event_handle"] == EVENT_HANDLE and wire["event_sync_required"] is True


def test_no_event_is_sent_as_empty_bytes_without_sync() -> None:
    memory = cuda_memory_from_share(torch_share(versioned(2, b"c"), None), UUID, 4096)
    assert memory.event_handle == b"" and memory.event_sync_required is False


def test_a_partial_storage_is_refused() -> None:
    with pytest.raises(ValueError, match="whole storage"):
        cuda_memory_from_share(torch_share(versioned(2, b"c"), size=2048), UUID, 4096)


def _torch_accepts(args: tuple[Any, ...]) -> bool:
    """THPStorage_newSharedCuda's argument check (else TypeError "_new_shared in CUDA
    mode"): int device, bytes handle, int size, int offset, bytes ref counter, int ref
    offset, bytes event handle, bool sync."""
    kinds = (int, bytes, int, int, bytes, int, bytes, bool)
    return len(args) == 8 and all(type(a) is k for a, k in zip(args, kinds, strict=True))


def test_an_empty_event_handle_imports_as_bytes_not_none() -> None:
    memory = CudaMemory(device_uuid="GPU-" + UUID, handle=MEM_HANDLE, size=4096, offset=0)
    args = new_shared_cuda_args(memory, 1)
    assert _torch_accepts(args), args
    assert args[0] == 1 and args[1] == MEM_HANDLE and args[6] == b"" and args[7] is False


def test_a_full_export_round_trips_into_torch_arguments() -> None:
    memory = cuda_memory_from_share(torch_share(versioned(3, b"c"), EVENT_HANDLE), UUID, 4096)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(memory), type=CudaMemory)
    args = new_shared_cuda_args(decoded, 0)
    assert _torch_accepts(args)
    assert args == (0, MEM_HANDLE, 4096, 512, b"/torch_123_456_0", 7, EVENT_HANDLE, True)


@pytest.mark.parametrize(
    "fields",
    [
        {"handle": versioned(2, b"c")},
        {"handle": MEM_HANDLE[:32]},
        {"handle": MEM_HANDLE, "event_sync_required": True},
    ],
)
def test_malformed_messages_are_refused_before_torch(fields: dict[str, Any]) -> None:
    memory = CudaMemory(device_uuid="GPU-" + UUID, size=4096, offset=0, **fields)
    with pytest.raises(ValueError):
        new_shared_cuda_args(memory, 0)


def test_a_pool_is_exported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``_share_cuda_`` call takes a ref-counter slot and an interprocess event for
    the storage's life: create exports once, describe hands out that export."""
    torch = pytest.importorskip("torch")
    calls = []

    class Storage:
        def _share_cuda_(self) -> tuple[Any, ...]:
            calls.append(1)
            return torch_share(versioned(2, b"c"), size=4096)

    class Tensor:
        device = "cuda:0"

        def untyped_storage(self) -> Storage:
            return Storage()

        def storage_offset(self) -> int:
            return 0

    monkeypatch.setattr(torch, "zeros", lambda *a, **k: Tensor())
    props = types.SimpleNamespace(uuid=UUID)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    region = CudaRegion.create(4096, "cuda:0")
    first = region.describe()
    assert all(region.describe() is first for _ in range(5)) and len(calls) == 1
    assert first.handle == MEM_HANDLE


def test_pools_are_allocated_outside_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    settings: list[str] = []
    seen: list[list[str]] = []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append)

    def zeros(*args: Any, **kwargs: Any) -> Any:
        seen.append(list(settings))
        raise RuntimeError("stop after the allocation")

    monkeypatch.setattr(torch, "zeros", zeros)
    with pytest.raises(RuntimeError, match="stop"):
        CudaRegion.create(4096, "cuda:0")
    assert seen == [["expandable_segments:False"]]
    assert settings == ["expandable_segments:False", "expandable_segments:True"]


def test_free_waits_for_the_engines_stream_before_the_daemon_has_the_pages(
    tmp_path: Path,
) -> None:
    """A freed page may go to another process at once: on a CUDA pool the client waits for
    the kernels queued on its stream (which may still read the page) before it sends
    ``free``, a batch holding a ``free``, or the ``detach`` of close."""
    from kvcore import Client
    from kvcore.daemon_process import DaemonProcess

    log: list[str] = []

    class Recording(CudaRegion):
        __slots__ = ()

        def wait_for_stream(self) -> None:
            log.append("wait")

        def close(self) -> None:
            pass

    with DaemonProcess(
        "--endpoint", f"ipc://{tmp_path / 'd.sock'}", "--pool", "num_pages=8,num_layers=1"
    ) as daemon:
        client = Client.connect(daemon.endpoint)
        host, client._region = client._region, Recording(None, 0)  # type: ignore[arg-type]
        channel = client._channel

        class Logged:
            def send(self, frame: bytes) -> None:
                body = msgpack.unpackb(frame)["body"]
                ops = [o["op"] for o in body["ops"]] if body["op"] == "batch" else [body["op"]]
                log.append("+".join(ops))
                channel.send(frame)

            def __getattr__(self, name: str) -> Any:
                return getattr(channel, name)

        client._channel = Logged()  # type: ignore[assignment]
        client.allocate(1, list(range(20)))
        client.allocate(2, list(range(40, 60)))
        client.free(1)
        with client.batch() as batch:
            batch.extend(2, 1)
        with client.batch() as batch:
            batch.extend(2, 1)
            batch.free(2)
        client.close()
        assert host is not None
        host.close()
    assert " ".join(log) == "allocate allocate wait free extend wait extend+free wait detach"
