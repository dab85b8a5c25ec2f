"""``kvcore bench sglang``: SGLang's HiCache storage calls on kvcore, against a plain
host-memory store, in one run. Needs SGLang (its venv: tests/install.sh builds one).

SGLang's server does not run on a CPU-only machine (docs/engines.md says why), so
this drives the storage backend as SGLang's cache controller does: SGLang's real
``MHATokenToKVPoolHost`` (CPU) holds the pages; the backend is built by SGLang's
``StorageBackendFactory`` (``dynamic``) and attached to a private daemon; keys are
SGLang's page hashes. The pool holds one round's pages, so from the second round on
every page stored evicts one (the steady state of a full cache; LRU, so that the
pages evicted are the last round's, never this one's). Per round (after
one untimed round that touches every page once), fresh pages:

* backup: ``batch_set_v1`` of ``STORAGE_BATCH_SIZE`` (128) pages per call, as the
  controller's backup thread;
* prefetch: ``batch_exists`` then ``batch_get_v1`` per 128 pages, as its prefetch
  threads, into other host pages; the fetched bytes must equal the stored ones
  (``bytes_match``).

The pool's order is the one ``--host-layout`` matches (kvcore.integrations.sglang.
pages.HOST_ORDERS), as the backend requires. The baseline is :class:`HostCopyStore`:
the same calls on a dict of slots in one preallocated host tensor in that same page
order, copied with the same copy, so the ratios are what the daemon costs (round
trips, keys, commit). ``set_ratio`` / ``get_ratio``
= kvcore's pages/s / the baseline's (target >= 0.5); the median over rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from kvcore.bench.report import Figure, Target
from kvcore.daemon_process import DaemonProcess
from kvcore.layout import KVLayout

HEADLINE = (
    Figure("set_pages_per_s", "batch_set_v1 on kvcore, pages/s"),
    Figure("get_pages_per_s", "batch_exists + batch_get_v1 on kvcore, pages/s"),
    Figure("set_ratio", "set: kvcore / plain host store", Target(">=", 0.5)),
    Figure("get_ratio", "get: kvcore / plain host store", Target(">=", 0.5)),
    Figure("bytes_match", "fetched bytes == stored bytes", Target("==", True)),
)
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per storage call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=32, help="model layers (default: 32)")
    parser.add_argument(
        "--kv-heads", type=int, default=8, help="KV heads of one TP rank (default: 8)"
    )
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default: 128)")
    parser.add_argument(
        "--page-size",
        type=int,
        default=64,
        help="tokens per page, SGLang's --page-size (default: 64)",
    )
    parser.add_argument("--dtype", default="bfloat16", help="KV dtype (default: bfloat16)")
    parser.add_argument(
        "--host-layout",
        default="layer_first",
        help="SGLang's host pool layout, --hicache-mem-layout (default: layer_first)",
    )
    parser.add_argument(
        "--pages", type=int, default=128, help="pages stored and fetched a round (default: 128)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument(
        "--quick", action="store_true", help="2 layers, 2 heads, 64 pages, 2 rounds (tests)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.layers, args.kv_heads, args.head_dim, args.pages, args.rounds = 2, 2, 64, 64, 2
    import torch

    from kvcore.integrations.sglang.pages import HOST_ORDERS

    order = HOST_ORDERS[args.host_layout]
    layout = KVLayout(
        args.layers,
        args.kv_heads,
        args.head_dim,
        args.page_size,
        args.dtype,
        args.pages,
        "kv",
        order,
    )
    fields = {"name": "default", **layout.to_dict(), "eviction": "lru"}  # the oldest go first
    pool = ",".join(f"{k}={v}" for k, v in fields.items())
    with DaemonProcess.private("--pool", pool) as daemon:
        host = host_pool(layout, args.host_layout, 2 * args.pages)
        kvcore_store = kvcore_backend(daemon.endpoint, host)
        plain = HostCopyStore(host, layout)
        rounds = []
        for r in range(-1, args.rounds):  # round -1 warms up: every page touched once
            keys = page_keys(layout.page_size, args.pages, seed=r + 1)
            _fill(host, args.pages, seed=r + 1)
            sets, gets, match = {}, {}, True
            stores: list[tuple[str, Any]] = [("plain", plain), ("kvcore", kvcore_store)]
            for name, store in stores if r % 2 == 0 else stores[::-1]:
                plain.clear()
                sets[name], gets[name], same = _round(store, host, keys, torch)
                match = match and same
            if r >= 0:
                rounds.append((sets, gets, match))
        kvcore_store.close()
    moved = args.pages * layout.page_bytes
    set_s = statistics.median(s["kvcore"] for s, _, _ in rounds)
    get_s = statistics.median(g["kvcore"] for _, g, _ in rounds)
    return {
        "set_pages_per_s": args.pages / set_s,
        "get_pages_per_s": args.pages / get_s,
        "set_ratio": statistics.median(s["plain"] / s["kvcore"] for s, _, _ in rounds),
        "get_ratio": statistics.median(g["plain"] / g["kvcore"] for _, g, _ in rounds),
        "bytes_match": all(m for _, _, m in rounds),
        "plain_set_pages_per_s": args.pages / statistics.median(s["plain"] for s, _, _ in rounds),
        "plain_get_pages_per_s": args.pages / statistics.median(g["plain"] for _, g, _ in rounds),
        "set_gib_per_s": moved / set_s / 2**30,
        "get_gib_per_s": moved / get_s / 2**30,
        "page_bytes": layout.page_bytes,
        "config": {
            "layout": layout.to_dict(),
            "host_layout": args.host_layout,
            "pages": args.pages,
            "rounds": args.rounds,
            "batch_pages": BATCH,
        },
    }


def _round(store: Any, host: Any, keys: list[str], torch: Any) -> tuple[float, float, bool]:
    """One backup and one prefetch of ``keys``' pages: (set s, get s, bytes equal).
    Host pages [0, n) are the source, [n, 2n) the destination (poisoned first)."""
    n, ps = len(keys), host.page_size
    source = torch.arange(n * ps)
    target = torch.arange(n * ps, 2 * n * ps)
    _poison(host, target, torch)
    start = time.perf_counter()
    for b in range(0, n, BATCH):
        done = store.batch_set_v1(keys[b : b + BATCH], source[b * ps : (b + BATCH) * ps])
        assert all(done), "a store refused pages"
    set_s = time.perf_counter() - start
    start = time.perf_counter()
    for b in range(0, n, BATCH):
        batch = keys[b : b + BATCH]
        hit = store.batch_exists(batch)
        got = store.batch_get_v1(batch[:hit], target[b * ps : (b + hit) * ps])
        assert hit == len(batch) and all(got), "a store lost pages"
    get_s = time.perf_counter() - start
    same = _pages_equal(host, source, target, torch)
    return set_s, get_s, same


class HostCopyStore:
    """The baseline: SGLang's storage calls on a plain in-process host store (a dict of
    slots in one preallocated tensor, a pool of ``layout``: its pages in its order),
    with the copies kvcore's backend makes."""

    def __init__(self, host: Any, layout: KVLayout) -> None:
        import torch

        from kvcore.integrations.sglang.pages import host_pages, pool_pages

        self.page_size = host.page_size
        self.host = host_pages(host.kv_buffer, host.layout, host.page_size)
        memory = torch.empty(layout.total_bytes, dtype=torch.uint8)
        self.slots = pool_pages(layout.layer_views(memory))
        self.index: dict[str, int] = {}

    def clear(self) -> None:
        self.index.clear()

    def batch_exists(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if key not in self.index:
                return i
        return len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: Any) -> list[bool]:
        slots = [self.index.setdefault(key, len(self.index)) for key in keys]
        self._copy(self.slots, slots, self.host, host_indices)
        return [True] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: Any) -> list[bool]:
        self._copy(self.host, host_indices, self.slots, [self.index[key] for key in keys])
        return [True] * len(keys)

    def _copy(self, dst: Any, dst_ids: Any, src: Any, src_ids: Any) -> None:
        import torch

        from kvcore.integrations.sglang.pages import copy_pages

        def pages(ids: Any) -> Any:
            if isinstance(ids, torch.Tensor):  # host token indices, page after page
                return ids[:: self.page_size] // self.page_size
            return torch.tensor(ids)

        copy_pages(dst, pages(dst_ids), src, pages(src_ids))


