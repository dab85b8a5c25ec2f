"""What the connector's scheduler side tells its worker side, and back; the config.

Scheduler -> worker, once per step (:class:`StepPlan`): which kvcore pages to
copy into which vLLM blocks before the forward (loads) and which vLLM blocks to
copy into which kvcore pages after it (saves). Worker -> scheduler
(:class:`StepReport`): which steps it finished and, per request, how many of its
leading pages kvcore now holds; the scheduler commits exactly those (commit after
write). Page and block indices are ints; counts of pages, not tokens, unless named
``*_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcore.integrations.extra_config import parse_extra
from kvcore.results import DEFAULT_NAMESPACE


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys, each optional: ``endpoint`` (default: the
    default daemon, $KVCORE_ENDPOINT), ``pool``, ``namespace``, ``timeout_s`` (bound on
    one daemon round trip), ``retry_s`` (after a failed call the scheduler reports
    misses without asking the daemon for this long)."""

    endpoint: str
    pool: str = "default"
    namespace: str = DEFAULT_NAMESPACE
    timeout_s: float = 5.0
    retry_s: float = 5.0
    save_generated: bool = True
    ask_wait_ms: float = 2.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """The config of vLLM's ``kv_connector_extra_config`` (see
        :func:`~kvcore.integrations.extra_config.parse_extra`)."""
        return parse_extra(cls, extra, what="kv_connector_extra_config")


@dataclass(slots=True)
class StepPlan(KVConnectorMetadata):  # type: ignore[misc]
    """One step's copies. ``load_pages[i]`` (kvcore) -> ``load_blocks[i]`` (vLLM) before
    the forward; ``save_blocks[i]`` (vLLM) -> ``save_pages[i]`` (kvcore) after it.
    ``saved`` maps each request with saves to the page count it reaches; ``requests``
    lists every request with a load or a save (the worker reports them back).
    ``epoch`` is the daemon epoch the page numbers belong to."""

    step: int = 0
    epoch: int = 0
    load_pages: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)
    save_blocks: list[int] = field(default_factory=list)
    save_pages: list[int] = field(default_factory=list)
    saved: dict[str, int] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StepReport(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """The worker's account of finished steps: ``saved[req]`` = leading pages of the
    request that kvcore now holds (copied, and synchronised); ``requests`` = every
    request the steps touched. Across tensor-parallel workers a page counts as saved
    only if every worker saved it (min)."""

    steps: list[int] = field(default_factory=list)
    saved: dict[str, int] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StepReport:
        assert isinstance(other, StepReport), type(other)
        saved = {r: min(n, other.saved[r]) for r, n in self.saved.items() if r in other.saved}
        return StepReport(
            sorted(set(self.steps) | set(other.steps)),
            saved,
            sorted(set(self.requests) | set(other.requests)),
        )


STAT_KEYS = ("external_hit_tokens", "loaded_pages", "saved_pages", "failed_load_pages")


@dataclass
class KvcoreStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last report: ``external_hit_tokens`` (tokens vLLM was told
    kvcore holds, scheduler), ``loaded_pages`` / ``saved_pages`` / ``failed_load_pages``
    (worker). Sums across workers and intervals."""

    _taken: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def add(self, key: str, n: int) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def aggregate(self, other: KVConnectorStats) -> KvcoreStats:
        for key, n in other.data.items():
            self.add(key, int(n))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: int(self.data.get(key, 0)) for key in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in STAT_KEYS)

    def totals(self) -> dict[str, int]:
        """Counters since start-up (``take`` resets only the interval's)."""
        return {key: int(self.data.get(key, 0)) + self._taken.get(key, 0) for key in STAT_KEYS}

    def take(self) -> KvcoreStats | None:
        """A copy to report, and reset; None when nothing happened."""
        if self.is_empty():
            return None
        out = KvcoreStats(dict(self.data))
        for key in STAT_KEYS:
            self._taken[key] = self._taken.get(key, 0) + int(self.data.get(key, 0))
        self.reset()
        return out
