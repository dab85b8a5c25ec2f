"""A load client of tests/test_restart_kills.py: one engine-like process, driven by JSON
lines and two signals, that loops allocate / write / commit / free / lookup on a small
pool until its daemon is gone.

    python tests/kill_load_client.py

Every page it writes for a commit holds its key's *marker* in every layer
(:func:`marker`: a SHA-256 of the page's prefix key and the layer, so a page of one
prompt, place or layer never passes for another's), written before the commit. Pages
it never commits hold bytes no committed page may hold: torn pages (layer 0 right, the
rest not), the marker of a prompt nobody commits (:data:`NEVER`), or, once the daemon
is gone, :func:`poison`.

It prints ``{"ready": true}`` once it imported torch (seconds), then reads commands
(stdin, one JSON object a line) and answers (stdout, JSON lines; ``at``: its
``time.monotonic()``, the machine's clock):

* ``{"op": "run", "endpoint": E, "seed": S, "stall_s": T}``: attach to E (again, after
  a restart: a new session), then loop the workload seeded by S. Prints
  ``{"committed": 1, "at": t}`` after its first commit. The loop ends when a call
  fails because the daemon is gone (Timeout) or was replaced (StaleEpoch): then, as an
  engine that still runs would, the client writes poison into every page it holds and
  never sent for commit (through its old mapping: the restarted daemon's withheld
  pages, or scratch once fenced) and prints
  ``{"lost": ERROR, "ops": N, "fenced": bool, "at": t}``. It also ends at SIGUSR2: the
  client frees what it holds, detaches and prints ``{"stopped": N, "at": t}``.
* SIGUSR1 (the test sends it as it kills the daemon): for T seconds, making no call,
  the client writes poison into the pages it holds uncommitted, again and again: an
  engine whose kernels still run through its old mapping while the daemon restarts.
* ``{"op": "probe"}``: one call to the (restarted) daemon, whose StaleEpoch fences the
  old mapping; the poison written again (it reaches only scratch pages now); prints
  ``{"fenced": bool, "error": NAME}``.
* ``{"op": "close"}``: detach and unmap; prints ``{"closed": true}``.

A hit page that does not hold its key's marker (``epoch``: of the daemon that granted
it), a never-committed prompt that hits, or an unexpected error is printed at once as
``{"bad": WHAT, "at": t}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from functools import cache

PAGE = 4  # tokens a page
NUM_PAGES = 32
POOL = (
    "name=default,num_layers=2,num_kv_heads=1,head_dim=8,page_size=4,dtype=float32,"
    f"num_pages={NUM_PAGES}"
)
LAYERS = 2
LAYER_PAGE_BYTES = 2 * PAGE * 1 * 8 * 4  # K and V, tokens, heads, head_dim, float32
FAMILIES, VARIANTS = 6, 4
HELD_PAGES = 8  # a client frees its oldest sequences past this many held pages


def prompt(f: int, v: int) -> list[int]:
    """Prompt (f, v): a stem of 1-3 pages that family f shares, then 1-3 pages its own."""
    stem, own, base = 1 + f % 3, 1 + (f + v) % 3, (f + 1) << 20
    return [base + t for t in range(stem * PAGE)] + [
        base + ((v + 1) << 12) + t for t in range(own * PAGE)
    ]


PROMPTS = [prompt(f, v) for f in range(FAMILIES) for v in range(VARIANTS)]
"""Every prompt a client commits (or a prefix of one): 60 distinct pages, a pool of 32."""
NEVER = [[((100 + n) << 20) + t for t in range(2 * PAGE)] for n in range(4)]
"""Prompts allocated and written, never committed: none of their keys may ever hit."""


@cache
def keys(tokens: tuple[int, ...]) -> list[bytes]:
    """The prefix keys of ``tokens``' full pages in the default namespace (what the
    daemon indexes them by)."""
    from kvcore.prefix import KeySpace, encode_tokens, page_keys, root_key

    root = root_key(KeySpace("default"))
    return [bytes(k) for k in page_keys(root, encode_tokens(tokens), PAGE)]


def marker(key: bytes, layer: int) -> bytes:
    """What layer ``layer`` of the page with prefix key ``key`` holds: a digest of both,
    repeated over the layer's bytes of the page."""
    return hashlib.sha256(b"kvcore-kill-marker" + key + bytes([layer])).digest() * (
        LAYER_PAGE_BYTES // 32
    )


def poison(key: bytes, layer: int) -> bytes:
    """Bytes that no key's marker is: what a page nobody committed may hold."""
    return hashlib.sha256(b"kvcore-kill-poison" + key + bytes([layer])).digest() * (
        LAYER_PAGE_BYTES // 32
    )


