"""The event stream of a real daemon: one message per request, gap-free numbering per pool
for the whole epoch, removals when a pool closes, and a subscriber that rebuilds its view
from a snapshot after a gap."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcore_ipc.events import EventSubscriber
from kvcore_ipc.messages import EventBatch, PageRemovedEvent, PageStoredEvent

from kvcore import Client
from kvcore.daemon_process import DaemonProcess
from kvcore.layout import KVLayout

LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="float16", num_pages=16
)
_names = itertools.count()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("events")
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp / 'd.sock'}",
        "--events",
        "auto",
        "--allow-ephemeral",
        "--pool",
        "num_pages=8",
    ) as d:
        yield d


def fresh_pool(daemon: DaemonProcess, name: str | None = None) -> Client:
    return Client.connect(
        daemon.endpoint, pool=name or f"p{next(_names)}", layout=LAYOUT, ephemeral=True
    )


def subscribe(client: Client) -> EventSubscriber:
    sub = EventSubscriber(client.attach_info.events, pool=client.pool)
    time.sleep(0.3)  # PUB/SUB joins asynchronously
    return sub


def drain(sub: EventSubscriber) -> list[EventBatch]:
    return list(sub.drain(timeout_ms=300))


def test_one_message_per_request_numbered_without_gaps(daemon: DaemonProcess) -> None:
    with fresh_pool(daemon) as client:
        sub = subscribe(client)
        prompt = list(range(9))
        client.allocate(1, prompt)
        client.commit(1, prompt)  # two pages stored: one message
        client.free(1)
        client.allocate(2, list(range(100, 100 + 4 * 16)))  # needs every page: evicts both
        got = drain(sub)
        sub.close()
    assert [len(b.events) for b in got] == [2, 2]
    assert all(b.pool == client.pool and b.epoch == client.epoch for b in got)
    assert [b.first_seq_no for b in got] == [1, 3]
    stored, removed = got[0].events, got[1].events
    assert all(isinstance(e, PageStoredEvent) for e in stored)
    assert all(isinstance(e, PageRemovedEvent) for e in removed)
    assert stored[1].parent == stored[0].key and len(stored[0].key) == 32  # type: ignore[union-attr]
    assert {e.key for e in removed} == {e.key for e in stored}


def test_a_pool_subscription_gets_no_events_of_a_pool_whose_name_extends_it(
    daemon: DaemonProcess,
) -> None:
    short = fresh_pool(daemon)
    with short, fresh_pool(daemon, short.pool + "x") as long:
        sub = subscribe(short)
        long.allocate(1, list(range(4)))
        long.commit(1, list(range(4)))
        short.allocate(1, list(range(5)))
        short.commit(1, list(range(4)))
        got = drain(sub)
        sub.close()
    assert [b.pool for b in got] == [short.pool]


def test_closing_a_pool_removes_its_pages_and_a_new_pool_of_that_name_counts_on(
    daemon: DaemonProcess,
) -> None:
    name = f"p{next(_names)}"
    with fresh_pool(daemon, name) as first:
        sub = subscribe(first)
        first.allocate(1, list(range(9)))
        first.commit(1, list(range(9)))
    with fresh_pool(daemon, name) as second:  # the first closed with its last session
        second.allocate(1, list(range(5)))
        second.commit(1, list(range(4)))
    got = drain(sub)
    sub.close()
    events = [(b.first_seq_no + i, e) for b in got for i, e in enumerate(b.events)]
    assert [n for n, _ in events] == list(range(1, len(events) + 1)), "numbers restarted"
    kinds = [type(e).__name__ for _, e in events]
    stored, removed = "PageStoredEvent", "PageRemovedEvent"
    assert kinds == [stored, stored, removed, removed, stored, removed]


def test_a_subscriber_that_lost_events_rebuilds_its_view_from_a_snapshot(
    daemon: DaemonProcess,
) -> None:
    with fresh_pool(daemon) as client:
        client.allocate(1, list(range(13)))
        client.commit(1, list(range(13)))  # seq_no 1..3, before anyone listened
        # events go out after the reply: a snapshot publishes what is pending first, so
        # seq_no 1..3 are gone before the subscriber connects, however loaded the machine
        assert client.snapshot().seq_no == 3
        sub = subscribe(client)
        client.allocate(2, [*range(8), 50, 51, 52, 53, 54])
        client.commit(2, [*range(8), 50, 51, 52, 53, 54])  # one new page: seq_no 4
        first = drain(sub)
        assert first[0].first_seq_no == 4, "the subscriber sees a gap"
        snap = client.snapshot()
        assert snap.epoch == client.epoch and snap.seq_no == 4
        view = {p.key: p.page for p in snap.pages}  # the rebuilt view
        parents = {p.key: p.parent for p in snap.pages}
        for later in drain(sub):  # apply what came after the snapshot
            for event in later.events:
                assert later.first_seq_no > snap.seq_no
                view[event.key] = event.page
        seen: set[bytes] = set()
        for p in snap.pages:  # parents come before children
            assert p.parent in seen or p.parent not in parents
            seen.add(p.key)
        client.free(1)
        client.free(2)
        client.allocate(3, list(range(100, 100 + 4 * 16)))  # evicts all four cached pages
        for batch in drain(sub):
            assert batch.first_seq_no == snap.seq_no + 1
            for event in batch.events:
                assert isinstance(event, PageRemovedEvent) and view.pop(event.key) == event.page
        sub.close()
        assert view == {}, "the rebuilt view and the daemon's index disagree"
        assert client.snapshot().pages == []


def test_events_auto_gives_each_daemon_its_own_locked_socket(tmp_path: Path) -> None:
    args = ("--events", "auto", "--pool", "num_pages=8")
    with (
        DaemonProcess("--endpoint", f"ipc://{tmp_path}/a.sock", *args) as a,
        DaemonProcess("--endpoint", f"ipc://{tmp_path}/b.sock", *args) as b,
    ):
        assert "ipc://" + str(tmp_path / "a.events.sock") in a.output
        assert "ipc://" + str(tmp_path / "b.events.sock") in b.output
        with pytest.raises(RuntimeError, match="already serves"):  # the events path is locked too
            DaemonProcess(
                "--endpoint",
                f"ipc://{tmp_path}/c.sock",
                "--events",
                f"ipc://{tmp_path}/a.events.sock",
                *args[2:],
            ).start()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_events_format_vllm_through_a_daemon(tmp_path: Path) -> None:
    """vLLM's frames (topic, 8-byte big-endian seq, [ts, events]) decoded with plain msgpack:
    AllBlocksCleared at start, then BlockStored with the committed tokens and 64-bit hashes
    of the page keys, BlockRemoved on eviction."""
    import msgpack
    import zmq

    events, replay = f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"
    with DaemonProcess(
        "--endpoint",
        f"ipc://{tmp_path}/d.sock",
        "--events",
        events,
        "--events-format",
        "vllm",
        "--events-replay",
        replay,
        "--pool",
        "num_layers=1,num_kv_heads=1,head_dim=8,page_size=4,dtype=float16,num_pages=4",
    ) as daemon:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(events)
        time.sleep(0.3)
        with Client.connect(daemon.endpoint, namespace="tenant-x") as client:
            prompt = list(range(10, 19))
            client.allocate(1, prompt)
            client.commit(1, prompt)  # two pages
            keys = [p.key for p in client.snapshot().pages]
            client.free(1)
            client.allocate(2, list(range(100, 116)))  # every page: evicts both
        got = []
        while sub.poll(500):
            _topic, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        sub.close(linger=0)
        asker = zmq.Context.instance().socket(zmq.DEALER)  # the replay, from batch 0 on
        asker.connect(replay)
        asker.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while asker.poll(2000):
            _, _topic, seq, payload = asker.recv_multipart()
            if not payload:
                break  # the end marker
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        asker.close(linger=0)
    assert replayed[0][1][1] == [{"type": "AllBlocksCleared"}]  # numbered from the start time
    assert replayed[0][0] == got[0][0] - 1 > time.time_ns() - 600 * 10**9
    assert replayed[1:] == got  # a new daemon starts clean; the replay has what was sent
    seqs = [s for s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events_seen = [e for _, (_ts, evs, *_) in got for e in evs]
    stored = [e for e in events_seen if e["type"] == "BlockStored"]
    removed = [e for e in events_seen if e["type"] == "BlockRemoved"]
    assert len(stored) == 1  # one chain of two pages: one BlockStored
    (event,) = stored
    assert event["block_hashes"] == [int.from_bytes(k[-8:], "big") for k in keys]
    assert event["parent_block_hash"] is None
    assert event["token_ids"] == list(range(10, 18)) and event["block_size"] == 4
    assert event["medium"] == "CPU" and event["lora_name"] == "tenant-x"  # namespaces apart
    assert sorted(h for e in removed for h in e["block_hashes"]) == sorted(event["block_hashes"])
