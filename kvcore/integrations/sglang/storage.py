"""KVCoreStorage: SGLang's HiCache storage tier (L3), in a kvcore pool.

Every SGLang instance whose backend attaches to one daemon's pool shares its pages.
Each call is at most two round trips, and holds pages only while it copies:

* ``batch_exists``: one lookup per key (``compute_last=False``: a page's tokens
  may all hit); the answer is the length of the leading run of hits.
* ``batch_get_v1``: allocate each key's page (a hit is pinned, nothing is taken),
  copy the hits into SGLang's host pages, free.
* ``batch_set_v1``: allocate each key's page (a hit: stored already), copy SGLang's
  host pages into the fresh pages, commit and free. A page is visible to other
  instances only after its commit, so nobody reads one half written.

The session's lease frees whatever a dead process held. Keys map onto kvcore
prefix keys as :mod:`.keys` says; pages move as :mod:`.pages` says. Faults: a
daemon that does not answer within ``timeout_s`` makes every call a miss (SGLang
recomputes) for ``retry_s``, then the backend attaches again; a refusal (quota,
pool full) makes the pages it names misses, never an exception in SGLang's threads.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvcore.client import Batch, Client
from kvcore.errors import (
    BatchFailed,
    KVCoreError,
    LayoutMismatch,
    LeaseLost,
    NotAttached,
    StaleEpoch,
    Timeout,
)
from kvcore.integrations.extra_config import parse_extra
from kvcore.integrations.sglang.keys import Identity, page_tokens, space_salt
from kvcore.integrations.sglang.pages import (
    LAYOUTS,
    copy_pages,
    flat_page,
    host_pages,
    pool_pages,
    unflat_page,
)
from kvcore.layout import KVLayout
from kvcore.manager import Allocation
from kvcore.results import DEFAULT_NAMESPACE

log = logging.getLogger(__name__)

DAEMON_GONE: tuple[type[KVCoreError], ...] = (Timeout, StaleEpoch, LeaseLost, NotAttached)
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """kvcore's keys of ``--hicache-storage-backend-extra-config``, each optional:
    ``endpoint`` (default: the default daemon, $KVCORE_ENDPOINT), ``pool``,
    ``namespace``, ``timeout_s`` (bound on one round trip), ``retry_s`` (after the
    daemon stopped answering, calls are misses for this long, then it is tried again)."""

    endpoint: str
    pool: str = "default"
    namespace: str = DEFAULT_NAMESPACE
    timeout_s: float = 5.0
    retry_s: float = 5.0


class KVCoreStorage(HiCacheStorage):  # type: ignore[misc]
    """An SGLang ``HiCacheStorage`` over a kvcore pool; SGLang's ``dynamic`` factory
    builds it as ``KVCoreStorage(storage_config, kwargs)`` and then registers its
    host pool, which fixes the layout and attaches to the daemon."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.config = parse_extra(
            StorageConfig,
            storage_config.extra_config,
            what="hicache-storage-backend-extra-config",
            ignore=SGLANG_KEYS,
        )
        self.salt = space_salt(identity_of(storage_config))
        self.client: Client | None = None
        self.page_size = 0
        self._host: torch.Tensor | None = None  # [pages, layers, 2, ps, heads, d] views
        self._pool: torch.Tensor | None = None
        self._layout: KVLayout | None = None
        self._host_layout = ""
        self._lock = threading.Lock()  # one round trip at a time: SGLang calls from threads
        self._seq_ids = itertools.count(random.getrandbits(62) or 1)  # ids are per pool
        self._down_until = 0.0
        self._fetched_pages: list[int] = []
        self._stored_pages: list[int] = []

    # -- set-up ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: its geometry is the layout kvcore's pool must have
        (one TP rank's heads); attach to the daemon with it. ValueError for a host pool
        kvcore cannot store (MLA, split K/V widths, an unknown layout, pages under 8
        tokens); kvcore's LayoutMismatch if the daemon's pool differs."""
        super().register_mem_pool_host(mem_pool_host)
        self._layout, self._host_layout = expected_layout(mem_pool_host)
        self.page_size = self._layout.page_size
        page_tokens("", self.page_size)  # BadRequest for pages too small to key
        self._host = host_pages(mem_pool_host.kv_buffer, self._host_layout, self.page_size)
        self._attach()

    def _attach(self) -> None:
        if self.client is not None:
            self.client.reconnect()
        else:
            self.client = self._connect()
        self._pool = pool_pages(self.client.kv_caches)

    def _connect(self) -> Client:
        """The session; Timeout and LayoutMismatch say what to start or change."""
        assert self._layout is not None
        config = self.config
        try:
            return Client.connect(
                config.endpoint,
                config.pool,
                config.namespace,
                layout=self._layout,
                timeout_s=config.timeout_s,
                name="sglang",
            )
        except Timeout:
            raise Timeout(
                f"no kvcore daemon answers at {config.endpoint} within {config.timeout_s} s: "
                f"start one (`kvcore serve --pool ...`) or set 'endpoint' in "
                f"--hicache-storage-backend-extra-config"
            ) from None
        except LayoutMismatch as exc:
            fields = {"name": config.pool, **self._layout.to_dict(), "num_pages": "N"}
            flag = ",".join(f"{k}={v}" for k, v in fields.items())
            raise LayoutMismatch(
                f"{exc}; SGLang's host pool needs `kvcore serve --pool {flag}`"
            ) from None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    # -- the v1 interface (zero-copy into SGLang's host pool) ------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` kvcore holds (committed) now."""
        hits = self._round_trip(
            lambda batch: [
                batch.lookup(self._tokens(key), salt=self.salt, compute_last=False) for key in keys
            ]
        )
        full = [hit.num_cached_tokens == self.page_size for hit in hits]
        return full.index(False) if False in full else len(full)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Copy each key's page into the host pages of ``host_indices`` (token
        indices, page after page); per key, whether it was found."""
        assert self._host is not None, "register_mem_pool_host first"
        return self._get(keys, self._host, self._host_page_ids(host_indices, len(keys)))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pages of ``host_indices`` under ``keys``; per key, whether
        kvcore holds it now (stored by this call or before)."""
        assert self._host is not None, "register_mem_pool_host first"
        return self._set(keys, self._host, self._host_page_ids(host_indices, len(keys)))

    # -- the generic interface (flat pages in the host layout's order) ----------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each key's page as a flat tensor in the host layout's page order (into the
        given target tensors where SGLang passes them), None where not found."""
        staging = self._staging(len(keys))
        found = self._get(keys, staging, torch.arange(len(keys)))
        out: list[torch.Tensor | None] = []
        for i, hit in enumerate(found):
            if not hit:
                out.append(None)
                continue
            page = flat_page(staging[i], self._host_layout)
            target = target_locations[i] if target_locations is not None else None
            out.append(page if target is None else target.view(-1).copy_(page))
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages (the host layout's order) under ``keys``; True if all are held."""
        staging = self._staging(len(keys))
        for i, value in enumerate(values or []):
            staging[i].copy_(unflat_page(value, self._host_layout, staging[i].shape))
        return all(self._set(keys, staging, torch.arange(len(keys))))

    # -- SGLang's housekeeping ---------------------------------------------------------

    def clear(self) -> None:
        """Drops nothing: the pages are every attached instance's, and the daemon evicts
        them least recently used first. (SGLang calls this on a cache flush.)"""
        log.info("kvcore: clear() keeps the shared pages; the daemon evicts by LRU")

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics: pages fetched and stored per call since the last call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(self._fetched_pages)
        metrics.backup_pgs.extend(self._stored_pages)
        self._fetched_pages.clear()
        self._stored_pages.clear()
        return metrics

    # -- the work --------------------------------------------------------------------

    def _get(self, keys: Sequence[str], dst: torch.Tensor, dst_pages: torch.Tensor) -> list[bool]:
        seqs = [next(self._seq_ids) for _ in keys]
        got: list[Allocation] = self._round_trip(
            lambda batch: [
                batch.allocate(seq, self._tokens(key), salt=self.salt, compute_last=False)
                for seq, key in zip(seqs, keys, strict=True)
            ]
        )
        found = [a.num_cached_tokens == self.page_size for a in got]
        hits = [i for i, hit in enumerate(found) if hit]
        if hits:
            assert self._pool is not None
            src = torch.tensor([got[i].pages[0] for i in hits], device=self._pool.device)
            copy_pages(dst, dst_pages[hits].to(dst.device), self._pool, src)
        self._round_trip(lambda batch: [batch.free(seq) for seq in seqs[: len(got)]])
        self._fetched_pages.append(len(hits))
        return found + [False] * (len(keys) - len(got))

    def _set(self, keys: Sequence[str], src: torch.Tensor, src_pages: torch.Tensor) -> list[bool]:
        seqs = [next(self._seq_ids) for _ in keys]
        tokens = [self._tokens(key) for key in keys]
        got: list[Allocation] = self._round_trip(
            lambda batch: [
                batch.allocate(seq, page, salt=self.salt, compute_last=False)
                for seq, page in zip(seqs, tokens, strict=True)
            ]
        )
        held = [a.num_cached_tokens == self.page_size for a in got]
        fresh = [i for i, hit in enumerate(held) if not hit]
        if fresh:
            assert self._pool is not None
            dst = torch.tensor([got[i].pages[0] for i in fresh], device=self._pool.device)
            copy_pages(self._pool, dst, src, src_pages[fresh].to(src.device))
            if self._pool.is_cuda:  # the bytes are in place before anyone may read them
                torch.cuda.current_stream(self._pool.device).synchronize()

        order = [
            (op, i)
            for i in range(len(got))
            for op in ("commit", "free")
            if op == "free" or not held[i]
        ]

        def finish(batch: Batch) -> None:  # commit each fresh page, then free; page by page
            for op, i in order:
                if op == "commit":
                    batch.commit(seqs[i], tokens[i])
                else:
                    batch.free(seqs[i])

        done = self._round_trip(finish)
        for (op, i), result in zip(order, done, strict=False):
            if op == "commit":
                held[i] = result == 1
        live = [seqs[i] for op, i in order[len(done) :] if op == "free"]
        if live:  # the batch stopped early: free the rest (the lease would, at the latest)
            self._round_trip(lambda batch: [batch.free(seq) for seq in live])
        self._stored_pages.append(sum(held))
        return held + [False] * (len(keys) - len(got))

    def _round_trip(self, fill: Callable[[Batch], object]) -> list[Any]:
        """Run the ops ``fill`` queues in one batch: their results, as far as they ran
        (an op refused ends the batch: the ops after it did not run). While the daemon
        is gone, runs nothing and answers []."""
        with self._lock:
            client = self._connected()
            if client is None:
                return []
            batch = client.batch()
            fill(batch)
            if not len(batch):
                return []
            try:
                return batch.run()
            except BatchFailed as exc:
                if isinstance(exc.error, DAEMON_GONE):
                    self._gone(exc.error)
                else:
                    log.debug("kvcore: %s", exc.error)
                return list(exc.batch_results)
            except DAEMON_GONE as exc:
                self._gone(exc)
            except KVCoreError as exc:  # the request refused whole
                log.warning("kvcore: %s", exc)
            return []

    def _connected(self) -> Client | None:
        if self.client is None:
            return None
        if self._down_until:
            if time.monotonic() < self._down_until:
                return None
            try:
                self._attach()
            except KVCoreError as exc:
                self._gone(exc)
                return None
            self._down_until = 0.0
            log.info("kvcore: attached again to %s", self.config.endpoint)
        return self.client

    def _gone(self, exc: KVCoreError) -> None:
        if not self._down_until:
            log.warning("kvcore: %s; storage calls miss for %.0f s", exc, self.config.retry_s)
        self._down_until = time.monotonic() + self.config.retry_s

    # -- helpers -------------------------------------------------------------------

    def _tokens(self, key: str) -> list[int]:
        return page_tokens(key, self.page_size)

    def _host_page_ids(self, host_indices: torch.Tensor, num_keys: int) -> torch.Tensor:
        """SGLang's host token indices (``num_keys`` whole pages) as host page ids."""
        if host_indices.numel() != num_keys * self.page_size:
            raise ValueError(
                f"{num_keys} keys need {num_keys * self.page_size} host indices, "
                f"got {host_indices.numel()}"
            )
        return host_indices.view(-1)[:: self.page_size].to(torch.int64) // self.page_size

    def _staging(self, num_pages: int) -> torch.Tensor:
        assert self._host is not None, "register_mem_pool_host first"
        return torch.empty((num_pages, *self._host.shape[1:]), dtype=self._host.dtype)


