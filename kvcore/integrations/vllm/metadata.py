"""What the connector's scheduler side tells its worker side, and back; the config.

Scheduler -> worker, once per step (:class:`StepPlan`): which kvcore pages to
copy into which vLLM blocks before the forward (loads) and which vLLM blocks to
copy into which kvcore pages after it (saves). Worker -> scheduler
(:class:`StepReport`): which steps it finished and, per request, how many of its
leading pages kvcore now holds; the scheduler commits exactly those (commit after
write). Page and block indices are ints; counts of pages, not tokens, unless named
``*_tokens``.

Generations: page numbers and sequences are valid only on the daemon attachment that
made them. A plan carries the ``epoch`` of the state it was built from (the worker
runs it only on the pool of that epoch), and every request in a plan or a report is a
:class:`Ticket` (request, epoch, sequence): the scheduler applies a report only to the
very sequence its plan was built for, never to a later one of the same request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcore.integrations.extra_config import parse_extra
from kvcore.prefix import DEFAULT_NAMESPACE


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys, each optional: ``endpoint`` (default: the
    default daemon, $KVCORE_ENDPOINT), ``pool``, ``namespace``, ``timeout_s`` (bound on
    one daemon round trip, seconds), ``retry_s`` (after the daemon is found gone, calls
    are misses for this long, doubled per failure in a row:
    :mod:`kvcore.integrations.reconnect`), ``save_generated`` (commit the pages
    generated tokens fill too), ``ask_wait_ms`` (the longest the scheduler waits for
    the daemon's answer about a new request), ``model_id`` (the model's identity in
    the key space: an operator's declaration that two deployments serve the same
    model, e.g. the same weights at two paths; "" = derived from vLLM's config)."""

    endpoint: str
    pool: str = "default"
    namespace: str = DEFAULT_NAMESPACE
    timeout_s: float = 5.0
    retry_s: float = 5.0
    save_generated: bool = True
    ask_wait_ms: float = 2.0
    model_id: str = ""

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """The config of vLLM's ``kv_connector_extra_config`` (see
        :func:`~kvcore.integrations.extra_config.parse_extra`)."""
        return parse_extra(cls, extra, what="kv_connector_extra_config")


NO_BLOCK = -1
"""A load's block in a group that holds none for that page (vLLM's null block)."""


@dataclass(frozen=True, slots=True)
class KvGroups:
    """vLLM's KV cache groups as the connector serves them: ``count`` groups (one block
    table each; 1 without the hybrid allocator), ``layer_group`` maps each layer name
    to its group. ``unservable`` names a group kvcore cannot serve ("" if none): its
    state is no per-token K/V (Mamba, linear attention) or its blocks are no pages
    (a ring buffer); then the engine gets no hit and saves nothing, never a wrong
    answer. Full-attention groups are served whole; sliding-window and chunked-local
    ones whole too, less the blocks vLLM holds none of (its null block)."""

    count: int = 1
    layer_group: dict[str, int] = field(default_factory=dict)
    unservable: str = ""

    @classmethod
    def of(cls, kv_cache_config: Any) -> KvGroups:
        """From vLLM's ``KVCacheConfig`` (None: one group, every layer in it)."""
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
            UniformTypeKVCacheSpecs,
        )

        served = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
        if kv_cache_config is None:
            return cls()
        groups = kv_cache_config.kv_cache_groups
        layer_group = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            specs = (
                list(spec.kv_cache_specs.values())
                if isinstance(spec, UniformTypeKVCacheSpecs)
                else [spec]
            )
            if not all(type(one) in served for one in specs):  # subclasses differ in kind
                what = f"group {g} ({type(spec).__name__}, layers {', '.join(group.layer_names)})"
                return cls(len(groups), layer_group, what)
        return cls(max(len(groups), 1), layer_group)


class Ticket(NamedTuple):
    """A request's copies in one plan, as its report must match them: vLLM's request id,
    and the daemon ``epoch`` and sequence ``seq`` they were planned for."""

    req_id: str
    epoch: int
    seq: int


