"""A client written from spec/protocol.md alone: plain msgpack and raw pyzmq, importing
nothing from kvcore; checked against a real daemon and against kvcore's own Client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcore import Client
from kvcore.daemon_process import DaemonProcess

SPEC_CLIENT = r"""
import itertools, json, mmap, os, struct, sys
import msgpack, zmq

endpoint, order = sys.argv[1], sys.argv[2]
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(endpoint)
ids = itertools.count(1)
session = epoch = 0

def call(op, **fields):
    request_id = next(ids)
    request = {"id": request_id, "session": session, "epoch": epoch, "body": {"op": op, **fields}}
    sock.send(msgpack.packb(request))
    assert sock.poll(10000), "no reply"
    reply = msgpack.unpackb(sock.recv())
    assert reply["id"] == request_id, reply
    return reply

ok = call("attach", version=4, pool="default", namespace="spec",
          layout={"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "page_size": 2,
                  "dtype": "float32", "num_pages": 0, "order": order})["result"]
session, epoch, layout, memory = ok["session"], ok["epoch"], ok["layout"], ok["memory"]
assert memory["kind"] == "shm" and ok["version"] == 4 and layout["order"] == order

fd = os.open("/dev/shm/" + memory["name"], os.O_RDWR)
pool = mmap.mmap(fd, memory["size"], offset=memory.get("offset", 0))
os.close(fd)
L, P, S, H, D = (layout[k] for k in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"))
size = {"L": L, "P": P, "K": 2, "T": S, "H": H}
stride, step = {}, D  # the spec's formula: an axis's stride is D times the sizes after it
for axis in reversed(layout["order"]):
    stride[axis], step = step, step * size[axis]

def element_offset(l, p, k, t, h, d):  # bytes, float32
    return 4 * (l * stride["L"] + p * stride["P"] + k * stride["K"] + t * stride["T"] + h * stride["H"] + d)

tokens = [7, 8, 9, 10, 11]
alloc = call("allocate", seq=1, tokens=tokens)["result"]
assert alloc == {"pages": alloc["pages"], "num_cached_tokens": 0} and len(alloc["pages"]) == 3
for layer in range(L):
    for i, page in enumerate(alloc["pages"]):
        logical = itertools.product(range(2), range(S), range(H), range(D))  # [K, T, H, D]
        for j, (k, t, h, d) in enumerate(logical):
            at = element_offset(layer, page, k, t, h, d)
            pool[at:at + 4] = struct.pack("<f", layer * 100.0 + i + j / 1000.0)
assert call("commit", seq=1, tokens=tokens)["result"] == {"num_committed": 2}
assert call("lookup", tokens=tokens)["result"] == {"num_cached_tokens": 4}
assert call("lookup", tokens=tokens, namespace="other")["result"] == {"num_cached_tokens": 0}
assert call("lookup", tokens=tokens[:4])["result"] == {"num_cached_tokens": 2}  # never the last token

# extend counts tokens added; a copy replaces the last page, dst is not in new_pages
assert call("fork", parent=1, child=2)["result"] == {"pages": alloc["pages"]}
ext = call("extend", seq=2, num_tokens=2)["result"]
(src, dst), = ext["copies"]
assert src == alloc["pages"][-1] and dst not in ext["new_pages"] and len(ext["new_pages"]) == 1
table = call("block_table", seq=2)["result"]["pages"]
assert table == alloc["pages"][:-1] + [dst] + ext["new_pages"]
assert call("num_tokens", seq=2)["result"] == {"num_tokens": 7}
# commit with a start offset sends only the new page's tokens; num_committed is the running total
assert call("commit", seq=2, tokens=[11, 12], start=4)["result"] == {"num_committed": 3}
assert call("commit", seq=2, tokens=[11], start=3)["error"]["code"] == "bad_request"  # not a page boundary
assert call("commit", seq=2, tokens=[11, 12], start=6)["error"]["code"] == "bad_request"  # past committed
assert call("free", seq=2)["result"] == {}
hit = call("lookup", tokens=[7, 8, 9, 10, 11, 12, 0])["result"]
assert hit == {"num_cached_tokens": 6, "num_evictable_pages": 1}  # seq 2's third page is unreferenced
snap = call("snapshot")["result"]
seen = set()
for entry in snap["pages"]:  # parents before children; chains start at a namespace root
    assert entry["parent"] in seen or entry["parent"] not in {e["key"] for e in snap["pages"]}
    seen.add(entry["key"])
assert len(snap["pages"]) == 3 and snap["epoch"] == epoch

# namespaces are bounded in UTF-8 bytes, not characters
assert call("lookup", tokens=[1], namespace="\u00e9" * 128)["result"] == {"num_cached_tokens": 0}
assert call("lookup", tokens=[1], namespace="\u00e9" * 129)["error"]["code"] == "bad_request"
# u64 ids above 2**53 are exact (a double would round big + 1 to big)
big = 2**63 + 12345
assert call("fork", parent=1, child=big)["result"] == {"pages": alloc["pages"]}
assert call("num_tokens", seq=big)["result"] == {"num_tokens": 5}
assert call("num_tokens", seq=big + 1)["error"]["code"] == "unknown_sequence"
assert call("free", seq=big)["result"] == {}

errors = {
    "unknown_sequence": call("free", seq=99),
    "sequence_exists": call("allocate", seq=1, tokens=[1]),
    "unknown_op": call("warp", seq=1),
    "bad_request": call("extend", seq=1, num_tokens=-3),
}
for code, reply in errors.items():
    assert reply["error"]["code"] == code, (code, reply)

batch = call("batch", ops=[{"op": "extend", "seq": 1, "num_tokens": 1},
                           {"op": "free", "seq": 42},
                           {"op": "free", "seq": 1}])["result"]
assert batch["results"] == [{"new_pages": [], "copies": []}] and batch["error"]["code"] == "unknown_sequence"
stats = call("stats")["result"]
default = [p for p in stats["pools"] if p["name"] == "default"][0]
assert default["free_pages"] + default["evictable_pages"] + default["held_pages"] == default["total_pages"]
assert call("heartbeat")["result"] == {}
stale = {"id": 999, "session": session, "epoch": epoch + 1, "body": {"op": "heartbeat"}}
sock.send(msgpack.packb(stale)); assert sock.poll(10000)
assert msgpack.unpackb(sock.recv())["error"]["code"] == "stale_epoch"
print(json.dumps({"pages": alloc["pages"], "seq_alive": True}), flush=True)

sys.stdin.readline()  # the test checks our bytes through kvcore's own Client meanwhile
assert call("detach")["result"] == {}
assert call("extend", seq=1, num_tokens=1)["error"]["code"] == "not_attached"
leaked = sorted(m for m in sys.modules if m == "kvcore" or m.startswith(("kvcore.", "kvcore_ipc")))
assert not leaked, leaked
print(json.dumps({"ok": True}), flush=True)
"""

POOL = "name=default,num_layers=2,num_kv_heads=2,head_dim=4,page_size=2,dtype=float32,num_pages=16"


@pytest.mark.parametrize("order", ["LPKTH", "PLHKT"])
def test_spec_only_client_against_a_real_daemon(tmp_path: Path, order: str) -> None:
    pool = f"{POOL},order={order}"
    with DaemonProcess("--endpoint", f"ipc://{tmp_path / 'd.sock'}", "--pool", pool) as daemon:
        proc = subprocess.Popen(
            [sys.executable, "-c", SPEC_CLIENT, daemon.endpoint, order],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        assert first, proc.communicate(timeout=30)[1]
        pages = json.loads(first)["pages"]
        with Client.connect(daemon.endpoint, namespace="spec") as client:
            # the spec's byte offsets name the same elements as kvcore's per-layer views,
            # which are [num_pages, 2, page_size, heads, head_dim] in every order
            for layer in range(2):
                for i, page in enumerate(pages):
                    flat = client.kv_caches[layer][page].flatten()
                    want = [layer * 100.0 + i + j / 1000.0 for j in range(flat.numel())]
                    # the spec client packed each value as float32 ('<f'): the pool holds
                    # their float32 roundings, bit for bit (storage does no arithmetic)
                    assert torch.equal(flat, torch.tensor(want, dtype=torch.float32))
            assert client.lookup([7, 8, 9, 10, 11]).num_cached_tokens == 4
        out, err = proc.communicate("go\n", timeout=60)
        assert proc.returncode == 0, err
        assert json.loads(out) == {"ok": True}