def identity_of(config: HiCacheStorageConfig) -> Identity:
    """The key-space identity of an SGLang rank's storage config. ValueError for what
    kvcore does not store yet (MLA, split heads, context parallelism), or no model name."""
    if not config.model_name:
        raise ValueError("kvcore's SGLang storage needs the model name (SGLang's model_name)")
    if config.is_mla_model:
        raise ValueError("kvcore's SGLang storage does not hold MLA caches yet")
    if config.should_split_heads or getattr(config, "dcp_size", 1) > 1 or config.attn_cp_size > 1:
        raise ValueError(
            "kvcore's SGLang storage does not split heads or contexts across ranks yet"
        )
    return Identity(
        model=config.model_name,
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        pp_rank=config.pp_rank,
        pp_size=config.pp_size,
    )


def expected_layout(host: Any) -> tuple[KVLayout, str]:
    """The kvcore layout an SGLang MHA host pool's pages have (its ``layer_num``,
    ``head_num``, ``head_dim``, ``page_size``, ``dtype``), and its layout name."""
    layout = getattr(host, "layout", None)
    if layout not in LAYOUTS or not hasattr(host, "head_num"):
        raise ValueError(
            f"kvcore's SGLang storage holds MHA host pools in {', '.join(LAYOUTS)}; "
            f"got {type(host).__name__} ({layout!r})"
        )
    if getattr(host, "v_head_dim", host.head_dim) != host.head_dim:
        raise ValueError("kvcore's SGLang storage needs equal K and V head dims")
    dtype = str(host.dtype).removeprefix("torch.")
    kv = KVLayout(
        num_layers=host.layer_num,
        num_kv_heads=host.head_num,
        head_dim=host.head_dim,
        page_size=host.page_size,
        dtype=dtype,
        num_pages=1,  # the daemon's choice
    )
    return kv, layout
