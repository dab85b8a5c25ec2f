"""What :meth:`KVCoreStorage.get_stats` hands SGLang: its ``StorageMetrics``, and more.

SGLang's metrics collector reads the fields of its own ``StorageMetrics`` (pages
fetched and stored per call, bandwidths); :class:`KVCoreStorageMetrics` is one, so
SGLang reads it unchanged, with kvcore's split of the fetched pages beside them.
Imported at ``get_stats`` only (SGLang's metrics module is not needed before).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang.srt.observability.metrics_collector import StorageMetrics


@dataclass
class KVCoreStorageMetrics(StorageMetrics):  # type: ignore[misc]
    """SGLang's StorageMetrics since the last ``get_stats``, and ``prefetch_pgs_by_source``:
    the pages fetched (those ``prefetch_pgs`` counts) by where they were when the daemon
    was asked, "pool" (the pool itself) or the lower tier that brought them up ("host",
    "disk", "remote"); only media with pages."""

    prefetch_pgs_by_source: dict[str, int] = field(default_factory=dict)
