"""Drive SGLang's own HiCache storage path on CPU, for kvcore's tests.

Run with the SGLang venv's python (tests/install.sh builds it; tests/sglang_helpers.py
finds it), never imported by pytest in the main environment:

    python tests/sglang_harness.py SPEC        # SPEC: a JSON string, a file path, or "-" (stdin)

It builds SGLang 0.5.23's real objects on CPU: an ``MHATokenToKVPool`` (device "cpu"; an
``MLATokenToKVPool`` for an MLA layout), a ``PagedTokenToKVPoolAllocator`` over it, the
real ``MHATokenToKVPoolHost`` (``MLATokenToKVPoolHost``) in the asked layout and the cache
controller, then attaches the storage backend through the
controller's own ``attach_storage_backend`` (so SGLang's ``StorageBackendFactory`` builds
it by name: ``"file"``, or ``"dynamic"`` with ``module_path``/``class_name`` in the extra
config). The controller is, by default, the ``HybridCacheController`` over an anchor-only
``HostPoolGroup``: what ``launch_server --enable-hierarchical-cache`` builds for a plain MHA
model in 0.5.23 (``_PlainKvStrategy`` -> ``build_kv_only_stack``); ``"controller": "base"``
takes the plain ``HiCacheController`` instead. Its storage threads run as in a server; this
script plays the radix tree's part (hashing, host allocation, draining the queues).

What does not run on CPU, and is not used: the device <-> host copies (``write`` / ``load``:
the kernels come from sgl_kernel's CUDA build), so the host pages are filled here.

Spec (JSON object; units: tokens unless named pages):
    op               "write" | "fetch"
    backend          storage backend name as SGLang takes it ("file", "dynamic", ...)
    extra_config     dict, the --hicache-storage-backend-extra-config; SGLang's own parser
                     pops prefetch_threshold (default 256), hicache_storage_pass_prefix_keys
                     (default false) and the timeouts before the backend sees the rest
    layout           {num_layers, num_kv_heads, head_dim, dtype, page_size,
                      host_layout: "layer_first" | "page_first" | "page_first_direct" | "page_head",
                      mla: optional {kv_lora_rank, qk_rope_head_dim}: an MLA model's pools
                      (num_kv_heads and head_dim are then unused)}; dtype is the device
                      pool's torch dtype: an fp8 one (float8_e4m3fn) makes SGLang's uint8
                      store, whose pages the harness fills with random bytes
    kv_cache_dtype   with model_path: the published --kv-cache-dtype (default "auto")
    prompts          list of token lists; each is cut to whole pages, as the tree does
    chunk_pages      write only: back each prompt up as nodes of this many pages (default:
                     one node), each keyed from its parent's last hash, as the tree does
    skip_pages       fetch only: pages taken as already cached (prefetch the rest, from
                     the last skipped page's hash, with the skipped keys as prefix_keys)
    tp_rank, tp_size ranks the storage config reports (default 0, 1)
    model_name       default "kvcore-test"; SGLang passes its --served-model-name here
    model_path       optional: publish SGLang's ServerArgs(model_path=..., served_model_name=
                     model_name) in this process first, as its scheduler process does (kvcore
                     derives a rank's model identity from them); absent: nothing is published
    controller       "hybrid" (default) | "base"
    seed             folded into the K/V generator (default 0)
    timeout_s        per queue wait (default 30)

K/V are a pure function of (page key, seed, layout), so either side can compute what a page
must hold. Page bytes are compared in one canonical order per page: [k|v][layer][token in
page][head][dim] in the pool dtype, whatever the host layout (``sha256`` of the pages in
order; ``page_sha256`` one per page).

Prints one JSON line on stdout (everything SGLang prints goes to stderr); exits 1 with the
reason on stderr on any failure of the harness itself. A backend that answers False is not
a harness failure: it shows as fewer completed or hit tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from typing import Any

_T_START = time.monotonic()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402 (timed from here)
    HiCacheFile,
    HiCacheStorageExtraInfo,
)


def _load_spec(arg: str) -> dict[str, Any]:
    if arg == "-":
        text = sys.stdin.read()
    elif arg.lstrip().startswith("{"):
        text = arg
    else:
        with open(arg, encoding="utf-8") as f:
            text = f.read()
    spec = json.loads(text)
    if not isinstance(spec, dict) or spec.get("op") not in ("write", "fetch"):
        raise ValueError('spec must be a JSON object with "op": "write" | "fetch"')
    return spec


class Rig:
    """SGLang's objects for one run: device pool, allocator, host pool, controller."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.runtime_context import get_parallel

        lay = spec["layout"]
        self.torch = torch
        self.layers = int(lay["num_layers"])
        self.heads = int(lay["num_kv_heads"])
        self.head_dim = int(lay["head_dim"])
        self.page = int(lay["page_size"])
        self.dtype = getattr(torch, lay.get("dtype", "bfloat16"))
        self.layout = lay.get("host_layout", "layer_first")
        self.mla = lay.get("mla")
        self.seed = int(spec.get("seed", 0))
        self.timeout = float(spec.get("timeout_s", 30))

        if spec.get("model_path"):  # before the ranks: a publish re-projects the config
            from sglang.srt.runtime_context import publish
            from sglang.srt.server_args import ServerArgs

            args = ServerArgs(
                model_path=spec["model_path"],
                served_model_name=spec.get("model_name", "kvcore-test"),
                tp_size=int(spec.get("tp_size", 1)),
                kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                device="cpu",
            )
            publish(args, role="scheduler")
        # The ranks SGLang's storage config reads, stated as a launcher would publish them.
        get_parallel().override_permanently(
            tp_rank=int(spec.get("tp_rank", 0)),
            tp_size=int(spec.get("tp_size", 1)),
            pp_rank=0,
            pp_size=1,
            attn_dcp_size=1,
            attn_dcp_rank=0,
        )

        total = sum(len(p) // self.page * self.page for p in spec["prompts"])
        device_tokens = max(total, self.page) + self.page
        layers = {"start_layer": 0, "end_layer": self.layers}
        if self.mla:  # one latent vector a token: [parts=1, ..., heads=1, D] pages
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

            rank, rope = int(self.mla["kv_lora_rank"]), int(self.mla["qk_rope_head_dim"])
            self.heads, self.head_dim = 1, rank + rope
            self.kv: Any = MLATokenToKVPool(
                device_tokens,
                self.page,
                self.dtype,
                rank,
                rope,
                self.layers,
                "cpu",
                False,
                **layers,
            )
        else:
            self.kv = MHATokenToKVPool(
                device_tokens,
                self.page,
                self.dtype,
                self.heads,
                self.head_dim,
                self.layers,
                "cpu",
                False,
                **layers,
            )
        allocator = PagedTokenToKVPoolAllocator(
            device_tokens, self.page, self.dtype, "cpu", self.kv, need_sort=False
        )
        # host_to_device_ratio 2: room for every prompt's pages (the pool adds a padding page).
        host_class: Any = MLATokenToKVPoolHost if self.mla else MHATokenToKVPoolHost
        self.host = host_class(
            self.kv.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            self.page,
            self.layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=self.kv.size,
            **layers,
            **({"target_layer_num": self.layers} if self.mla else {}),
        )

        (
            extra,
            threshold,
            _timeout_base,
            _timeout_per_ki,
            self.pass_prefix_keys,
        ) = HybridCacheController.parse_storage_backend_extra_config(
            json.dumps(spec.get("extra_config") or {})
        )
        self.kind = spec.get("controller", "hybrid")
        model_name = spec.get("model_name", "kvcore-test")
        if self.kind == "hybrid":
            from sglang.srt.mem_cache.hicache_storage import PoolName
            from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
                build_pool_entry,
            )
            from sglang.srt.mem_cache.pool_host import HostPoolGroup

            group = HostPoolGroup(
                [
                    build_pool_entry(
                        name=PoolName.KV,
                        host_pool=self.host,
                        device_pool=self.kv,
                        layer_mapping={i: i for i in range(self.layers)},
                        transfer_layer_id_max=self.layers,
                        is_anchor=True,
                    )
                ]
            )
            self.cc: Any = HybridCacheController(
                allocator,
                group,
                self.page,
                None,
                threading.Event(),
                io_backend="direct",
                transfer_layer_id_max=self.layers,
            )
            self.cc.attach_storage_backend(
                storage_backend=spec["backend"],
                prefetch_threshold=threshold,
                model_name=model_name,
                storage_backend_extra_config=extra,
                host_pools=group.entries,
            )
        elif self.kind == "base":
            from sglang.srt.managers.cache_controller import HiCacheController

            self.cc = HiCacheController(
                allocator, self.host, self.page, None, threading.Event(), io_backend="direct"
            )
            self.cc.attach_storage_backend(
                storage_backend=spec["backend"],
                prefetch_threshold=threshold,
                model_name=model_name,
                storage_backend_extra_config=extra,
            )
        else:
            raise ValueError(f'controller must be "hybrid" or "base", not {self.kind!r}')

    # Keys, as the radix tree computes them (compute_node_hash_values: a node's pages
    # are chained from its parent's last page hash; the root has none).
    def keys(self, tokens: list[int], last_hash: str | None) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        keys = get_storage_hash_str(tokens, last_hash, page_size=self.page)
        assert isinstance(keys, list) and len(keys) == len(tokens) // self.page
        return keys

    # Page contents, canonical order [parts, layers, page_size, heads, head_dim] (parts:
    # K and V, or MLA's one latent vector); any bytes in an fp8 cache's uint8 store
    # (NaN and inf bit patterns included).
    def page_kv(self, key: str) -> Any:
        gen = self.torch.Generator().manual_seed(int(key[:15], 16) ^ self.seed)
        shape = (1 if self.mla else 2, self.layers, self.page, self.heads, self.head_dim)
        if self.host.dtype == self.torch.uint8:
            return self.torch.randint(0, 256, shape, generator=gen, dtype=self.torch.uint8)
        return (self.torch.randn(shape, generator=gen) * 4).to(self.dtype)

    def _view(self, base: int) -> Any:
        """The host pool's page at token index ``base`` as a canonical-order view (an
        MLA kv_buffer is the MHA one of its layout without the leading parts dim)."""
        buf, p = self.host.kv_buffer, self.page
        buf = buf.unsqueeze(0) if self.mla else buf
        if self.layout == "layer_first":  # [2, L, tokens, H, D]
            return buf[:, :, base : base + p]
        if self.layout == "page_first":  # [2, tokens, L, H, D]
            return buf[:, base : base + p].permute(0, 2, 1, 3, 4)
        if self.layout == "page_first_direct":  # [2, pages, L, P, H, D]
            return buf[:, base // p]
        if self.layout == "page_head":  # [2, pages, H, P, L, D]
            return buf[:, base // p].permute(0, 3, 2, 1, 4)
        raise ValueError(f"host layout {self.layout!r} is not handled by the harness")

    def put_page(self, base: int, data: Any) -> None:
        self._view(base).copy_(data)

    def get_page(self, base: int) -> bytes:
        return self._page_bytes(self._view(base))

    def _page_bytes(self, t: Any) -> bytes:
        return bytes(t.contiguous().view(self.torch.uint8).reshape(-1).numpy().tobytes())

    def digest(self, pages: list[bytes]) -> dict[str, Any]:
        return {
            "sha256": hashlib.sha256(b"".join(pages)).hexdigest(),
            "page_sha256": [hashlib.sha256(p).hexdigest() for p in pages],
        }

    def expected(self, keys: list[str]) -> dict[str, Any]:
        return self.digest([self._page_bytes(self.page_kv(k)) for k in keys])

    def poison(self) -> None:
        """Fill the whole host pool with 0xA5 bytes, so a page never fetched cannot match."""
        self.host.kv_buffer.view(self.torch.uint8).fill_(0xA5)

    def wait(self, queue: Any, what: str) -> Any:
        from queue import Empty

        try:
            return queue.get(timeout=self.timeout)
        except Empty:
            raise TimeoutError(f"no {what} within {self.timeout} s") from None


def _write(rig: Rig, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Fill host pages and back them up through the controller's write_storage."""
    p = rig.page
    chunk_pages = int(spec.get("chunk_pages") or 0)
    out = []
    for prompt in spec["prompts"]:
        tokens = list(prompt)[: len(prompt) // p * p]
        step = chunk_pages * p if chunk_pages > 0 else max(len(tokens), p)
        all_keys: list[str] = []
        pending: dict[int, int] = {}
        pages: list[bytes] = []
        for start in range(0, len(tokens), step):
            node = tokens[start : start + step]
            keys = rig.keys(node, all_keys[-1] if all_keys else None)
            host_indices = rig.host.alloc(len(node))
            if host_indices is None:
                raise RuntimeError("host pool is full")
            for i, key in enumerate(keys):
                base = int(host_indices[i * p])
                rig.put_page(base, rig.page_kv(key))
                pages.append(rig.get_page(base))
            prefix = list(all_keys) if rig.pass_prefix_keys else None
            op_id = rig.cc.write_storage(host_indices, node, keys, prefix)
            pending[op_id] = len(node)
            all_keys += keys
        completed = 0
        while pending:
            op = rig.wait(rig.cc.ack_backup_queue, "backup ack")
            if op.id in pending:
                pending.pop(op.id)
                completed += op.completed_tokens
        assert all_keys == rig.keys(tokens, None), "node-chained keys differ from one chain"
        out.append(
            {
                "tokens": len(tokens),
                "keys": all_keys,
                "completed_tokens": completed,
                **rig.digest(pages),
            }
        )
    return out


def _fetch_one(rig: Rig, tokens: list[int], skip: int, rid: str) -> dict[str, Any]:
    p = rig.page
    keys = rig.keys(tokens, None)
    fetch_tokens = tokens[skip * p :]
    last_hash = keys[skip - 1] if skip else None
    prefix = keys[:skip] if rig.pass_prefix_keys else None
    cc = rig.cc
    if rig.kind == "hybrid":
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        op = cc.prefetch(CacheRequestHandle(rid, 0), fetch_tokens, last_hash, prefix)
    else:
        op = cc.prefetch(rid, fetch_tokens, last_hash, prefix)
    hit = rig.wait(cc.prefetch_hit_queue, "storage hit query result")
    if hit is not op:
        raise RuntimeError("the hit query answered another operation")
    hit_tokens = int(op.storage_hit_count)
    result: dict[str, Any] = {
        "tokens": len(tokens),
        "fetch_tokens": len(fetch_tokens),
        "keys": keys[skip:],
        "hit_tokens": hit_tokens,
        "below_threshold": hit_tokens < cc.prefetch_threshold,
        "fetched_tokens": 0,
    }
    if hit_tokens == 0 or hit_tokens < cc.prefetch_threshold:
        # The tree revokes such a prefetch: no transfer, no acks.
        result.update(rig.digest([]), expected_sha256=rig.digest([])["sha256"])
        return result
    if rig.kind == "hybrid":
        host_indices, alloc_len = cc.allocate_storage_hit(
            op,
            hit_tokens,
            allow_partial=False,
            min_tokens=cc.prefetch_threshold,
            evict_host=lambda _n: 0,
        )
    else:
        host_indices, alloc_len = cc.alloc_prefetch_host_buffers(op, hit_tokens), hit_tokens
    if host_indices is None or alloc_len != hit_tokens:
        raise RuntimeError(f"host pool cannot take {hit_tokens} prefetched tokens")
    op.host_indices = host_indices
    cc.prefetch_tokens_occupied += len(fetch_tokens)
    cc.prefetch_buffer.put(op)
    completed = 0
    while True:
        ack = rig.wait(cc.ack_prefetch_queue, "prefetch ack")
        if ack.operation is not op:
            continue
        if ack.completed_tokens is not None:
            completed = max(completed, int(ack.completed_tokens))
        if ack.completed_req:
            break
    cc.prefetch_tokens_occupied -= len(fetch_tokens)
    pages = [rig.get_page(int(host_indices[i * p])) for i in range(completed // p)]
    got = rig.digest(pages)
    result.update(
        fetched_tokens=completed,
        expected_sha256=rig.expected(keys[skip : skip + completed // p])["sha256"],
        **got,
    )
    return result


def _fetch(rig: Rig, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Prefetch each prompt through the controller's threads into the (poisoned) host pool."""
    rig.poison()
    skip = int(spec.get("skip_pages") or 0)
    out = []
    for i, prompt in enumerate(spec["prompts"]):
        tokens = list(prompt)[: len(prompt) // rig.page * rig.page]
        if skip * rig.page > len(tokens):
            raise ValueError("skip_pages is past the end of a prompt")
        out.append(_fetch_one(rig, tokens, skip, f"harness-{i}"))
    return out


class FileV1Storage(HiCacheFile):
    """SGLang's file backend behind the zero-copy calls (``interface_v1``), to prove that path.

    Loaded by SGLang's factory as ``{"backend_name": "file-v1", "module_path":
    "sglang_harness", "class_name": "FileV1Storage", "interface_v1": 1}``. What the
    controller hands it: ``host_indices`` are token indices into the host pool,
    ``len(keys) * page_size`` of them, page ``i`` starting at ``host_indices[i * page_size]``.
    Each call is recorded in ``v1_calls`` (the harness reports them).
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any]) -> None:
        super().__init__(storage_config)
        self.v1_calls: list[dict[str, Any]] = []

    def _record(self, op: str, keys: list[str], host_indices: Any, extra_info: Any) -> int:
        p = int(self.mem_pool_host.page_size)
        starts = [int(host_indices[i * p]) for i in range(len(keys))]
        prefix = extra_info.prefix_keys if isinstance(extra_info, HiCacheStorageExtraInfo) else None
        self.v1_calls.append(
            {
                "op": op,
                "keys": len(keys),
                "host_indices": int(host_indices.numel()),
                "dtype": str(host_indices.dtype),
                "device": str(host_indices.device),
                "page_starts_aligned": all(s % p == 0 for s in starts),
                "pages_contiguous": bool(
                    all(
                        int(host_indices[i * p + j]) == starts[i] + j
                        for i in range(len(keys))
                        for j in range(p)
                    )
                ),
                "prefix_keys": None if prefix is None else len(prefix),
            }
        )
        return p

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        p = self._record("set", keys, host_indices, extra_info)
        pool = self.mem_pool_host
        return [
            self.set(key, pool.get_data_page(int(host_indices[i * p]), flat=True))
            for i, key in enumerate(keys)
        ]

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        p = self._record("get", keys, host_indices, extra_info)
        pool = self.mem_pool_host
        out = []
        for i, key in enumerate(keys):
            page = self.get(key, pool.get_dummy_flat_data_page())
            if page is not None:
                pool.set_from_flat_data_page(int(host_indices[i * p]), page)
            out.append(page is not None)
        return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    # Keep stdout for the one result line: SGLang, torch and the backend print to fd 1 too.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        spec = _load_spec(argv[1])
        import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller  # noqa: F401

        t0 = time.monotonic()
        rig = Rig(spec)
        t1 = time.monotonic()
        prompts = _write(rig, spec) if spec["op"] == "write" else _fetch(rig, spec)
        t2 = time.monotonic()
        backend = rig.cc.storage_backend
        inner = getattr(backend, "_backend", backend)  # SGLang's failure-injection proxy
        result = {
            "ok": True,
            "op": spec["op"],
            "controller": type(rig.cc).__name__,
            "backend_class": f"{type(inner).__module__}.{type(inner).__qualname__}",
            "page_get": rig.cc.page_get_func.__name__,
            "page_set": rig.cc.page_set_func.__name__,
            "prefetch_threshold": rig.cc.prefetch_threshold,
            "pass_prefix_keys": rig.pass_prefix_keys,
            "storage_config": dataclasses.asdict(rig.cc.storage_config),
            "host_layout": rig.layout,
            "host_kv_buffer_shape": list(rig.host.kv_buffer.shape),
            "prompts": prompts,
            "v1_calls": getattr(inner, "v1_calls", None),
            "seconds": {
                "import": round(t0 - _T_START, 3),
                "build": round(t1 - t0, 3),
                "op": round(t2 - t1, 3),
            },
        }
        rig.cc.detach_storage_backend()
    except Exception as e:  # the reason goes to stderr; the caller shows it
        import traceback

        traceback.print_exc()
        print(f"sglang_harness: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    with os.fdopen(result_fd, "w") as out:
        out.write(json.dumps(result) + "\n")
    return 0


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown: the backend is closed and the storage
    threads are stopped by then, and tearing down SGLang's imports costs ~2 s a run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv))