def expected() -> dict[bytes, bool]:
    """Every key the clients write: True for a committable one, False for :data:`NEVER`'s."""
    known = {k: True for p in PROMPTS for k in keys(tuple(p))}
    known.update({k: False for p in NEVER for k in keys(tuple(p))})
    return known


@cache
def _patterns() -> dict[bytes, str]:
    found = {bytes(LAYER_PAGE_BYTES): "zeros"}
    for key, committable in expected().items():
        for layer in range(LAYERS):
            name = f"key {key.hex()[:16]}{'' if committable else ' (never committed)'}"
            found[marker(key, layer)] = f"the marker of {name} for layer {layer}"
            found[poison(key, layer)] = f"the poison of {name} for layer {layer}"
    return found


def identify(data: bytes) -> str:
    """Whose bytes ``data`` (one layer of one page) are, as far as the clients wrote them."""
    return _patterns().get(data, "bytes no client writes")


# -- the process ----------------------------------------------------------------------


def emit(**message: object) -> None:
    print(json.dumps(message), flush=True)


@dataclass
class Held:
    """A sequence this client holds: its pages, their keys, and from which page on it
    may still write them (the pages before ``writable`` are hits or were sent for
    commit: never written again). ``parked``: set up, written, waiting (what a stall
    writes)."""

    pages: list[int]
    keys: list[bytes]
    writable: int
    committable: bool
    parked: bool = False


