"""Eviction policies: the order in which a pool (or a lower tier) gives up its evictable entries.

An evictable entry is a committed page (indexed) that no sequence holds, or an
entry of a host or disk tier; evicting it drops it from the prefix index (the
tier) so its room can be reused. A policy sees, each O(1) amortised per entry:

* ``add(released, whole)``: entries became evictable, as one release lists them
  (a sequence's pages tail first), each with its key (the prefix key; a tier's
  key), which is the same whenever that entry holds that prefix; ``whole``: they
  are every page of the chain from its head (none stayed held or went free);
* ``hit(items)``: a request was served these entries (held or evictable);
* ``remove(item)``: an evictable entry was pinned again (it comes back through
  ``add``), ``drop(item)``: it left for good (a tier discards it);
* ``touch(item)``: an evictable entry was read where it lies (a tier's hit);
* ``evict(n)``: room is needed; the policy gives up the ``n`` entries it values
  least, in order (one call per allocation: the per-entry cost is one loop step).

Pages a sequence holds are never in a policy, so they are never evicted. Tails
go before their heads: a request that hits a tail also hits its head, and a
release lists the tail first, so every policy here keeps a chain's head more
recent and at least as protected as its cached tails, and evicts the oldest of
its least protected entries (the Manager's state machine checks this at every
eviction, once per policy: kvcore/testing/manager_model.py, tests/test_manager_conformance.py).

The choice is a pool setting (``eviction=`` in ``--pool``, TOML or
``KVCORE_POOL_EVICTION``; the pool's tiers use it too). It enters neither the
key space nor the wire: two pools that evict differently hold the same bytes
under the same keys. docs/concepts.md ("Eviction") gives the measurements that
chose the default.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

from kvcore.errors import BadRequest

T = TypeVar("T", bound=Hashable)  # an entry: a PageId in a pool, a TierKey in a tier


class EvictionPolicy(Protocol[T]):
    """The evictable entries of one pool or tier, ordered by a policy (module docstring).
    Callers keep the contract: ``add`` only entries not in the policy, ``remove``,
    ``drop`` and ``touch`` only entries in it, ``evict(n)`` only with n <= its length."""

    name: str

    def __len__(self) -> int: ...

    def __contains__(self, item: object) -> bool: ...

    def __iter__(self) -> Iterator[T]:
        """Every evictable entry, in no promised order (integrity checks)."""
        ...

    def add(self, released: Sequence[tuple[T, bytes]], whole: bool = True) -> None: ...

    def hit(self, items: Iterable[T]) -> None: ...

    def remove(self, item: T) -> None: ...

    def drop(self, item: T) -> None: ...

    def touch(self, item: T) -> None: ...

    def evict(self, n: int) -> list[T]: ...


class LRU(Generic[T]):
    """Least recently released (or touched) first: vLLM's and SGLang's policy, and the
    reference (kvcore/bench/block_trace.py's ``lru_hits``). One ordered-dict entry per
    evictable entry."""

    __slots__ = ("_order",)
    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[T, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, item: object) -> bool:
        return item in self._order

    def __iter__(self) -> Iterator[T]:
        return iter(self._order)

    def add(self, released: Sequence[tuple[T, bytes]], whole: bool = True) -> None:
        order = self._order
        for item, _ in released:
            order[item] = None

    def hit(self, items: Iterable[T]) -> None:
        pass  # recency is the release order alone

    def remove(self, item: T) -> None:
        del self._order[item]

    drop = remove

    def touch(self, item: T) -> None:
        self._order.move_to_end(item)

    def evict(self, n: int) -> list[T]:
        popitem = self._order.popitem
        return [popitem(last=False)[0] for _ in range(n)]


class AdaptiveSLRU(Generic[T]):
    """Segmented LRU whose protected share adapts to what comes back, as ARC's does.

    ::

        probation  P: entries not hit since they were admitted   LRU, oldest evicted first
        protected  Q: entries hit (or re-admitted from ghost G2)  LRU, oldest demoted to P
        ghosts     G1: keys evicted from P unhit;  G2: keys evicted after a hit
                   (FIFOs of at most GHOST x capacity keys each; keys only, no bytes)

    * Release: a hit entry goes to Q; an entry admitted under a key found in a
      ghost goes to Q too if the release is the whole chain and every entry before
      it (head side) was hit or found in a ghost; any other entry goes to P. While
      Q holds more than ``target`` entries, Q's oldest moves to P's recent end.
    * A key found in G1 means P was too small: ``target`` shrinks by
      max(1, |G2| / |G1|); found in G2, Q was: it grows by max(1, |G1| / |G2|).
      ``target`` starts at INIT x capacity and stays within [LO, HI] x capacity.
    * Evict: P's oldest (Q's oldest if P is empty); its key enters G2 if it was ever
      hit, else G1.

    Tails before heads: a hit on a tail is a hit on its head, a release lists the
    tail first, and the ghost rule admits to Q only an unbroken run from the
    head; so a head is in Q whenever a tail of it is, and is the more recent
    in either list.

    Parameters (GHOST, INIT, LO, HI below) were chosen on seeded workloads other
    than the shared trace (kvcore/bench/block_workloads.py; docs/concepts.md,
    "Eviction", has the figures and the policies tried).

    Memory: per evictable entry one ordered-dict entry holding its key (the key
    object is the index's); per hit entry a set slot; ghosts at most 2 x GHOST
    keys per page of capacity, which they keep alive (docs/concepts.md, "Eviction",
    has the measured bytes)."""

    __slots__ = (
        "_ghost_hit",
        "_ghost_max",
        "_ghost_new",
        "_hi",
        "_lo",
        "_marked",
        "_probation",
        "_protected",
        "target",
    )
    name = "adaptive-slru"
    GHOST = 1.0  # each ghost's length, x capacity
    INIT = 0.5  # the protected target at start, x capacity
    LO, HI = 0.1, 0.9  # the bounds of the protected target, x capacity

    def __init__(self, capacity: int) -> None:
        # entry -> its key (for its ghost), least recent first; an entry is in one of them
        self._probation: OrderedDict[T, bytes] = OrderedDict()
        self._protected: OrderedDict[T, bytes] = OrderedDict()
        self._marked: set[T] = set()  # entries hit since admitted (held or evictable)
        self._ghost_new: OrderedDict[bytes, None] = OrderedDict()  # G1
        self._ghost_hit: OrderedDict[bytes, None] = OrderedDict()  # G2
        self._ghost_max = max(int(self.GHOST * capacity), 1)
        self._lo, self._hi = self.LO * capacity, self.HI * capacity
        self.target = self.INIT * capacity  # entries Q may hold before it demotes

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, item: object) -> bool:
        return item in self._probation or item in self._protected

    def __iter__(self) -> Iterator[T]:
        return itertools.chain(self._probation, self._protected)

    @property
    def num_ghosts(self) -> int:
        """Keys the ghosts remember (at most 2 x GHOST x capacity)."""
        return len(self._ghost_new) + len(self._ghost_hit)

    def add(self, released: Sequence[tuple[T, bytes]], whole: bool = True) -> None:
        marked, new, hit = self._marked, self._ghost_new, self._ghost_hit
        chain = whole  # every entry so far, from the head, was hit or a ghost's
        for item, key in reversed(released):  # head first: decide where each goes
            if item in marked:
                continue
            if key in new or key in hit:  # (rare: tested first, so no call in most cases)
                if self._readmitted(key) and chain:
                    marked.add(item)
            else:
                chain = False
        probation, protected = self._probation, self._protected
        for item, key in released:  # tail first: the head ends the most recent
            (protected if item in marked else probation)[item] = key
        if len(protected) > self.target:
            self._demote()

    def _readmitted(self, key: bytes) -> bool:
        """Whether ``key`` was in a ghost (it leaves it), adapting ``target``."""
        new, hit = self._ghost_new, self._ghost_hit
        if key in new:
            del new[key]
            self.target = max(self._lo, self.target - max(1.0, len(hit) / max(len(new), 1)))
            return True
        if key in hit:
            del hit[key]
            self.target = min(self._hi, self.target + max(1.0, len(new) / max(len(hit), 1)))
            return True
        return False

    def hit(self, items: Iterable[T]) -> None:
        self._marked.update(items)

    def remove(self, item: T) -> None:
        if self._protected.pop(item, None) is None:
            del self._probation[item]

    def drop(self, item: T) -> None:
        self.remove(item)
        self._marked.discard(item)

    def touch(self, item: T) -> None:
        key = self._protected.pop(item, None)
        if key is None:
            key = self._probation.pop(item)
        self._marked.add(item)
        self.add(((item, key),), True)

    def evict(self, n: int) -> list[T]:
        if len(self._protected) > self.target:
            self._demote()
        probation, protected, marked = self._probation, self._protected, self._marked
        new, hit, most = self._ghost_new, self._ghost_hit, self._ghost_max
        victims: list[T] = []
        for _ in range(n):
            item, key = (probation or protected).popitem(last=False)
            if item in marked:
                marked.discard(item)
                ghost = hit
            else:
                ghost = new
            ghost[key] = None
            if len(ghost) > most:
                ghost.popitem(last=False)
            victims.append(item)
        return victims

    def _demote(self) -> None:
        protected, probation = self._protected, self._probation
        while len(protected) > self.target:
            item, key = protected.popitem(last=False)
            probation[item] = key


POLICIES: dict[str, Callable[[int], EvictionPolicy[Hashable]]] = {
    "lru": LRU,
    "adaptive-slru": AdaptiveSLRU,
}
"""name -> the policy's constructor (of the capacity in entries)."""
DEFAULT = "adaptive-slru"


def make_policy(name: str, capacity: int) -> EvictionPolicy[T]:
    """The policy ``name`` over ``capacity`` entries; BadRequest naming the known ones
    for any other name."""
    try:
        return POLICIES[name](capacity)  # type: ignore[return-value]
    except (KeyError, TypeError):
        raise BadRequest(
            f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}"
        ) from None
