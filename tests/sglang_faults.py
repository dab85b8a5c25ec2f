"""KVCoreStorage's faults, with SGLang's real host pool and factory (run in SGLang's venv by
tests/test_sglang_faults.py, never imported by pytest in the main environment).

    python tests/sglang_faults.py ENDPOINT

Prints one JSON line per step and waits for a line on stdin before the next, so the test
can stop and restart the daemon between steps:

1. ``stored``: 8 pages set in one call on a pool of 4 (the pool takes 4; the rest are
   misses, not exceptions); ``clear()`` keeps them; SGLang's StorageMetrics count them;
2. (daemon stopped) ``gone``: exists / get / set answer misses, nothing raises;
3. (daemon started again, same endpoint) ``back``: after ``retry_s`` the backend has
   attached again: a set stores, an exists finds it.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvcore.bench.sglang import host_pool, kvcore_backend, page_keys
from kvcore.layout import KVLayout

LAYOUT = KVLayout(2, 2, 16, 16, "bfloat16", 8)
RETRY_S = 1.0


def step(name: str, **figures: object) -> None:
    print(json.dumps({"step": name, **figures}), flush=True)
    sys.stdin.readline()


def main(endpoint: str) -> None:
    host = host_pool(LAYOUT, "layer_first", 16)
    backend = kvcore_backend(endpoint, host, timeout_s=1, retry_s=RETRY_S)
    keys = page_keys(LAYOUT.page_size, 8, seed=0)
    source = torch.arange(8 * LAYOUT.page_size)
    target = torch.arange(8 * LAYOUT.page_size, 16 * LAYOUT.page_size)
    stored = backend.batch_set_v1(keys, source)
    backend.clear()  # SGLang's cache flush: the shared pages stay
    got = backend.batch_get_v1(keys[:4], target[: 4 * LAYOUT.page_size])
    metrics = backend.get_stats()
    step(
        "stored",
        set=stored,
        exists=backend.batch_exists(keys),
        get=got,
        backup_pgs=metrics.backup_pgs,
        prefetch_pgs=metrics.prefetch_pgs,
        prefetch_by_source=metrics.prefetch_pgs_by_source,
        after=backend.get_stats().backup_pgs,
    )
    step(
        "gone",
        exists=backend.batch_exists(keys),
        get=backend.batch_get_v1(keys[:2], target[: 2 * LAYOUT.page_size]),
        set=backend.batch_set_v1(keys[:2], source[: 2 * LAYOUT.page_size]),
    )
    time.sleep(RETRY_S + 0.5)
    again = backend.batch_set_v1(keys[:2], source[: 2 * LAYOUT.page_size])
    step("back", set=again, exists=backend.batch_exists(keys[:2]))
    backend.close()


if __name__ == "__main__":
    main(sys.argv[1])
