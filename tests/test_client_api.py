"""The Client's own surface: batches, typed results, mapping, close, timeouts, `kvcore stats`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore import Client, statsview
from kvcore.daemon_process import DaemonProcess
from kvcore.errors import BatchFailed, NotAttached, OutOfPages, Timeout, UnknownSequence
from kvcore.layout import KVLayout
from kvcore.manager import Allocation, Extension, PrefixHit, Stats

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=4, page_size=2, dtype="bfloat16", num_pages=8
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp: Path = tmp_path_factory.mktemp("api")
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp / 'd.sock'}",
        "--allow-ephemeral",
        "--pool",
        "num_pages=2,num_layers=1",
    ) as d:
        yield d


@pytest.fixture
def client(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[Client]:
    with Client.connect(
        daemon.endpoint, pool=request.node.name, layout=LAYOUT, ephemeral=True, name="api-test"
    ) as c:
        yield c


def test_results_have_the_manager_types(client: Client) -> None:
    assert client.allocate(1, [5, 6, 7]) == Allocation([0, 1], 0)
    assert client.commit(1, [5, 6, 7]) == 1
    assert client.fork(1, 2) == [0, 1]
    assert client.extend(2, 2) == Extension([2], [(1, 3)])  # copy-on-write of the shared last page
    assert client.block_table(2) == [0, 3, 2] and client.num_tokens(2) == 5
    assert client.lookup((5, 6, 7)) == PrefixHit(2, 0)  # any sequence of ints; page 0 is held
    stats = client.stats()
    assert isinstance(stats, Stats) and stats.held_pages == 4 and stats.cached_pages == 1
    client.free(1)
    client.free(2)
    client.check_integrity()


def test_kv_caches_are_per_layer_views_of_the_pool(client: Client) -> None:
    """Each layer view is the pool's memory in the pool's order (the default's strides):
    a write through layer 1 lands one layer stride past layer 0's page."""
    assert len(client.kv_caches) == 2
    first, second = client.kv_caches
    assert first.shape == LAYOUT.layer_shape and str(first.dtype) == "torch.bfloat16"
    strides = LAYOUT.strides
    assert first.stride() == second.stride() == tuple(strides[axis] for axis in "PKTHD")
    assert second.data_ptr() == first.data_ptr() + strides["L"] * first.element_size()
    second[7, 1, 1, 1, 3] = 2.5
    offset = sum(strides[axis] * i for axis, i in zip("LPKTHD", (1, 7, 1, 1, 1, 3), strict=True))
    assert first.as_strided((1,), (1,), first.storage_offset() + offset).item() == 2.5
    second[7, 1, 1, 1, 3] = 0.0


def test_batch_results_and_partial_failure(client: Client) -> None:
    with client.batch() as batch:
        batch.allocate(1, [1, 2, 3])
        batch.extend(1, 1)
        batch.commit(1, [1, 2, 3, 4])
        batch.fork(1, 2)
        batch.lookup([1, 2, 3, 4, 5])
        batch.block_table(2)
        batch.num_tokens(2)
        batch.free(2)
    assert batch.results == [
        Allocation([0, 1], 0),
        Extension([], []),
        2,
        [0, 1],
        PrefixHit(4, 0),
        [0, 1],
        4,
        None,
    ]
    failing = client.batch()
    failing.extend(1, 2)
    failing.free(77)
    failing.free(1)
    with pytest.raises(UnknownSequence) as info:  # the op's own class, and BatchFailed
        failing.run()
    failed = info.value
    assert isinstance(failed, BatchFailed) and failed.code == UnknownSequence.code
    assert failed.batch_results == [Extension([2], [])]
    assert failed.batch_index == 1
    assert type(failed.error) is UnknownSequence and str(failed.error) == str(failed)
    assert client.num_tokens(1) == 6  # the op before ran, the one after did not
    with pytest.raises(OutOfPages):
        client.allocate(3, list(range(100)))
    client.check_integrity()


def test_close_detaches_and_later_calls_fail(daemon: DaemonProcess) -> None:
    c = Client.connect(daemon.endpoint, pool="closing", layout=LAYOUT, ephemeral=True)
    c.allocate(1, [1])
    view = c.kv_caches[0]
    c.close()
    assert c.kv_caches == []
    del view
    with pytest.raises(NotAttached):
        c.extend(1, 1)
    c.close()  # idempotent


def test_timeout_when_no_daemon_answers(tmp_path: Path) -> None:
    with pytest.raises(Timeout):
        Client.connect(f"ipc://{tmp_path / 'nobody.sock'}", timeout_s=0.2)


def test_kvcore_stats_table_and_json(
    daemon: DaemonProcess, client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    client.allocate(1, [1, 2, 3])
    parser = argparse.ArgumentParser()
    statsview.add_arguments(parser)
    assert statsview.main(parser.parse_args(["--endpoint", daemon.endpoint, "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    mine = next(p for p in data["pools"] if p["name"] == client.pool)
    assert (mine["held_pages"], mine["num_sequences"], mine["total_pages"]) == (2, 1, 8)
    assert any(s["name"] == "api-test" and s["num_sequences"] == 1 for s in data["sessions"])
    assert statsview.main(parser.parse_args(["--endpoint", daemon.endpoint])) == 0
    table = capsys.readouterr().out
    assert client.pool in table and "hit rate" in table and "api-test" in table
    missing = parser.parse_args(["--endpoint", "ipc:///nonexistent/x.sock", "--timeout", "0.2"])
    assert statsview.main(missing) == 1


def test_a_late_reply_to_a_timed_out_call_is_skipped(tmp_path: Path) -> None:
    """After a timeout, the daemon's late answer must not be taken for the next call's."""
    import os
    import signal

    pool = "num_layers=1,num_kv_heads=1,head_dim=8,page_size=4,dtype=float16,num_pages=16"
    with DaemonProcess("--endpoint", f"ipc://{tmp_path / 'late.sock'}", "--pool", pool) as d:
        assert d.proc is not None
        with Client.connect(d.endpoint, map_memory=False, heartbeat=False, timeout_s=0.2) as c:
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(Timeout):
                    c.allocate(1, [1, 2, 3, 4, 5])
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            # The allocate ran once the daemon resumed; its reply (pages) arrives first.
            assert c.extend(1, 3) == Extension(new_pages=[], copies=[])
            assert c.num_tokens(1) == 8
            assert c.block_table(1) == c.block_table(1)