@dataclass(slots=True)
class StepPlan(KVConnectorMetadata):  # type: ignore[misc]
    """One step's copies. ``load_pages[i]`` (kvcore) -> ``load_blocks[i]`` (vLLM) before
    the forward; ``save_blocks[i]`` (vLLM) -> ``save_pages[i]`` (kvcore) after it.
    ``saved`` maps each request with saves to the page count it reaches; ``requests``
    lists every request with a load or a save (the worker reports them back).
    ``epoch`` is the daemon epoch of the state the plan was built from: its page numbers
    are pages of that epoch's pool, and the worker runs the plan on no other.
    ``fail_blocks``: vLLM blocks promised a load that will never run (the state it was
    planned from is gone: the daemon restarted, the scheduler's session was lost, or
    the daemon's answer did not fit); the worker reports them as load errors, so vLLM
    recomputes them.

    Hybrid engines (several KV cache groups, :class:`KvGroups`): ``load_blocks`` and
    ``save_blocks`` are group 0's blocks, ``load_more[g - 1]`` / ``save_more[g - 1]``
    group g's, each aligned with the pages; a load's block is :data:`NO_BLOCK` where
    its group holds none (vLLM's null block: outside a sliding window), and that
    group's layers skip the page. Their loads are asynchronous in vLLM's terms (vLLM
    fails a multi-group engine on block-level load errors): ``recv`` names the
    requests whose loads this plan runs, reported finished (or failed) by request id,
    and ``fail_recv`` those whose loads will never run (as ``fail_blocks``)."""

    step: int = 0
    epoch: int = 0
    load_pages: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)
    save_blocks: list[int] = field(default_factory=list)
    save_pages: list[int] = field(default_factory=list)
    saved: dict[Ticket, int] = field(default_factory=dict)
    requests: list[Ticket] = field(default_factory=list)
    fail_blocks: list[int] = field(default_factory=list)
    load_more: list[list[int]] = field(default_factory=list)
    save_more: list[list[int]] = field(default_factory=list)
    recv: list[str] = field(default_factory=list)
    fail_recv: list[str] = field(default_factory=list)

    def blocks(self, group: int, save: bool) -> list[int]:
        """KV cache group ``group``'s block for each page of the loads (or saves)."""
        first, more = (
            (self.save_blocks, self.save_more) if save else (self.load_blocks, self.load_more)
        )
        return first if group == 0 else more[group - 1]


