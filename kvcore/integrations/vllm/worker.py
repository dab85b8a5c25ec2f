"""The connector's worker side: copies between the mapped pool and vLLM's blocks.

The worker attaches its own session (it holds no sequence; the scheduler side
does) only to map the pool zero-copy. Per step it runs the :class:`StepPlan`:
loads before the forward (``start_load_kv``; synchronous, so every layer is
loaded before attention reads it), saves after it (``wait_for_save``; one
gather/scatter per layer, then a device sync), and reports the saves in a
:class:`StepReport` that the scheduler turns into commits. No K/V crosses the
socket; no Python loop runs per token.

A plan whose epoch is not the mapped pool's (the daemon restarted) is run on a
fresh mapping; if the worker cannot attach, its loads are reported as failed
blocks (vLLM recomputes them) and its saves are skipped (never committed).
"""

from __future__ import annotations

import logging

import torch

from kvcore.client import Client
from kvcore.errors import KVCoreError, Timeout
from kvcore.integrations.vllm.metadata import ConnectorConfig, KvcoreStats, StepPlan, StepReport
from kvcore.integrations.vllm.pages import (
    HeadLayout,
    VllmGeometry,
    block_view,
    check_layout,
    copy_pages,
)

log = logging.getLogger("kvcore.vllm")


def attach(config: ConnectorConfig, *, map_memory: bool) -> Client:
    """A session on the configured pool; a clear Timeout if no daemon answers."""
    try:
        return Client.connect(
            config.endpoint,
            pool=config.pool,
            namespace=config.namespace,
            timeout_s=config.timeout_s,
            map_memory=map_memory,
            name="vllm",
        )
    except Timeout:
        raise Timeout(
            f"no kvcore daemon answers at {config.endpoint} within {config.timeout_s} s: "
            f"start one (`kvcore serve --pool ...`) or set kv_connector_extra_config "
            f"'endpoint'"
        ) from None


class WorkerSide:
    """Worker half of :class:`~kvcore.integrations.vllm.KvcoreConnector`."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self.client = attach(config, map_memory=True)
        self.stats = KvcoreStats()
        self._blocks: list[torch.Tensor] = []  # per layer: [B, 2, N, H, D] views of vLLM's caches
        self._report = StepReport()
        self._failed_blocks: set[int] = set()

    def register(self, caches: dict[str, torch.Tensor], layout: HeadLayout) -> None:
        """Map vLLM's per-layer caches (ordered by layer index) and check the layouts."""
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = [caches[name] for name in sorted(caches, key=extract_layer_index)]
        check_layout(self.client.layout, VllmGeometry.of(ordered), self.config.pool)
        pool, model = self.client.kv_caches[0].device, ordered[0].device
        if model != pool:
            log.info(
                "kvcore: pool on %s, vLLM on %s: pages cross devices on each copy", pool, model
            )
        self._blocks = [block_view(cache, layout) for cache in ordered]

    def load(self, plan: StepPlan) -> None:
        """Copy the plan's hit pages into vLLM's blocks, every layer, before the forward."""
        if not plan.load_pages:
            return
        if not self._mapped(plan.epoch):
            self._failed_blocks.update(plan.load_blocks)
            self.stats.add("failed_load_pages", len(plan.load_blocks))
            return
        pool = self.client.kv_caches
        src = torch.tensor(plan.load_pages, dtype=torch.int64, device=pool[0].device)
        dst = torch.tensor(plan.load_blocks, dtype=torch.int64, device=self._blocks[0].device)
        for layer, blocks in enumerate(self._blocks):
            copy_pages(pool[layer], src, blocks, dst)
        _sync(self._blocks[0].device)
        self.stats.add("loaded_pages", len(plan.load_pages))

    def save(self, plan: StepPlan) -> None:
        """Copy the plan's new full pages out of vLLM, sync, and report them saved."""
        saved = plan.saved
        if plan.save_pages:
            if self._mapped(plan.epoch):
                pool = self.client.kv_caches
                src = torch.tensor(
                    plan.save_blocks, dtype=torch.int64, device=self._blocks[0].device
                )
                dst = torch.tensor(plan.save_pages, dtype=torch.int64, device=pool[0].device)
                for layer, blocks in enumerate(self._blocks):
                    copy_pages(blocks, src, pool[layer], dst)
                _sync(pool[0].device)  # commit after write: the copy is complete
                self.stats.add("saved_pages", len(plan.save_pages))
            else:
                saved = {}
        if plan.requests:
            self._report.steps.append(plan.step)
            self._report.saved.update(saved)
            self._report.requests.extend(plan.requests)

    def take_report(self) -> StepReport | None:
        report, self._report = self._report, StepReport()
        return report if report.steps else None

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self) -> None:
        self.client.close()

    def _mapped(self, epoch: int) -> bool:
        """Whether the mapped pool is the plan's; remap after a daemon restart."""
        if epoch == self.client.epoch:
            return True
        try:
            self.client.reconnect()
        except KVCoreError as exc:
            log.warning("kvcore: cannot map the pool of epoch %x: %s", epoch, exc)
            return False
        return epoch == self.client.epoch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
