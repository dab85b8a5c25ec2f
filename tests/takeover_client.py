"""A client process under load for tests/test_takeover.py: ``python tests/takeover_client.py
ENDPOINT SECONDS``.

It loops rounds of allocate (checking that every hit page holds its marker), write
the markers of the pages it computed, commit, free, over 8 prompts, for SECONDS; a
StaleEpoch ends the round and the client attaches again (retrying while no daemon
answers) before it runs the next. It prints ``ready`` after its first round, then at
the end one JSON object: rounds, reattaches (attaches that worked), attempts (all
attaches tried), errors (any other failure), wrong (hit pages with other bytes),
hits_after (cached tokens of the first allocate after each re-attach) and gap_s
(the longest time between two rounds that worked).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvcore import Client
from kvcore.errors import KVCoreError, StaleEpoch, Timeout

PAGE, PAGES = 4, 6  # the pool's tokens a page; pages a prompt


def prompt(n: int) -> list[int]:
    return [1000 * n + t for t in range(PAGES * PAGE)]


def marker(n: int, i: int) -> float:
    return float(100 * n + i + 1)


def one_round(client: Client, seq: int, n: int) -> tuple[int, int]:
    """Allocate prompt ``n`` as sequence ``seq``, check its hits, write the rest, commit,
    free: (cached tokens, hit pages holding other bytes)."""
    got = client.allocate(seq, prompt(n), compute_last=False)
    hit = got.num_cached_tokens // PAGE
    wrong = 0
    for layer in client.kv_caches:
        for i, page in enumerate(got.pages):
            if i < hit:
                wrong += int(not bool(torch.all(layer[page] == marker(n, i))))
            else:
                layer[page].fill_(marker(n, i))
    client.commit(seq, prompt(n))
    client.free(seq)
    return got.num_cached_tokens, wrong


def main(endpoint: str, seconds: float) -> None:
    client = Client.connect(endpoint)
    report = {"rounds": 0, "reattaches": 0, "attempts": 0, "errors": [], "wrong": 0}
    hits_after: list[int] = []
    gap = 0.0
    last = time.monotonic()
    end = last + seconds
    fresh = False
    while time.monotonic() < end:
        try:
            cached, wrong = one_round(client, report["rounds"] + 1, report["rounds"] % 8)
        except StaleEpoch:
            while True:  # the daemon was replaced: attach to the new one
                report["attempts"] += 1
                try:
                    client.reconnect()
                    break
                except (StaleEpoch, Timeout):
                    time.sleep(0.01)
            report["reattaches"] += 1
            fresh = True
            continue
        except KVCoreError as exc:
            report["errors"].append(repr(exc))
            continue
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        report["wrong"] += wrong
        if fresh:
            hits_after.append(cached)
            fresh = False
        if report["rounds"] == 0:
            print("ready", flush=True)
        report["rounds"] += 1
    client.close()
    print(json.dumps({**report, "hits_after": hits_after, "gap_s": gap}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
