"""Which metrics a PromQL expression reads, and with which labels: the extractor behind
the drift test of the shipped dashboard and alert rules (docs/observability/,
tests/test_vllm_metrics.py), and the check of what it found against a real scrape.

:func:`refs` parses an expression with ``promql_parser`` (the Rust promql-parser
crate's grammar and type checks) and returns one :class:`Ref` per vector selector, in
the order written: the metric name, its label matchers, and the labels of every clause
around it that names labels of its series::

    sum by (pool, medium) (rate(kvcore_hits_tokens_total{pool=~"$pool"}[5m]))
        -> Ref("kvcore_hits_tokens_total", matchers=(pool =~ "$pool",),
               grouping={"pool", "medium"})

Clauses attributed: ``by (...)`` and ``without (...)`` to every selector of the
aggregation's argument; ``on (...)`` to both operands of the binary operation;
``group_left (...)`` to the right operand (the labels it copies come from there),
``group_right (...)`` to the left. ``ignoring (...)`` is not attributed: it names a
label that one operand may lack, which is its use. Grafana's interval variables
(``$__rate_interval``, ``$__interval``, ``$__range``) stand for ``5m``; other
``$variables`` may appear only inside label values (strings). A selector with ``or``
between its matchers (``x{a="1" or b="2"}``) gives one :class:`Ref` per alternative.

:func:`scrape_index` reads a ``/metrics`` text (prometheus_client's parser) into the
sample names it holds and the label names and values seen on each; :func:`problems`
says what of a :class:`Ref` that scrape does not back: a name no family exposes
(counters: the ``_total`` samples; histograms: ``_bucket``, ``_sum``, ``_count``), a
label no sample carries, an ``=`` matcher's value no sample has (unless declared
unreachable in the test rig). ``job`` and ``instance`` are Prometheus' target labels,
never in a scrape.

Refused (a :class:`PromQLError`): what the library cannot parse, ``label_replace`` and
``label_join`` (they make labels: grouping by the new one would be misread), selectors
without a metric name.

:func:`shipped_refs`: every selector of the shipped files (the dashboard's panel
targets and query variables, the alert rules), each with where it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import promql_parser as pq
from prometheus_client.parser import text_string_to_metric_families

TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus adds at scrape time (the target's): never in a ``/metrics`` text."""

_LABEL_MAKERS = frozenset({"label_replace", "label_join"})
_GRAFANA_INTERVALS = re.compile(r"\$\{?__(?:rate_interval|interval|range)(?:_ms|_s)?\}?")
_MATCH_OPS = (  # pairs, not a dict: the library's MatchOp is unhashable
    (pq.MatchOp.Equal, "="),
    (pq.MatchOp.NotEqual, "!="),
    (pq.MatchOp.Re, "=~"),
    (pq.MatchOp.NotRe, "!~"),
)


class PromQLError(ValueError):
    """An expression this module cannot read (a syntax error, or an unsupported form)."""


@dataclass(frozen=True, slots=True)
class Matcher:
    label: str
    op: str  # =, !=, =~, !~
    value: str

    def __str__(self) -> str:
        return f'{self.label}{self.op}"{self.value}"'


@dataclass(frozen=True, slots=True)
class Ref:
    """One vector selector of an expression: ``name{matchers}``, read under clauses
    that name ``grouping`` labels of its series (module docstring)."""

    name: str
    matchers: tuple[Matcher, ...] = ()
    grouping: frozenset[str] = frozenset()

    @property
    def labels(self) -> frozenset[str]:
        """Every label name the expression needs this metric's series to carry."""
        return frozenset(m.label for m in self.matchers) | self.grouping

    def __str__(self) -> str:
        inner = ", ".join(map(str, self.matchers))
        by = f" (grouped by {', '.join(sorted(self.grouping))})" if self.grouping else ""
        return f"{self.name}{{{inner}}}{by}"


def refs(expr: str) -> list[Ref]:
    """The vector selectors of ``expr`` (module docstring); PromQLError if unreadable."""
    try:  # the library's parse errors are ValueErrors, as PromQLError is
        return list(_selectors(pq.parse(_GRAFANA_INTERVALS.sub("5m", expr)), frozenset()))
    except ValueError as exc:
        raise PromQLError(f"{exc} in {expr!r}") from None


def variable_refs(query: str) -> list[Ref]:
    """The selectors of a Grafana Prometheus variable query: ``label_values(expr, label)``
    (``label`` then groups ``expr``'s selectors), ``query_result(expr)``; PromQLError
    for any other form (``label_values(label)``, ``metrics(...)`` name no metric)."""
    text = query.strip()
    found = re.fullmatch(r"label_values\((?P<expr>.*),\s*(?P<label>[a-zA-Z_]\w*)\s*\)", text, re.S)
    if found:
        label = found["label"]
        return [replace(r, grouping=r.grouping | {label}) for r in refs(found["expr"])]
    found = re.fullmatch(r"query_result\((?P<expr>.*)\)", text, re.S)
    if found:
        return refs(found["expr"])
    raise PromQLError(f"variable query {query!r}: not label_values(expr, label) nor query_result")


