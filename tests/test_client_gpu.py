"""GPU pools: the daemon allocates a cuda:N pool and exports it with CUDA IPC; clients in
other processes open it by GPU UUID and share the bytes. Skipped without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

POOL = "name=gpu,device=cuda:0,num_layers=2,num_kv_heads=2,head_dim=64,page_size=16,dtype=float16,num_pages=64"

ENGINE = r"""
import json, sys
import torch
from kvcore import Client
role, endpoint = sys.argv[1], sys.argv[2]
client = Client.connect(endpoint, pool="gpu")
cache = client.kv_caches[1]
assert cache.is_cuda and cache.shape == (64, 2, 16, 2, 64), cache.shape
prompt = list(range(40))
if role == "writer":
    alloc = client.allocate(1, prompt)
    for i, page in enumerate(alloc.pages):
        cache[page].fill_(float(i + 1))
    torch.cuda.synchronize()
    client.commit(1, prompt)
    print(json.dumps({"pages": alloc.pages}), flush=True)
    sys.stdin.readline()  # keep the sequence until the reader has looked
else:
    alloc = client.allocate(2, prompt)
    hits = alloc.num_cached_tokens // 16
    values = [cache[p].float().mean().item() for p in alloc.pages[:hits]]
    print(json.dumps({"pages": alloc.pages, "hits": hits, "values": values}), flush=True)
client.close()
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from kvcore.daemon_process import DaemonProcess

    tmp: Path = tmp_path_factory.mktemp("gpu")
    with DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", "--pool", POOL) as d:
        yield d


def test_gpu_pool_is_shared_across_processes_by_cuda_ipc(daemon: object) -> None:
    endpoint: str = daemon.endpoint  # type: ignore[attr-defined]
    writer = subprocess.Popen(
        [sys.executable, "-c", ENGINE, "writer", endpoint],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert writer.stdout is not None and writer.stdin is not None
    written = json.loads(writer.stdout.readline())
    read = subprocess.run(
        [sys.executable, "-c", ENGINE, "reader", endpoint],
        text=True,
        capture_output=True,
        timeout=120,
    )
    writer.communicate("done\n", timeout=60)
    assert read.returncode == 0, read.stderr
    result = json.loads(read.stdout)
    assert result["hits"] == 2 and result["pages"][:2] == written["pages"][:2]
    assert result["values"] == [1.0, 2.0]


SPEC_READER = r"""
import json, sys
import msgpack, zmq
import cupy  # opens the handle with cudaIpcOpenMemHandle: no torch, no rebuild path

endpoint, page, fill = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(endpoint)
sock.send(msgpack.packb({"id": 1, "session": 0, "epoch": 0, "body": {"op": "attach",
          "version": 4, "pool": "gpu", "namespace": "spec"}}))
assert sock.poll(30000), "no reply"
ok = msgpack.unpackb(sock.recv())["result"]
memory, layout = ok["memory"], ok["layout"]
assert memory["kind"] == "cuda" and len(memory["handle"]) == 64, len(memory["handle"])
base = cupy.cuda.runtime.ipcOpenMemHandle(memory["handle"])
S, H, D = layout["page_size"], layout["num_kv_heads"], layout["head_dim"]
page_elems = 2 * S * H * D
ptr = base + memory["offset"] + (layout["num_pages"] + page) * page_elems * 2  # layer 1, fp16
mem = cupy.cuda.UnownedMemory(ptr, page_elems * 2, None)
values = cupy.ndarray((page_elems,), cupy.float16, cupy.cuda.MemoryPointer(mem, 0))
print(json.dumps({"mean": float(values.astype(cupy.float32).mean()), "fill": fill}))
"""


def test_a_spec_only_client_opens_the_raw_64_byte_handle(daemon: object) -> None:
    """spec/protocol.md's CudaMemory read by plain msgpack and opened by CuPy's
    cudaIpcOpenMemHandle: the handle is the raw 64 bytes at the right offset."""
    pytest.importorskip("cupy")
    endpoint: str = daemon.endpoint  # type: ignore[attr-defined]
    writer = subprocess.Popen(
        [sys.executable, "-c", ENGINE, "writer", endpoint],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert writer.stdout is not None and writer.stdin is not None
    written = json.loads(writer.stdout.readline())
    page = written["pages"][1]
    read = subprocess.run(
        [sys.executable, "-c", SPEC_READER, endpoint, str(page), "2.0"],
        text=True,
        capture_output=True,
        timeout=120,
    )
    writer.communicate("done\n", timeout=60)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout)["mean"] == 2.0