class Load:
    """One run of the workload on one session."""

    def __init__(self, client: object, seed: int, stall_s: float) -> None:
        import torch

        from kvcore import Client

        assert isinstance(client, Client)
        self.torch = torch
        self.client = client
        self.rng = random.Random(seed)
        self.stall_s = stall_s
        self.stopping = False
        self.held: dict[int, Held] = {}
        self.next_seq = os.getpid() << 32  # sequence ids are per pool: one space for all
        self.ops = 0
        self.committed = 0

    # bytes ------------------------------------------------------------------------

    def write(self, page: int, data: bytes, layer: int) -> None:
        view = self.client.kv_caches[layer][page].view(self.torch.int32)
        view.copy_(self.torch.frombuffer(bytearray(data), dtype=self.torch.int32).view(view.shape))

    def read(self, page: int, layer: int) -> bytes:
        view = self.client.kv_caches[layer][page].view(self.torch.int32)
        return view.contiguous().numpy().tobytes()

    def verify_hits(self, pages: list[int], page_keys: list[bytes], what: str) -> None:
        for i, (page, key) in enumerate(zip(pages, page_keys, strict=True)):
            for layer in range(LAYERS):
                data = self.read(page, layer)
                if data != marker(key, layer):
                    emit(
                        bad=f"{what}: hit page {i} (pool page {page}, key {key.hex()[:16]}) "
                        f"does not hold its marker in layer {layer} but {identify(data)} "
                        f"(op {self.ops} of session {self.client.session:x})",
                        epoch=f"{self.client.epoch:x}",  # of the daemon that granted the hit
                        at=time.monotonic(),
                    )

    # the workload -------------------------------------------------------------------

    def step(self) -> None:
        from kvcore.errors import OutOfPages

        self.ops += 1
        r = self.rng.random()
        try:
            if sum(len(h.pages) for h in self.held.values()) > HELD_PAGES:
                self.free(next(iter(self.held)))
            elif r < 0.5:
                self.serve()
            elif r < 0.65:
                self.hold_uncommitted()
            elif r < 0.8 and self.held:
                self.free(self.rng.choice(list(self.held)))
            else:
                tokens = self.rng.choice(PROMPTS + NEVER)
                hit = self.client.lookup(tokens, compute_last=False)
                if tokens in NEVER and hit.num_cached_tokens:
                    emit(
                        bad=f"never-committed prompt {NEVER.index(tokens)} hits",
                        at=time.monotonic(),
                    )
        except OutOfPages:
            pass  # withheld pages, or every page held: an engine waits and retries

    def serve(self) -> None:
        """Allocate a prompt (or a prefix of it), check its hit pages, write its new
        pages, commit (sometimes in two parts), then free it or hold it."""
        full = self.rng.choice(PROMPTS)
        n = self.rng.randint(1, len(full) // PAGE)
        tokens = full[: n * PAGE]
        seq = self.next_seq
        self.next_seq += 1
        got = self.client.allocate(seq, tokens, compute_last=False)
        h = got.num_cached_tokens // PAGE
        page_keys = keys(tuple(tokens))
        self.verify_hits(got.pages[:h], page_keys[:h], f"prompt {PROMPTS.index(full)}")
        held = self.held[seq] = Held(got.pages, page_keys, h, True)
        cut = self.rng.randint(h + 1, n - 1) if n - h >= 2 and self.rng.random() < 0.3 else n
        for lo, hi in ((h, cut), (cut, n)):
            if lo == hi:
                continue
            for i in range(lo, hi):
                for layer in range(LAYERS):
                    self.write(got.pages[i], marker(page_keys[i], layer), layer)
            held.writable = hi  # from the moment the commit is sent: never written again
            self.client.commit(seq, tokens[: hi * PAGE])
            if not self.committed:
                emit(committed=1, at=time.monotonic())
            self.committed += 1
        held.parked = True
        if self.rng.random() < 0.5:
            self.free(seq)

    def hold_uncommitted(self) -> None:
        """Allocate a prompt nobody commits, or a committable one left torn, write it and
        hold it without committing."""
        never = self.rng.random() < 0.5
        if never:
            tokens = self.rng.choice(NEVER)
        else:
            full = self.rng.choice(PROMPTS)
            tokens = full[: self.rng.randint(1, len(full) // PAGE) * PAGE]
        seq = self.next_seq
        self.next_seq += 1
        got = self.client.allocate(seq, tokens, compute_last=False)
        h = got.num_cached_tokens // PAGE
        page_keys = keys(tuple(tokens))
        if never and h:
            emit(
                bad=f"never-committed prompt {NEVER.index(tokens)} hits {h} pages",
                at=time.monotonic(),
            )
        self.verify_hits(got.pages[:h], page_keys[:h], "uncommitted")
        held = self.held[seq] = Held(got.pages, page_keys, h, not never)
        self.scribble(held, torn=True)
        held.parked = True

    def free(self, seq: int) -> None:
        held = self.held.pop(seq)  # before the request goes: never written again
        if held.writable < len(held.pages):
            self.scribble(held, torn=True)  # an engine's last writes before an abort
        self.client.free(seq)

    def scribble(self, held: Held, torn: bool) -> None:
        """Write the pages ``held`` may still write: a torn page (its marker in layer 0,
        another's bytes in the rest) or a never-committed prompt's own marker while the
        daemon lives; poison once it is gone."""
        for i in range(held.writable, len(held.pages)):
            key = held.keys[i]
            for layer in range(LAYERS):
                if not torn:
                    data = poison(key, layer)
                elif not held.committable or layer == 0:
                    data = marker(key, layer)
                else:
                    data = poison(key, layer)
                self.write(held.pages[i], data, layer)

    def lost(self) -> None:
        for held in self.held.values():
            self.scribble(held, torn=False)

    def stall(self) -> None:
        """SIGUSR1: no call for ``stall_s``; poison written into the parked pages again
        and again, through whatever the mapping is now."""
        end = time.monotonic() + self.stall_s
        while True:
            for held in list(self.held.values()):
                if held.parked:
                    self.scribble(held, torn=False)
            if time.monotonic() >= end:
                return
            time.sleep(0.005)

    def stop(self) -> None:
        for seq in list(self.held):
            self.free(seq)


CURRENT: list[Load] = []  # the run the signal handlers act on


def main() -> None:
    import torch  # noqa: F401  (seconds on 2 busy cores: before the test counts on this client)

    from kvcore import Client
    from kvcore.errors import KVCoreError, StaleEpoch, Timeout

    signal.signal(signal.SIGUSR1, lambda *_: CURRENT and CURRENT[0].stall())
    signal.signal(signal.SIGUSR2, lambda *_: CURRENT and setattr(CURRENT[0], "stopping", True))
    client: Client | None = None
    endpoint = ""
    stale = False  # the session's daemon is gone: reconnect() to run again
    load: Load | None = None
    emit(ready=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "run":
            if client is not None and stale and endpoint == cmd["endpoint"]:
                client.reconnect()
            else:
                if client is not None:
                    client.close()
                endpoint = cmd["endpoint"]
                client = Client.connect(endpoint)
            stale = False
            load = Load(client, cmd["seed"], cmd.get("stall_s", 0.0))
            CURRENT[:] = [load]
            try:
                while not load.stopping:
                    load.step()
                load.stop()
            except (Timeout, StaleEpoch) as exc:
                error = type(exc).__name__
            except KVCoreError as exc:
                error = type(exc).__name__
                emit(bad=f"unexpected {error}: {exc}", at=time.monotonic())
            else:
                CURRENT.clear()
                client.close()
                client = None
                emit(stopped=load.ops, at=time.monotonic())
                continue
            CURRENT.clear()
            stale = True
            load.lost()
            emit(lost=error, ops=load.ops, fenced=client._fenced, at=time.monotonic())
        elif cmd["op"] == "probe":
            assert client is not None and load is not None
            try:
                client.heartbeat()
                error = ""
            except KVCoreError as exc:
                error = type(exc).__name__
            load.lost()
            emit(fenced=client._fenced, error=error)
        elif cmd["op"] == "close":
            if client is not None:
                client.close()
            client = load = None
            stale = False
            emit(closed=True)


if __name__ == "__main__":
    main()
