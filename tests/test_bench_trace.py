"""``kvcore bench trace``: the references replay what the Manager does, block for block,
and the command reports every policy beside them (kvcore/bench/trace.py).

The slice in tests/data is the first 300 requests of the shared synthetic trace
(tests/data/README.md)."""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.bench import block_trace, block_workloads, trace
from kvcore.bench.block_trace import BlockRequest
from kvcore.errors import BadRequest
from kvcore.eviction import POLICIES
from kvcore.layout import KVLayout
from kvcore.manager import Manager

SLICE = Path(__file__).parent / "data" / "mooncake_synthetic_300.jsonl.gz"
BLOCK = 512


def _manager_hits(requests: list[BlockRequest], pages: int, policy: str, block: int = BLOCK) -> int:
    layout = KVLayout(page_size=block, num_pages=pages, **trace.SIM_LAYOUT)  # type: ignore[arg-type]
    manager = Manager(layout, eviction=policy)
    hit = block_trace.replay(manager, requests, block)
    manager.check_integrity()
    return hit


def _longest(requests: list[BlockRequest]) -> int:
    return max(len(r.hash_ids) for r in requests)


@pytest.fixture(scope="module")
def sliced() -> list[BlockRequest]:
    return block_trace.load(SLICE)


@pytest.mark.parametrize("fraction", [0.03, 0.1, 0.3, 1.0])
def test_the_lru_reference_is_the_manager_under_lru_to_the_token(
    sliced: list[BlockRequest], fraction: float
) -> None:
    pages = max(round(fraction * block_trace.distinct_blocks(sliced)), _longest(sliced))
    assert block_trace.lru_hits(sliced, pages, BLOCK) == _manager_hits(sliced, pages, "lru")


@st.composite
def _traces(draw: st.DrawFn) -> tuple[list[BlockRequest], int, int]:
    """Requests drawn as paths of a small prefix tree (so ids are unique per prefix),
    with partial last blocks and lengths on block boundaries; a block of 4 tokens."""
    block = 4
    children: dict[tuple[int, ...], int] = {}
    requests = []
    for _ in range(draw(st.integers(1, 25))):
        path: tuple[int, ...] = ()
        ids = []
        for _ in range(draw(st.integers(1, 6))):
            branch = draw(st.integers(0, 2))
            node = (*path, branch)
            block_id = children.setdefault(node, len(children))
            ids.append(block_id)
            path = node
        tail = draw(st.integers(1, block))
        requests.append(BlockRequest(0, (len(ids) - 1) * block + tail, 0, tuple(ids)))
    pages = draw(st.integers(6, 30))
    return requests, pages, block


@settings(max_examples=150, deadline=None)
@given(_traces())
def test_the_lru_reference_equals_the_manager_on_any_trace(
    drawn: tuple[list[BlockRequest], int, int],
) -> None:
    requests, pages, block = drawn
    assert block_trace.lru_hits(requests, pages, block) == _manager_hits(
        requests, pages, "lru", block
    )


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_stays_between_nothing_and_the_optimum_on_the_slice(
    sliced: list[BlockRequest], policy: str
) -> None:
    distinct = block_trace.distinct_blocks(sliced)
    for fraction in (0.05, 0.25):
        pages = max(round(fraction * distinct), _longest(sliced))
        hit = _manager_hits(sliced, pages, policy)
        assert 0 < hit <= block_trace.belady_hits(sliced, pages, BLOCK)
    everything = _manager_hits(sliced, distinct, policy)  # all fits: every policy is equal
    assert everything == block_trace.lru_hits(sliced, distinct, BLOCK)
    assert everything == block_trace.belady_hits(sliced, distinct, BLOCK)


def _run(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    trace.add_arguments(parser)
    return trace.run(parser.parse_args([*argv, "--no-progress"]))


def test_the_record_has_every_capacity_and_policy_beside_the_references() -> None:
    record = _run("--trace", str(SLICE), "--capacities", "0.05,1", "--tiers", "--repeat", "2")
    assert record["requests"] == 300 and record["default_policy"] in POLICIES
    assert set(record["bytes_per_page"]) == set(POLICIES)
    assert all(size > 0 for size in record["bytes_per_page"].values())
    low, full = record["capacities"]
    assert set(low["policies"]) == set(POLICIES)
    assert low["lru"] <= low["belady"] and full["lru"] == full["belady"]
    lru = low["policies"]["lru"]
    assert lru["hit_rate"] == low["lru"] and lru["gap_closed"] == 0 and lru["ops_over_lru"] == 1
    assert full["policies"]["lru"]["gap_closed"] is None  # the references meet
    tiered = low["tiered"]
    assert tiered["policy"] == record["default_policy"]
    assert sum(tiered["by_tier"].values()) == pytest.approx(tiered["hit_rate"])
    assert tiered["by_tier"]["host"] > 0  # the host tier served hits the pool had evicted
    assert tiered["hit_rate"] >= low["policies"][record["default_policy"]]["hit_rate"]


def test_the_command_prints_json_and_draws_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "hits.png"
    argv = ["bench", "trace", "--json", "--trace", str(SLICE), "--limit", "100"]
    argv += ["--capacities", "0.1,1", "--plot", str(png), "--no-progress", "--repeat", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["requests"] == 100 and record["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", sorted(block_workloads.WORKLOADS))
def test_each_workload_is_a_valid_seeded_trace(name: str, tmp_path: Path) -> None:
    requests = block_workloads.WORKLOADS[name](3)
    assert requests == block_workloads.WORKLOADS[name](3)  # seeded
    path = tmp_path / "w.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp_ms,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in requests
        )
    )
    assert block_trace.load(path) == requests  # the format the loader checks


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "not a trace request"),
        ('{"input_length": 10}', "not a trace request"),
        ('{"input_length": -1, "hash_ids": []}', "ints >= 0"),
        ('{"input_length": 1024, "hash_ids": [1]}', "1 hash_ids for 1024 tokens"),
        ('{"input_length": 10, "hash_ids": [true]}', "ints >= 0"),
    ],
)
def test_a_bad_line_is_refused_by_its_number(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.write('{"input_length": 600, "hash_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(BadRequest, match=f":2: .*{says}"):
        block_trace.load(path)


def test_no_trace_and_none_beside_the_checkout_names_the_way_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(block_trace, "default_trace", lambda: None)
    with pytest.raises(BadRequest, match="--trace PATH or --workload NAME"):
        _run()
