"""KVCoreStorage: SGLang's HiCache storage tier (L3), in a kvcore pool.

Every SGLang instance whose backend attaches to one daemon's pool shares its pages.
Each call is at most two round trips, and holds pages only while it copies. Each
key is a one-page chain (:mod:`.keys`); a call's keys are one sequence of them
(``allocate_pages``, spec/protocol.md), so a call costs the daemon one op for its
pages, not one per page:

* ``batch_exists``: ``lookup_pages`` of the keys; the answer is the length of
  the leading run of hits.
* ``batch_get_v1``: ``allocate_pages`` of the keys (a hit is pinned), copy the hits
  into SGLang's host pages, free.
* ``batch_set_v1``: ``allocate_pages`` of the keys (a hit: stored already), copy
  SGLang's host pages into the fresh pages, ``commit_pages`` and free. A page is
  visible to other instances only after its commit, so nobody reads one half
  written.

A pool with lower tiers serves them too: a key the pool misses and its host or disk
tier holds is brought up into the pool first (kvcore.daemon.tiering). A call whose
``allocate_pages`` is refused room (the pool full of held pages, a quota) tries its
leading half, halving while refused: the keys then stored or fetched are the leading
ones that fit, the rest misses.

The pool's order is the one SGLang's host layout matches (:data:`.pages.HOST_ORDERS`:
``layer_first`` -> ``LPKTH``, ``page_first`` -> ``PKTLH``, ``page_first_direct`` ->
``PKLTH``, ``page_head`` -> ``PKHTL``), so a page copies as one run per part (K, V)
of each side, or ``2 x layers`` runs for ``layer_first``. A pool in another order is
refused at attach, a LayoutMismatch naming the ``order=`` to start it with: the
copies could serve any order (they are planned from strides), but a page would
then cost up to one copy per token, several times the daemon's own work, which
nobody should pay by accident; and SGLang instances of one host layout share a
pool, their pages byte for byte, and its tiers (whose keys carry the order).

The session's lease frees whatever a dead process held. Keys map onto kvcore
prefix keys as :mod:`.keys` says; pages move as :mod:`.pages` says; the config, the
layout and the first attach are :mod:`.attach`'s. Faults: a daemon that does not
answer within ``timeout_s``, restarted or ended the session makes every call a miss
(SGLang recomputes) until the backend attaches again, as
:mod:`kvcore.integrations.reconnect` says for every integration; a refusal (quota,
pool full) makes the pages it names misses, never an exception in SGLang's threads.
A page read from a mapping fenced meanwhile (the lease lost) is a miss too.

Figures (:meth:`KVCoreStorage.get_stats`): SGLang's own (pages fetched and stored
per call) and the pages fetched by where they were when the daemon was asked
(:class:`~.metrics.KVCoreStorageMetrics`): ``allocate_pages`` says so per page
(``PagesAllocation.media``: "pool", or the tier that brought it up, "host" or
"disk").

The file is one class of a little over 400 lines on purpose: SGLang's two
interfaces, the round trips and the remap of the pool after a reconnect share one
lock and one mapping, whose rules (no remap while a copy reads it) read together.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvcore.client import Batch, Client
from kvcore.errors import BatchFailed, KVCoreError, OutOfPages, QuotaExceeded
from kvcore.integrations.extra_config import parse_extra
from kvcore.integrations.hit_media import POOL
from kvcore.integrations.identity import space_model
from kvcore.integrations.reconnect import Attachment, Reconnector, daemon_gone
from kvcore.integrations.sglang.attach import (
    SGLANG_KEYS,
    StorageConfig,
    connect,
    expected_layout,
)
from kvcore.integrations.sglang.keys import (
    page_tokens,
    pages_tokens,
    rank_identity,
    server_model,
)
from kvcore.integrations.sglang.pages import (
    copy_pages,
    flat_page,
    host_pages,
    pool_pages,
    unflat_page,
)
from kvcore.layout import KVLayout
from kvcore.prefix import KeySpace, PackedTokens

log = logging.getLogger(__name__)

__all__ = ["KVCoreStorage", "StorageConfig"]


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
        self.server = server_model()  # what SGLang publishes of the model (keys.py)
        identity = rank_identity(storage_config, self.server, self.config.model_id)
        self.space = KeySpace(model=space_model(identity))
        self.client: Client | None = None
        self.page_size = 0
        self._host: torch.Tensor | None = None  # [pages, layers, parts, ps, heads, d] views
        self._pool: torch.Tensor | None = None  # the mapped pool, as of _mapped
        self._mapped: Attachment | None = None  # the attachment _pool was taken from
        self._reconnect: Reconnector | None = None
        self._layout: KVLayout | None = None
        self._host_layout = ""
        self._lock = threading.Lock()  # one round trip at a time: SGLang calls from threads
        self._refusal = threading.local()  # .room: this thread's last failure was for room
        self._copies = 0  # copies running on the mapping (outside the lock): no remap meanwhile
        self._seq_ids = itertools.count(random.getrandbits(62) or 1)  # ids are per pool
        self._fetched_pages: list[int] = []
        self._fetched_by_source: dict[str, int] = {}  # medium -> pages fetched (get_stats')
        self._last_keys: tuple[list[str], PackedTokens] = ([], PackedTokens())  # _all's memo
        self._stored_pages: list[int] = []

    # -- set-up ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: its geometry is the layout kvcore's pool must have
        (one TP rank's heads; an MLA model's latent cache); attach to the daemon with it.
        ValueError for a host pool kvcore cannot store (attach.expected_layout); BadRequest
        for pages under 8 tokens; kvcore's LayoutMismatch if the daemon's pool differs."""
        super().register_mem_pool_host(mem_pool_host)
        self._layout, self._host_layout = expected_layout(mem_pool_host, self.server.kv_cache_dtype)
        self.page_size = self._layout.page_size
        page_tokens("", self.page_size)  # BadRequest for pages too small to key
        self._host = host_pages(
            mem_pool_host.kv_buffer,
            self._host_layout,
            self.page_size,
            latent=self._layout.kind == "latent",
        )
        self._attach()

    def _attach(self) -> None:
        """The first attach (the errors say what to fix); later ones are the
        Reconnector's."""
        assert self._layout is not None
        if self.client is not None:
            self.close()
        self.client = connect(self.config, self._layout, self._host_layout)
        self._reconnect = Reconnector.of(
            self.client, retry_s=self.config.retry_s, what="SGLang storage"
        )
        self._remap()

    def _remap(self) -> None:
        """Take the pool's pages from the client's current mapping."""
        assert self.client is not None and self._reconnect is not None
        self._pool = pool_pages(self.client.kv_caches)
        self._mapped = self._reconnect.attachment

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
            self._reconnect = self._mapped = self._pool = None

    # -- the v1 interface (zero-copy into SGLang's host pool) ------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` kvcore holds (committed) now."""
        got, _ = self._round_trip(lambda batch: batch.lookup_pages(self._all(keys), self.space))
        found: list[bool] = got[0] if got else []
        return found.index(False) if False in found else len(found)

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
        """SGLang's StorageMetrics since the last call: pages fetched and stored per call,
        and the fetched pages by medium (``prefetch_pgs_by_source``: "pool", "host",
        "disk", "remote"; module docstring)."""
        from kvcore.integrations.sglang.metrics import KVCoreStorageMetrics

        with self._lock:  # SGLang's threads count on meanwhile: none is lost or counted twice
            fetched, self._fetched_pages = self._fetched_pages, []
            stored, self._stored_pages = self._stored_pages, []
            by_source, self._fetched_by_source = self._fetched_by_source, {}
        return KVCoreStorageMetrics(
            prefetch_pgs=fetched, backup_pgs=stored, prefetch_pgs_by_source=by_source
        )

    # -- the work --------------------------------------------------------------------

    def _get(self, keys: Sequence[str], dst: torch.Tensor, dst_pages: torch.Tensor) -> list[bool]:
        seq = next(self._seq_ids)
        got, on = self._round_trip(
            lambda batch: batch.allocate_pages(seq, self._all(keys), self.space)
        )
        if not got:  # refused (then the leading half, as far as it fits) or the daemon gone
            return self._leading(keys, self._get, dst, dst_pages)
        found = list(got[0].hits)
        hits = [i for i, hit in enumerate(found) if hit]
        if hits:
            with self._pool_of(on) as pool:
                if pool is not None:
                    src = torch.tensor([got[0].pages[i] for i in hits], device=pool.device)
                    copy_pages(dst, dst_pages[hits].to(dst.device), pool, src)
                if pool is None or self._fenced():  # what was read is not the pages'
                    found, hits = [False] * len(keys), []
        self._round_trip(lambda batch: batch.free(seq), on)
        media = got[0].media or [POOL] * len(keys)  # empty: every hit was in the pool
        self._fetched([media[i] for i in hits])
        return found

    def _set(self, keys: Sequence[str], src: torch.Tensor, src_pages: torch.Tensor) -> list[bool]:
        seq = next(self._seq_ids)
        tokens = self._all(keys)
        got, on = self._round_trip(lambda batch: batch.allocate_pages(seq, tokens, self.space))
        if not got:  # refused (then the leading half, as far as it fits) or the daemon gone
            return self._leading(keys, self._set, src, src_pages)
        held = list(got[0].hits)
        fresh = [i for i, hit in enumerate(held) if not hit]
        if fresh:
            with self._pool_of(on) as pool:
                if pool is not None:
                    dst = torch.tensor([got[0].pages[i] for i in fresh], device=pool.device)
                    copy_pages(pool, dst, src, src_pages[fresh].to(src.device))
                    if pool.is_cuda:  # the bytes are in place before anyone may read them
                        torch.cuda.current_stream(pool.device).synchronize()
                if pool is None or self._fenced():  # not written: commit nothing
                    fresh = []

        def finish(batch: Batch) -> None:  # commit the written pages (hits are left alone)
            if fresh:
                batch.commit_pages(seq, tokens)
            batch.free(seq)

        done, _ = self._round_trip(finish, on)
        if fresh and done:  # committed: every key is held now
            held = [True] * len(keys)
        if len(done) < 1 + bool(fresh):  # the free did not run (the lease would, at the latest)
            self._round_trip(lambda batch: batch.free(seq), on)
        self._stored(sum(held))
        return held

    def _leading(
        self,
        keys: Sequence[str],
        call: Callable[[Sequence[str], torch.Tensor, torch.Tensor], list[bool]],
        host: torch.Tensor,
        host_pages: torch.Tensor,
    ) -> list[bool]:
        """After ``call`` of ``keys`` was refused room (the pool full of held pages, a
        quota): ``call`` of the leading half, halved again while refused, so the keys
        stored or fetched are the leading ones that fit (a round trip per halving).
        Misses for the rest; all misses after any other failure."""
        if len(keys) < 2 or not getattr(self._refusal, "room", False):
            if call == self._set:
                self._stored(0)
            return [False] * len(keys)
        half = len(keys) // 2
        return call(keys[:half], host, host_pages[:half]) + [False] * (len(keys) - half)

    def _round_trip(
        self, fill: Callable[[Batch], object], on: Attachment | None = None
    ) -> tuple[list[Any], Attachment | None]:
        """Run the ops ``fill`` queues in one batch: their results, as far as they ran
        (an op refused ends the batch: the ops after it did not run), and the attachment
        they ran on. Runs nothing and answers ``[]`` while the daemon is gone, or when
        ``on`` (the attachment the ops' sequences were made on) is not the current one:
        those sequences died with their session."""
        self._refusal.room = False
        with self._lock:
            client = self._connected()
            attachment = self._mapped
            if client is None or (on is not None and on != attachment):
                return [], None
            batch = client.batch()
            fill(batch)
            if not len(batch):
                return [], attachment
            try:
                return batch.run(), attachment
            except BatchFailed as exc:
                self._failed(exc)
                return list(exc.batch_results), attachment
            except KVCoreError as exc:  # the daemon gone, or the request refused whole
                self._failed(exc)
            return [], attachment

    def _connected(self) -> Client | None:
        """The client if a call may go out now (attached again first after the daemon
        was gone, the pool remapped); None while calls are misses, or while another
        thread still copies from the mapping an attach would replace. Under the lock."""
        reconnect = self._reconnect
        if self.client is None or reconnect is None or (self._copies and reconnect.due()):
            return None
        if not reconnect.ready():
            return None
        if reconnect.attachment != self._mapped:
            self._remap()
        return self.client

    @contextlib.contextmanager
    def _pool_of(self, on: Attachment | None) -> Iterator[torch.Tensor | None]:
        """The mapped pool if it is still the one of ``on`` (the attachment the pages
        were allocated on; else None: they are another pool's pages). Not remapped
        while the block runs."""
        with self._lock:
            pool = self._pool if on is not None and on == self._mapped else None
            self._copies += pool is not None
        try:
            yield pool
        finally:
            if pool is not None:
                with self._lock:
                    self._copies -= 1

    def _fenced(self) -> bool:
        """Whether the lease was lost (the mapping then shows scratch pages)."""
        return self.client is None or self.client.lease_lost

    def _failed(self, exc: KVCoreError) -> None:
        assert self._reconnect is not None
        self._refusal.room = isinstance(exc, OutOfPages | QuotaExceeded)
        if daemon_gone(exc):
            self._reconnect.gone(exc, "storage call")
        elif isinstance(exc, BatchFailed):
            log.debug("kvcore: %s", exc.error)
        else:
            log.warning("kvcore: %s", exc)

    # -- helpers -------------------------------------------------------------------

    def _stored(self, pages: int) -> None:
        """One set call left ``pages`` of its keys held."""
        with self._lock:
            self._stored_pages.append(pages)

    def _fetched(self, media: list[str]) -> None:
        """One get call copied a page from each of ``media`` (the medium each was in)."""
        with self._lock:
            self._fetched_pages.append(len(media))
            for medium in media:
                self._fetched_by_source[medium] = self._fetched_by_source.get(medium, 0) + 1

    def _all(self, keys: Sequence[str]) -> PackedTokens:
        """The tokens of ``keys``' pages, page after page, packed (``*_pages`` ops). The last
        call's are kept: SGLang's prefetch asks ``batch_exists`` then ``batch_get_v1``
        of the same keys."""
        last = self._last_keys  # one read: other threads may replace it meanwhile
        if last[0] == keys:
            return last[1]
        tokens = pages_tokens(keys, self.page_size)
        self._last_keys = (list(keys), tokens)
        return tokens

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