def _selectors(node: Any, grouping: frozenset[str]) -> Iterator[Ref]:
    """The selectors under ``node``, in the order written, each grouped by ``grouping``
    (the labels of the clauses above ``node``) and by those of the clauses below it."""
    match node:
        case pq.VectorSelector():
            if node.name is None:
                raise PromQLError("a selector without a metric name")
            for group in node.matchers.or_matchers or [node.matchers.matchers]:
                yield Ref(node.name, tuple(map(_matcher, group)), grouping)
        case pq.MatrixSelector():
            yield from _selectors(node.vector_selector, grouping)
        case pq.AggregateExpr():
            if node.param is not None:  # topk's k, quantile's q: not the argument
                yield from _selectors(node.param, grouping)
            labels = frozenset(node.modifier.labels if node.modifier else ())
            yield from _selectors(node.expr, grouping | labels)
        case pq.BinaryExpr():
            left, right = _operand_groupings(node.modifier, grouping)
            yield from _selectors(node.lhs, left)
            yield from _selectors(node.rhs, right)
        case pq.Call():
            if node.func.name in _LABEL_MAKERS:
                raise PromQLError(f"{node.func.name} is not supported")
            for arg in node.args:
                yield from _selectors(arg, grouping)
        case pq.ParenExpr() | pq.UnaryExpr() | pq.SubqueryExpr():
            yield from _selectors(node.expr, grouping)
        case pq.NumberLiteral() | pq.StringLiteral():
            pass
        case _:
            raise AssertionError(f"a PromQL node this walk does not know: {node!r}")


def _operand_groupings(
    mod: pq.BinModifier | None, grouping: frozenset[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """(left, right) operands' groupings under a binary operator's ``mod``: ``on``'s labels
    to both, ``group_left``'s to the right, ``group_right``'s to the left, ``ignoring``'s
    to neither (module docstring)."""
    if mod is None:
        return grouping, grouping
    if mod.matching is not None and mod.matching.type == pq.LabelModifierType.Include:
        grouping |= frozenset(mod.matching.labels)
    copied = frozenset(mod.group_labels or ())
    if mod.card == pq.VectorMatchCardinality.ManyToOne:
        return grouping, grouping | copied
    if mod.card == pq.VectorMatchCardinality.OneToMany:
        return grouping | copied, grouping
    return grouping, grouping


def _matcher(m: pq.Matcher) -> Matcher:
    return Matcher(m.name, next(text for op, text in _MATCH_OPS if op == m.op), m.value)


# -- what a scrape holds ------------------------------------------------------------------

_SUFFIXES = {  # family type -> the sample names prometheus_client's exposition gives it
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}


@dataclass(slots=True)
class Scrape:
    """What one or more ``/metrics`` texts hold: per sample name, each label seen on it
    with the values seen (``samples``); sample names of families declared with no sample
    (``declared``: their labels are unknown)."""

    samples: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    declared: set[str] = field(default_factory=set)

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for suffix in _SUFFIXES.get(family.type, ("",)):
                self.declared.add(family.name + suffix)
            for sample in family.samples:
                labels = self.samples.setdefault(sample.name, {})
                for label, value in sample.labels.items():
                    labels.setdefault(label, set()).add(value)


def scrape_index(*texts: str) -> Scrape:
    scrape = Scrape()
    for text in texts:
        scrape.add(text)
    return scrape


def problems(
    ref: Ref, scrape: Scrape, unreachable: Iterable[tuple[str, str, str]] = ()
) -> list[str]:
    """What of ``ref`` ``scrape`` does not back (module docstring), one line each; empty
    if all of it. ``unreachable``: (metric, label, value) an ``=`` matcher may name that
    the scrape cannot show (a remote medium where the rig has no remote tier)."""
    labels = ref.labels - TARGET_LABELS
    seen = scrape.samples.get(ref.name)
    if seen is None:
        if ref.name not in scrape.declared:
            return [f"{ref}: no such metric in the scrape"]
        if labels:
            return [f"{ref}: declared, but no sample shows its labels {sorted(labels)}"]
        return []
    out = [f"{ref}: no sample carries label {label!r}" for label in sorted(labels - set(seen))]
    skip = set(unreachable)
    for m in ref.matchers:
        if m.op != "=" or "$" in m.value or m.label in TARGET_LABELS or m.label not in seen:
            continue
        if m.value not in seen[m.label] and (ref.name, m.label, m.value) not in skip:
            out.append(f"{ref}: no sample has {m} (seen: {sorted(seen[m.label])})")
    return out


# -- the shipped files ----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "observability" / "kvcore-dashboard.json"
ALERTS = ROOT / "docs" / "observability" / "kvcore-alerts.yml"


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of ``dashboard`` but rows, those inside collapsed rows included."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            out += dashboard_panels(panel)
        else:
            out.append(panel)
    return out


def shipped_exprs() -> list[tuple[str, str, str]]:
    """(where, kind, text) of every query the shipped files hold: ``expr`` of a panel's
    target or an alert rule, ``variable`` of a dashboard query variable."""
    import yaml

    dashboard = json.loads(DASHBOARD.read_text())
    out: list[tuple[str, str, str]] = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", "expr", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            text = query["query"] if isinstance(query, dict) else query
            out.append((f"variable ${var['name']}", "variable", text))
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            out.append((f"rule {name}", "expr", rule["expr"]))
    return out


def shipped_refs() -> list[tuple[str, Ref]]:
    """(where, selector) of every query of the shipped dashboard and alert rules."""
    out: list[tuple[str, Ref]] = []
    for where, kind, text in shipped_exprs():
        found = variable_refs(text) if kind == "variable" else refs(text)
        out += [(where, ref) for ref in found]
    return out