def host_pool(layout: KVLayout, host_layout: str, num_pages: int) -> Any:
    """SGLang's real MHA host pool on CPU, of ``num_pages`` pages (over the device pool
    its constructor takes, on CPU too)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dtype = layout.torch_dtype()
    tokens = num_pages * layout.page_size // 2
    device = MHATokenToKVPool(
        tokens,
        layout.page_size,
        dtype,
        layout.num_kv_heads,
        layout.head_dim,
        layout.num_layers,
        "cpu",
        False,
        start_layer=0,
        end_layer=layout.num_layers,
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        layout.page_size,
        host_layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layout.num_layers,
    )


def kvcore_backend(endpoint: str, host: Any, **extra: Any) -> Any:
    """The backend as SGLang builds it: by its dynamic factory, then the host pool;
    ``extra``: more of kvcore's extra-config keys."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first",
        model_name="kvcore-bench",
        extra_config={
            "backend_name": "kvcore",
            "module_path": "kvcore.integrations.sglang",
            "class_name": "KVCoreStorage",
            "interface_v1": 1,
            "endpoint": endpoint,
            **extra,
        },
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


def page_keys(page_size: int, num_pages: int, seed: int) -> list[str]:
    """SGLang's page keys (its hash chain) of a random prompt of ``num_pages`` pages."""
    from sglang.srt.mem_cache.utils import get_hash_str

    rng = random.Random(seed)
    tokens = [rng.randrange(32000) for _ in range(num_pages * page_size)]
    keys: list[str] = get_hash_str(tokens, None, page_size=page_size)
    return keys


def _fill(host: Any, num_pages: int, seed: int) -> None:
    """Random K/V in host pages [0, num_pages): what a round stores."""
    import torch

    from kvcore.integrations.sglang.pages import host_pages

    source = host_pages(host.kv_buffer, host.layout, host.page_size)[:num_pages]
    gen = torch.Generator().manual_seed(seed)
    source.copy_(torch.randn(source.shape, generator=gen).to(source.dtype))


def _poison(host: Any, token_indices: Any, torch: Any) -> None:
    from kvcore.integrations.sglang.pages import host_pages

    view = host_pages(host.kv_buffer, host.layout, host.page_size)
    view[token_indices[:: host.page_size] // host.page_size] = float("nan")


def _pages_equal(host: Any, source: Any, target: Any, torch: Any) -> bool:
    from kvcore.integrations.sglang.pages import host_pages

    view = host_pages(host.kv_buffer, host.layout, host.page_size)
    ps = host.page_size
    return bool(torch.equal(view[source[::ps] // ps], view[target[::ps] // ps]))