@dataclass(slots=True)
class StepReport(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """The worker's account of finished steps: ``saved[ticket]`` = leading pages of the
    ticket's sequence that kvcore now holds (copied, and synchronised); ``requests`` =
    every ticket the steps touched (saved or not: a plan the worker refused is reported
    with no saves). Across tensor-parallel workers a page counts as saved only if every
    worker saved it (min)."""

    steps: list[int] = field(default_factory=list)
    saved: dict[Ticket, int] = field(default_factory=dict)
    requests: list[Ticket] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StepReport:
        """Two workers' reports of the same steps as one: a page saved only if both saved
        it; each ticket as often as it was touched (once per step: the scheduler counts
        the plans in flight by it)."""
        assert isinstance(other, StepReport), type(other)
        saved = {r: min(n, other.saved[r]) for r, n in self.saved.items() if r in other.saved}
        touched = Counter(self.requests) | Counter(other.requests)  # the larger count of each
        return StepReport(
            sorted(set(self.steps) | set(other.steps)), saved, sorted(touched.elements())
        )


COUNT_KEYS = (
    "external_hit_tokens",
    "loaded_pages",
    "saved_pages",
    "failed_load_pages",
    "load_bytes",
    "save_bytes",
    "daemon_round_trips",
)
SECONDS_KEYS = ("load_copy_s", "save_copy_s", "daemon_round_trip_s")
STAT_KEYS = COUNT_KEYS + SECONDS_KEYS
TTFT_KEYS: dict[str, str] = {"ttft_hit_s": "true", "ttft_miss_s": "false"}
"""Observation lists (seconds, one per request) -> their ``kvcore_hit`` label value."""


@dataclass
class KvcoreStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last report, each a sum across workers and intervals, and
    observations, each once.

    Scheduler side: ``external_hit_tokens`` (tokens vLLM was told kvcore holds and
    loaded for it), ``daemon_round_trips`` and ``daemon_round_trip_s`` (the link's
    batches to the daemon and the seconds they took, answer included), and the time to
    first token of each request kvcore allocated (:mod:`.first_tokens`), seconds, in
    ``ttft_hit_s`` (kvcore supplied some of its prompt) or ``ttft_miss_s`` (none).
    Worker side: ``loaded_pages`` / ``saved_pages`` / ``failed_load_pages`` (pages of all
    layers at once), ``load_bytes`` / ``save_bytes`` (bytes copied, every layer) and
    ``load_copy_s`` / ``save_copy_s`` (seconds the copies took; a GPU save: the time to
    queue it). ``data`` holds only ints and floats, and lists of floats for the
    observations, keyed by these names: it crosses from worker to scheduler (pickled)
    and from the engine to vLLM's front end (as ``to_dict()``), where
    :meth:`KvcoreConnector.build_kv_connector_stats` and :mod:`.prom` read it back.

    vLLM folds stats with :meth:`aggregate`: the workers' of one step into the first
    worker's object, the scheduler side's into that, and the front end each step's
    into an interval's for its log line, while :mod:`.prom` observes each step's
    ``data`` as it arrives. So an observation list is never changed in place (an
    aggregate builds a new one) and a new object copies the lists it is given: the
    step's ``data`` that :mod:`.prom` reads keeps exactly the step's observations, and
    each reaches ``/metrics`` once."""

    _taken: dict[str, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, 0)
        for key in TTFT_KEYS:
            self.data[key] = list(self.data.get(key) or ())  # never another object's list

    def reset(self) -> None:
        self.data: dict[str, Any] = dict.fromkeys(STAT_KEYS, 0)
        for key in TTFT_KEYS:
            self.data[key] = []

    def add(self, key: str, n: float) -> None:
        assert key in STAT_KEYS, key
        self.data[key] = self.data.get(key, 0) + n

    def observe(self, key: str, seconds: float) -> None:
        """One request's time to first token (``key``: one of :data:`TTFT_KEYS`)."""
        assert key in TTFT_KEYS, key
        self.data[key] = [*self.data[key], seconds]

    def aggregate(self, other: KVConnectorStats) -> KvcoreStats:
        for key, n in other.data.items():
            if key in STAT_KEYS:  # a newer worker's key this side does not know: dropped
                self.add(key, n)
            elif key in TTFT_KEYS and n:
                self.data[key] = [*self.data[key], *n]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's figures for vLLM's log line: the counters, seconds in ms, and per
        :data:`TTFT_KEYS` list its requests and their mean time to first token in ms."""
        out: dict[str, int | float] = {key: int(self.data.get(key, 0)) for key in COUNT_KEYS}
        for key in SECONDS_KEYS:
            out[key.removesuffix("_s") + "_ms"] = round(1e3 * float(self.data.get(key, 0)), 3)
        for key in TTFT_KEYS:
            seconds = self.data[key]
            out[_requests(key)] = len(seconds)
            mean_ms = key.removesuffix("_s") + "_mean_ms"
            out[mean_ms] = round(1e3 * sum(seconds) / len(seconds), 3) if seconds else 0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in STAT_KEYS) and not any(
            self.data[key] for key in TTFT_KEYS
        )

    def totals(self) -> dict[str, float]:
        """Counters since start-up (``take`` resets only the interval's), and per
        :data:`TTFT_KEYS` list the requests observed (``ttft_hit_requests``, ...)."""
        out = {key: self.data.get(key, 0) + self._taken.get(key, 0) for key in STAT_KEYS}
        for key in TTFT_KEYS:
            count = _requests(key)
            out[count] = len(self.data[key]) + self._taken.get(count, 0)
        return out

    def take(self) -> KvcoreStats | None:
        """A copy to report, and reset; None when nothing happened."""
        if self.is_empty():
            return None
        out = KvcoreStats(dict(self.data))
        for key in STAT_KEYS:
            self._taken[key] = self._taken.get(key, 0) + self.data.get(key, 0)
        for key in TTFT_KEYS:
            self._taken[_requests(key)] = self._taken.get(_requests(key), 0) + len(self.data[key])
        self.reset()
        return out


def _requests(key: str) -> str:
    """The name of the count of a :data:`TTFT_KEYS` list's observations."""
    return key.removesuffix("_s") + "_requests"
