"""The connector's figures on vLLM's ``/metrics``: vLLM's KV connector metrics interface.

vLLM gathers the connector's :class:`~.metadata.KvcoreStats` after every step
(worker side: ``get_kv_connector_stats`` in each worker, summed over the workers and
carried to the scheduler; scheduler side: the same hook there) and hands their
``data`` to its front end, which feeds :class:`KvcorePromMetrics` (built by
``KvcoreConnector.build_prom_metrics``). Each figure is a counter, so a step's
figures reach ``/metrics`` with that step's output: nothing waits for the 10 s log
interval, and nothing is lost at shutdown.

Names are vLLM's (``vllm:`` prefix: vLLM unregisters them with its own when its
metrics are built again), labelled as vLLM labels its own (``model_name``,
``engine``); :data:`FAMILIES` lists them (docs/engines.md, "Metrics"). One histogram
besides: :data:`TTFT_NAME`, the time to first token of the requests kvcore allocated
(:mod:`.first_tokens`), labelled as vLLM's own and ``kvcore_hit`` ("true": kvcore
supplied some of the prompt, "false": none), in the buckets of vLLM's own
``vllm:time_to_first_token_seconds`` (its ``custom_histogram_buckets`` included). Each
step's observations are observed once, as that step's ``data`` arrives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.buckets import histogram_buckets

from kvcore.integrations.vllm.metadata import TTFT_KEYS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

#: stats key -> (counter name as exposed, help). Units: tokens, pages (of every layer
#: at once), bytes (every layer), seconds.
FAMILIES: dict[str, tuple[str, str]] = {
    "external_hit_tokens": (
        "vllm:kvcore_hit_tokens_total",
        "Prompt tokens vLLM loaded from kvcore instead of computing them",
    ),
    "loaded_pages": ("vllm:kvcore_loaded_pages_total", "kvcore pages copied into vLLM's blocks"),
    "saved_pages": ("vllm:kvcore_saved_pages_total", "vLLM blocks copied into kvcore pages"),
    "failed_load_pages": (
        "vllm:kvcore_failed_load_pages_total",
        "Blocks whose kvcore load failed (vLLM recomputed them)",
    ),
    "load_bytes": ("vllm:kvcore_load_bytes_total", "Bytes the loads copied, every layer"),
    "save_bytes": ("vllm:kvcore_save_bytes_total", "Bytes the saves copied, every layer"),
    "load_copy_s": ("vllm:kvcore_load_copy_seconds_total", "Seconds the loads' copies took"),
    "save_copy_s": (
        "vllm:kvcore_save_copy_seconds_total",
        "Seconds the saves' copies took (on a GPU: to queue them)",
    ),
    "daemon_round_trips": (
        "vllm:kvcore_daemon_round_trips_total",
        "Batches the scheduler side sent to the kvcore daemon",
    ),
    "daemon_round_trip_s": (
        "vllm:kvcore_daemon_round_trip_seconds_total",
        "Seconds those batches took, from send to answer",
    ),
}

TTFT_NAME = "vllm:kvcore_time_to_first_token_seconds"
TTFT_HELP = (
    "Time to first token in seconds of the requests kvcore allocated, by whether kvcore "
    "supplied any of their prompt tokens (measured by the scheduler: within one step of "
    "vllm:time_to_first_token_seconds)"
)
HIT_LABEL = "kvcore_hit"


class KvcorePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """One counter per :data:`FAMILIES` entry and the :data:`TTFT_NAME` histogram, a
    child per engine (and ``kvcore_hit`` value), present at 0 from the start;
    :meth:`observe` adds one step's stats."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[int, dict[str, Any]] = {idx: {} for idx in per_engine_labelvalues}
        for key, (name, documentation) in FAMILIES.items():
            family = self._counter_cls(
                name=name.removesuffix("_total"), documentation=documentation, labelnames=labelnames
            )
            for idx, values in per_engine_labelvalues.items():
                self._children[idx][key] = family.labels(*values)
        buckets = histogram_buckets(
            "time_to_first_token",
            overrides=vllm_config.observability_config.custom_histogram_buckets,
        )
        ttft = self._histogram_cls(
            name=TTFT_NAME,
            documentation=TTFT_HELP,
            buckets=buckets,
            labelnames=[*labelnames, HIT_LABEL],
        )
        self._ttft: dict[int, dict[str, Any]] = {
            idx: {key: ttft.labels(*values, hit) for key, hit in TTFT_KEYS.items()}
            for idx, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        children = self._children[engine_idx]
        for key, child in children.items():
            n = transfer_stats_data.get(key, 0)
            if n > 0:
                child.inc(n)
        for key, histogram in self._ttft[engine_idx].items():
            for seconds in transfer_stats_data.get(key) or ():
                histogram.observe(seconds)
