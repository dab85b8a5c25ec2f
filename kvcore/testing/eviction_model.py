"""Reference models of the eviction policies (kvcore/eviction.py), in the plainest terms:
lists scanned and rebuilt, no ordered dicts, no O(1) tricks. The Manager's state
machine (kvcore/testing/manager_model.py) holds a subject's evictions to the model of
the subject's policy, page for page.

Entries are pool pages (or a tier's keys); keys are whatever names an entry's prefix
in the caller (the model's prefix ids; a tier's key), the same whenever the entry
holds that prefix. A tier's touch is ``pin``, ``hit`` and ``release`` of the one entry,
as kvcore.eviction's ``touch`` is for every policy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

from kvcore.eviction import AdaptiveSLRU

E = TypeVar("E", bound=Hashable)  # an entry: a page (int), or a tier's key


@dataclass(slots=True)
class LRUModel(Generic[E]):
    """Least recently released first."""

    capacity: int
    order: list[E] = field(default_factory=list)  # evictable pages, least recent first

    def evictable(self) -> list[E]:
        return list(self.order)

    def pin(self, pages: Sequence[E]) -> None:
        self.order = [page for page in self.order if page not in pages]

    def hit(self, pages: Sequence[E]) -> None:
        pass

    def release(self, released: Sequence[tuple[E, Hashable]], whole: bool) -> None:
        self.order += [page for page, _ in released]

    def evict(self) -> E:
        return self.order.pop(0)

    def drop(self, item: E) -> None:
        self.pin([item])


@dataclass(slots=True)
class AdaptiveSLRUModel(Generic[E]):
    """kvcore.eviction.AdaptiveSLRU's docstring, line by line (its parameters are the
    class's: GHOST, INIT, LO, HI)."""

    capacity: int
    probation: list[E] = field(default_factory=list)  # least recent first
    protected: list[E] = field(default_factory=list)  # least recent first
    marked: set[E] = field(default_factory=set)  # hit since admitted
    keys: dict[E, Hashable] = field(default_factory=dict)  # evictable page -> its key
    ghost_new: list[Hashable] = field(default_factory=list)  # G1, oldest first
    ghost_hit: list[Hashable] = field(default_factory=list)  # G2, oldest first
    target: float = -1.0  # set from the capacity

    def __post_init__(self) -> None:
        self.target = AdaptiveSLRU.INIT * self.capacity

    def evictable(self) -> list[E]:
        return self.probation + self.protected

    def pin(self, pages: Sequence[E]) -> None:
        for page in pages:
            self.keys.pop(page, None)
        self.probation = [page for page in self.probation if page not in pages]
        self.protected = [page for page in self.protected if page not in pages]

    def hit(self, pages: Sequence[E]) -> None:
        self.marked |= set(pages)

    def release(self, released: Sequence[tuple[E, Hashable]], whole: bool) -> None:
        chain = whole
        for page, key in reversed(released):  # the head first
            if page in self.marked:
                continue
            found = key in self.ghost_new or key in self.ghost_hit
            if key in self.ghost_new:
                self.ghost_new.remove(key)
                step = max(1.0, len(self.ghost_hit) / max(len(self.ghost_new), 1))
                self.target = max(AdaptiveSLRU.LO * self.capacity, self.target - step)
            elif key in self.ghost_hit:
                self.ghost_hit.remove(key)
                step = max(1.0, len(self.ghost_new) / max(len(self.ghost_hit), 1))
                self.target = min(AdaptiveSLRU.HI * self.capacity, self.target + step)
            chain = chain and found
            if chain:
                self.marked.add(page)
        for page, key in released:  # the tail first
            self.keys[page] = key
            (self.protected if page in self.marked else self.probation).append(page)
        self.demote()

    def drop(self, item: E) -> None:
        self.pin([item])
        self.marked.discard(item)

    def demote(self) -> None:
        while len(self.protected) > self.target:
            self.probation.append(self.protected.pop(0))

    def evict(self) -> E:
        self.demote()
        page = (self.probation or self.protected).pop(0)
        ghost = self.ghost_hit if page in self.marked else self.ghost_new
        self.marked.discard(page)
        ghost.append(self.keys.pop(page))
        if len(ghost) > max(int(AdaptiveSLRU.GHOST * self.capacity), 1):
            ghost.pop(0)
        return page


PolicyModel: TypeAlias = LRUModel[E] | AdaptiveSLRUModel[E]
MODELS: dict[str, type[LRUModel[Any]] | type[AdaptiveSLRUModel[Any]]] = {
    "lru": LRUModel,
    "adaptive-slru": AdaptiveSLRUModel,
}
"""kvcore.eviction.POLICIES' names -> their models (tests/test_eviction.py checks they
are the same names)."""
