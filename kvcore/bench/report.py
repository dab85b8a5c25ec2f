"""The short table ``kvcore bench NAME`` prints without ``--json``: headline figures,
each with its target (if it has one) and whether the run met it.

A benchmark module declares its headline as ``HEADLINE: tuple[Figure, ...]``;
each :class:`Figure` names a key of the record ``run`` returns (dotted for a
nested one: ``"backends.torch.decode.time_ms"``) and, optionally, a
:class:`Target`. The record itself is unchanged: ``--json`` prints all of it.
A target marked ``required`` (correctness, not speed) fails the run: ``kvcore
bench`` prints the report, then exits 1 naming each one missed (:func:`unmet`).
Numbers are shown for people: ``217,100`` not ``2.171e+05``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass(frozen=True, slots=True)
class Target:
    """``value <op> factor * bound``; ``bound`` is a number (True or False for a flag)
    or another figure's key (``==`` on floats allows a relative 1e-9). ``required``:
    a run that misses it fails; speed targets, which move with the machine's load,
    are only reported."""

    op: str  # "<=", ">=" or "=="
    bound: float | str
    factor: float = 1.0
    required: bool = False

    def __post_init__(self) -> None:
        assert self.op in ("<=", ">=", "=="), f"unknown comparison {self.op!r}"

    def bound_of(self, record: dict[str, Any]) -> Any:
        bound = lookup(record, self.bound) if isinstance(self.bound, str) else self.bound
        scaled = self.factor != 1.0 and isinstance(bound, (int, float))
        return bound * self.factor if scaled else bound

    def met(self, value: Any, record: dict[str, Any]) -> bool | None:
        """None when it cannot be judged (a figure missing, or null in the record)."""
        bound = self.bound_of(record)
        if not isinstance(value, (int, float)) or not isinstance(bound, (int, float)):
            return None
        if self.op == "<=":
            return value <= bound
        if self.op == ">=":
            return value >= bound
        return math.isclose(value, bound, rel_tol=1e-9, abs_tol=0.0)

    def describe(self, record: dict[str, Any]) -> str:
        bound = self.bound_of(record)
        if not isinstance(self.bound, str):
            return f"{self.op} {fmt(bound)}"
        scale = "" if self.factor == 1.0 else f"{self.factor:g} x "
        return f"{self.op} {scale}{self.bound} ({fmt(bound)})"


@dataclass(frozen=True, slots=True)
class Figure:
    key: str  # a key of the record (its name in --json); dotted for nested objects
    label: str = ""  # what it is, with its unit
    target: Target | None = None


def lookup(record: dict[str, Any], key: str) -> Any:
    """``record["a"]["b"]`` for ``"a.b"`` (``"a.0"`` indexes a list); None if any part
    is missing."""
    value: Any = record
    for part in key.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def rows(record: dict[str, Any], figures: Sequence[Figure]) -> list[tuple[str, ...]]:
    """(figure key, what it is, value, target, met) for each figure the record has."""
    out: list[tuple[str, ...]] = []
    for figure in figures:
        value = lookup(record, figure.key)
        if value is None and figure.target is None:
            continue  # not measured in this run (e.g. a ratio of a pool that never filled)
        target = figure.target
        met = None if target is None else target.met(value, record)
        out.append(
            (
                figure.key,
                figure.label,
                fmt(value),
                "" if target is None else target.describe(record),
                "" if target is None else {True: "met", False: "NOT MET", None: "n/a"}[met],
            )
        )
    return out


def unmet(record: dict[str, Any], figures: Sequence[Figure]) -> list[str]:
    """``"key = value, not <target>"`` for each required target the record misses (or
    lacks: a required figure must be measured); none for a skipped run."""
    if "skipped" in record:
        return []
    out = []
    for figure in figures:
        if figure.target is not None and figure.target.required:
            value = lookup(record, figure.key)
            if not figure.target.met(value, record):
                out.append(f"{figure.key} = {fmt(value)}, not {figure.target.describe(record)}")
    return out


def fmt(value: Any) -> str:
    """A number as people read it: thousands separated, three significant digits below."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.3g}"


def print_report(title: str, record: dict[str, Any], figures: Sequence[Figure]) -> None:
    """The headline table; a line saying where the full record is."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    if "skipped" in record:
        console.print(f"{title}: skipped: {record['skipped']}")
        return
    table = Table(title=title)
    for column in ("figure", "what", "value", "target", "met"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for row in rows(record, figures):
        table.add_row(*row)
    console.print(table)
    console.print("(every figure: --json)")
