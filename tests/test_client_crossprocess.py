"""Two engine processes, one daemon: K/V written by one are read by the other through a
prefix hit, zero-copy, each through its own mapping of the pool; for an fp8 pool and a
latent (MLA) pool too, whose mapped views have the layout's dtype and shape and whose
bytes (fp8 NaN and infinity patterns included) cross unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvcore import Client
from kvcore.daemon_process import DaemonProcess

POOL = "name=kv,num_layers=3,num_kv_heads=2,head_dim=8,page_size=4,dtype=float32,num_pages=32"
FP8_POOL = "name=fp8,num_layers=2,num_kv_heads=2,head_dim=8,page_size=4,dtype=float8_e4m3fn"
LATENT_POOL = "name=latent,kind=latent,num_layers=2,num_kv_heads=1,head_dim=24,page_size=4"

ENGINE = r"""
import json, sys
import torch
from kvcore import Client

role, endpoint, pool = sys.argv[1], sys.argv[2], sys.argv[3]
prompt = list(range(1000, 1018))  # 4 full pages of 4 tokens + 2 tokens
client = Client.connect(endpoint, pool=pool, namespace="shared-ns")
layout = client.layout

def expected(layer, page_index):
    if layout.dtype != "float32":  # every byte value: fp8 NaNs (0x7F, 0xFF) and infinities
        data = (torch.arange(layout.page_bytes_per_layer) + 31 * layer + 7 * page_index) % 256
        return data.to(torch.uint8).view(layout.torch_dtype()).view(layout.page_shape)
    # K/V of one page as a function of (layer, token position, head, dim): no page ids in it
    pos = torch.arange(page_index * layout.page_size, (page_index + 1) * layout.page_size)
    head = torch.arange(layout.num_kv_heads).view(1, -1, 1)
    dim = torch.arange(layout.head_dim).view(1, 1, -1)
    k = layer * 1000.0 + pos.view(-1, 1, 1) * 10.0 + head + dim / 100.0
    return torch.stack([k, -k])

if role == "writer":
    alloc = client.allocate(1, prompt)
    assert alloc.num_cached_tokens == 0, alloc
    for layer, cache in enumerate(client.kv_caches):
        for i, page in enumerate(alloc.pages):
            cache[page] = expected(layer, i)
    published = client.commit(1, prompt)
    client.free(1)  # committed pages stay cached (evictable) after the writer is gone
    print(json.dumps({"pages": alloc.pages, "published": published}), flush=True)
else:
    sys.stdin.readline()  # wait until the writer has committed
    alloc = client.allocate(2, prompt)
    hit_pages = alloc.num_cached_tokens // layout.page_size
    same = all(
        torch.equal(cache[page].view(torch.uint8), expected(layer, i).view(torch.uint8))
        for layer, cache in enumerate(client.kv_caches)
        for i, page in enumerate(alloc.pages[:hit_pages])
    )
    view = client.kv_caches[0]
    print(json.dumps({"pages": alloc.pages, "cached": alloc.num_cached_tokens, "same": same,
                      "view": [str(view.dtype), list(view.shape)]}), flush=True)
client.close()
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp: Path = tmp_path_factory.mktemp("xproc")
    pools = ("--pool", POOL, "--pool", f"{FP8_POOL},num_pages=32")
    latent = ("--pool", f"{LATENT_POOL},dtype=bfloat16,num_pages=16")
    with DaemonProcess("--endpoint", f"ipc://{tmp / 'd.sock'}", *pools, *latent) as d:
        yield d


def start(role: str, endpoint: str, pool: str = "kv") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", ENGINE, role, endpoint, pool],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen[str], stdin: str = "") -> dict[str, object]:
    out, err = proc.communicate(stdin, timeout=120)
    assert proc.returncode == 0, err
    result: dict[str, object] = json.loads(out)
    return result


def test_reader_process_sees_the_writer_process_bytes_through_a_prefix_hit(
    daemon: DaemonProcess,
) -> None:
    reader = start("reader", daemon.endpoint)  # both import torch at once; the reader waits
    written = finish(start("writer", daemon.endpoint))
    assert written["published"] == 4
    read = finish(reader, "go\n")
    assert read["cached"] == 16  # 4 full pages; the last 2 tokens are computed by the reader
    assert read["pages"][:4] == written["pages"][:4]  # type: ignore[index]
    assert read["same"] is True
    with Client.connect(daemon.endpoint, pool="kv") as observer:
        # a third mapping, in this process: same bytes again
        page = written["pages"][0]  # type: ignore[index]
        # the writer stored float32 roundings of layer * 1000 + pos * 10 + head + dim / 100,
        # computed in float32 (1000.0 * 2, + 10.0 * 1, + 1, + 3 / 100): the same operations
        # here give the same bits, and storage does no arithmetic
        k = torch.tensor(2 * 1000.0) + torch.tensor(1) * 10.0 + 1 + torch.tensor(3) / 100.0
        assert observer.kv_caches[2][page, 0, 1, 1, 3].item() == k.item()
        assert observer.kv_caches[2][page, 1, 1, 1, 3].item() == -k.item()
        stats = observer.stats()
        assert stats.hit_tokens == 16 and stats.held_pages == 0 and stats.evictable_pages == 4
        observer.check_integrity()


@pytest.mark.parametrize(
    "pool, view",
    [
        ("fp8", ["torch.float8_e4m3fn", [32, 2, 4, 2, 8]]),
        ("latent", ["torch.bfloat16", [16, 1, 4, 1, 24]]),
    ],
)
def test_fp8_and_latent_pools_cross_processes_byte_for_byte(
    daemon: DaemonProcess, pool: str, view: list[object]
) -> None:
    reader = start("reader", daemon.endpoint, pool)
    written = finish(start("writer", daemon.endpoint, pool))
    assert written["published"] == 4
    read = finish(reader, "go\n")
    assert read["cached"] == 16 and read["pages"][:4] == written["pages"][:4]  # type: ignore[index]
    assert read["same"] is True and read["view"] == view
