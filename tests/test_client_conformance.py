"""The Manager's conformance state machine, unchanged, against a Client and a real daemon.

One daemon process serves the whole test; each example attaches to a fresh
ephemeral pool of the layout the machine draws (real ZeroMQ, real shared
memory, a separate process), and detaching at teardown removes the pool.
After every step the machine also runs ``check_integrity`` inside the daemon.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.layout import KVLayout
from kvcore.testing.manager import make_state_machine

_pools = itertools.count()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp: Path = tmp_path_factory.mktemp("conformance")
    with DaemonProcess(
        "--endpoint", f"ipc://{tmp / 'd.sock'}", "--allow-ephemeral", "--pool", "num_pages=1"
    ) as d:
        yield d


def test_client_conforms_to_the_manager_model(daemon: DaemonProcess) -> None:
    def fresh(layout: KVLayout) -> Client:
        return Client.connect(
            daemon.endpoint,
            pool=f"conformance-{next(_pools)}",
            layout=layout,
            ephemeral=True,
            map_memory=False,
            heartbeat=False,
        )

    machine = make_state_machine(fresh)
    machine.TestCase.settings = settings(
        settings.default,
        max_examples=max(settings.default.max_examples, 200),
        stateful_step_count=30,
    )
    machine.TestCase().runTest()
    with Client.connect(daemon.endpoint, map_memory=False) as probe:
        stats = probe.daemon_stats()
        assert [p.name for p in stats.pools] == ["default"], "an example's pool outlived it"
        assert stats.counters.errors > 0  # the machine drove error paths over the wire too
