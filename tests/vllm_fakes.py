"""Stand-ins for what the connector reads of vLLM's scheduler objects (a Request, its
KVCacheBlocks, the KVCacheManager, a SchedulerOutput), for tests that drive the
connector's sides hook by hook without an engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus


@dataclass
class FakeRequest:
    """What the scheduler side reads of vLLM's Request."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = None
    lora_request: Any = None  # vllm.lora.request.LoRARequest
    arrival_time: float = field(default_factory=time.time)  # vLLM's: time.time() at arrival

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


@dataclass
class FakeBlocks:
    """vLLM's KVCacheBlocks and, for build_plan, its KVCacheManager: each request gets
    ``per_request`` block ids, ``stride`` apart from the previous one's, from 1 (vLLM's
    block 0 is its null block, never a request's). ``more[req_id]``: the block ids of
    further KV cache groups (a hybrid model's; 0 where vLLM holds none)."""

    ids: dict[str, list[int]] = field(default_factory=dict)
    per_request: int = 40
    stride: int = 100
    more: dict[str, list[list[int]]] = field(default_factory=dict)

    def of(self, req_id: str) -> Any:
        if req_id not in self.ids:
            first = self.stride * len(self.ids) + 1
            self.ids[req_id] = list(range(first, first + self.per_request))
        ids = self.get_block_ids(req_id)
        return type("Blocks", (), {"get_block_ids": lambda _: ids})()

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.ids[req_id], *self.more.get(req_id, []))


@dataclass
class FakeOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
