"""kvcore.daemon.mappings: a real process that maps a pool's segment is seen holding it
until it fences its mapping (the client's rule at StaleEpoch), and a mapping is stale
exactly while its process has more mappings than sessions that said they map."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from kvcore_ipc.shm import HostRegion

from kvcore.daemon.mappings import segment_mappings, stale_mappers

CHILD = textwrap.dedent(
    """
    import sys
    from kvcore_ipc.messages import HostMemory
    from kvcore_ipc.shm import HostRegion

    region = HostRegion.attach(HostMemory(sys.argv[1], int(sys.argv[2])))
    print("mapped", flush=True)
    sys.stdin.readline()
    region.fence()
    print("fenced", flush=True)
    sys.stdin.readline()
    """
)


def test_a_process_maps_the_segment_until_it_fences() -> None:
    region = HostRegion.create(1 << 16, "kvcore-test-maps")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, region.name, str(1 << 16)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "mapped"
        held = segment_mappings(region.name)
        assert held is not None and held[child.pid] == 1
        assert stale_mappers(held, Counter()) == {child.pid: 1}  # no session accounts for it
        assert stale_mappers(held, Counter({child.pid: 1})) == {}
        assert segment_mappings("kvcore-test-no-such-segment") == Counter()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "fenced"
        held = segment_mappings(region.name)
        assert held is not None and child.pid not in held  # scratch pages name no segment
    finally:
        child.kill()
        child.wait()
        region.close()


@given(
    mappings=st.dictionaries(st.integers(1, 50), st.integers(1, 4)),
    mappers=st.dictionaries(st.integers(1, 50), st.integers(0, 4)),
)
def test_stale_is_what_sessions_do_not_account_for(
    mappings: dict[int, int], mappers: dict[int, int]
) -> None:
    stale = stale_mappers(Counter(mappings), Counter(mappers))
    for pid, n in mappings.items():
        assert stale.get(pid, 0) == max(0, n - mappers.get(pid, 0))
    assert set(stale) <= set(mappings)
