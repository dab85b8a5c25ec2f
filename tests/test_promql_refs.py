"""tests/promql_refs.py on its own (expressions in, selectors and label sets out; a
wrong name, label or value reported: the negative controls), and the shipped dashboard
and alert rules as files: they parse, every panel and rule is documented in
docs/deploy.md ("Dashboard and alerts"), every runbook points at a section there, and
``up`` names only the jobs that section scrapes. tests/test_vllm_metrics.py holds the
same expressions to a live daemon's and vLLM's scrapes."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from promql_refs import (
    ALERTS,
    DASHBOARD,
    ROOT,
    PromQLError,
    Ref,
    dashboard_panels,
    problems,
    refs,
    scrape_index,
    shipped_exprs,
    shipped_refs,
    variable_refs,
)

yaml = pytest.importorskip("yaml")

CASES = [  # expression -> [(name, matchers as written, grouping labels)]
    (
        'sum by (pool, medium) (rate(kvcore_hits_tokens_total{pool=~"$pool"}[$__rate_interval]))',
        [("kvcore_hits_tokens_total", ['pool=~"$pool"'], {"pool", "medium"})],
    ),
    (
        "sum by (pool, medium) (rate(a_total[5m])) / on (pool) group_left sum(rate(b_total[5m]))"
        " by (pool)",
        [("a_total", [], {"pool", "medium"}), ("b_total", [], {"pool"})],
    ),
    (
        "histogram_quantile(0.99, sum by (le, op) (rate(x_seconds_bucket[5m])))",
        [("x_seconds_bucket", [], {"le", "op"})],
    ),
    (
        "a / on (x) group_left (y) b + c",
        [("a", [], {"x"}), ("b", [], {"x", "y"}), ("c", [], set())],
    ),
    (
        'up{job="kvcore"} == 0 or absent(up{job="kvcore"})',
        [("up", ['job="kvcore"'], set()), ("up", ['job="kvcore"'], set())],
    ),
    (
        "rate(h_total[6h] offset 15m) > 0.5 * max without (code) (rate(e_total[1h:5m]))",
        [("h_total", [], set()), ("e_total", [], {"code"})],
    ),
    (
        'vllm:x_total{source!="device", model_name=~".+",} unless ignoring (engine) y',
        [("vllm:x_total", ['source!="device"', 'model_name=~".+"'], set()), ("y", [], set())],
    ),
    (
        "a * on (x) group_right (y) -b",
        [("a", [], {"x", "y"}), ("b", [], {"x"})],
    ),
    (
        'topk(3, x{a="1" or b="2"}) by (c)',
        [("x", ['a="1"'], {"c"}), ("x", ['b="2"'], {"c"})],
    ),
]


@pytest.mark.parametrize(("expr", "want"), CASES, ids=[c[0][:40] for c in CASES])
def test_selectors_come_with_every_label_they_use(
    expr: str, want: list[tuple[str, list[str], set[str]]]
) -> None:
    got = [(r.name, [str(m) for m in r.matchers], set(r.grouping)) for r in refs(expr)]
    assert got == want


@pytest.mark.parametrize(
    "expr",
    [
        "sum by (pool (x)",
        "x{a=b}",
        '{__name__="x"}',
        'label_replace(x, "a", "$1", "b", "(.*)")',
        "rate(x[5m]",
        "x +",
        "rate(x[$window])",
        "rate(x)",
    ],
)
def test_what_it_cannot_read_is_refused(expr: str) -> None:
    with pytest.raises(PromQLError, match=re.escape(repr(expr))):
        refs(expr)


def test_variable_queries() -> None:
    (ref,) = variable_refs("label_values(kvcore_pool_capacity_pages, pool)")
    assert ref == Ref("kvcore_pool_capacity_pages", grouping=frozenset({"pool"}))
    with pytest.raises(PromQLError):
        variable_refs("label_values(pool)")  # names no metric: nothing to check


def _exposition() -> str:
    """A scrape as prometheus_client writes one: a counter, a histogram, a gauge, and a
    labelled family with no sample yet."""
    registry = CollectorRegistry()
    hits = Counter("kvcore_hits_tokens", "h", ["pool", "medium"], registry=registry)
    hits.labels("a", "pool").inc(3)
    hits.labels("a", "disk").inc(1)
    latency = Histogram("kvcore_tier_promotion_seconds", "l", ["medium"], registry=registry)
    latency.labels("disk").observe(0.01)
    Gauge("kvcore_pool_capacity_pages", "c", ["pool"], registry=registry).labels("a").set(8)
    Counter("kvcore_errors", "e", ["code"], registry=registry)  # declared, no sample
    return generate_latest(registry).decode()


def test_problems_are_none_for_what_the_scrape_holds() -> None:
    scrape = scrape_index(_exposition())
    for expr in [
        'sum by (pool, medium, instance) (rate(kvcore_hits_tokens_total{medium="disk"}[5m]))',
        "histogram_quantile(0.5, sum by (le, medium) (rate(kvcore_tier_promotion_seconds_bucket[5m])))",
        "kvcore_tier_promotion_seconds_sum / kvcore_tier_promotion_seconds_count",
        "sum(kvcore_pool_capacity_pages)",
        "sum(rate(kvcore_errors_total[5m]))",  # declared: its name is known, no label used
    ]:
        assert [p for r in refs(expr) for p in problems(r, scrape)] == [], expr


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("rate(kvcore_hit_tokens_total[5m])", "no such metric"),  # one letter off
        ("rate(kvcore_hits_tokens[5m])", "no such metric"),  # a counter's name without _total
        ("kvcore_tier_promotion_seconds", "no such metric"),  # a histogram's family name
        ("sum by (tier) (rate(kvcore_hits_tokens_total[5m]))", "no sample carries label 'tier'"),
        ('kvcore_pool_capacity_pages{state="held"}', "no sample carries label 'state'"),
        ('rate(kvcore_hits_tokens_total{medium="ram"}[5m])', 'no sample has medium="ram"'),
        ("sum by (code) (rate(kvcore_errors_total[5m]))", "no sample shows its labels"),
    ],
)
def test_problems_name_a_wrong_metric_label_or_value(expr: str, says: str) -> None:
    """The negative controls: each expression is wrong in one way, and said to be."""
    scrape = scrape_index(_exposition())
    found = [p for r in refs(expr) for p in problems(r, scrape)]
    assert len(found) == 1 and says in found[0], found


def test_a_value_the_rig_cannot_show_may_be_declared() -> None:
    scrape = scrape_index(_exposition())
    (ref,) = refs('rate(kvcore_hits_tokens_total{medium="remote"}[5m])')
    assert problems(ref, scrape)
    assert not problems(ref, scrape, [("kvcore_hits_tokens_total", "medium", "remote")])


# -- the shipped files ------------------------------------------------------------------------

DEPLOY = ROOT / "docs" / "deploy.md"


def _headings() -> list[tuple[int, int, str]]:
    """(line, level, title) of docs/deploy.md's headings (not ``#`` lines in code)."""
    out, fenced = [], False
    for i, line in enumerate(DEPLOY.read_text().splitlines()):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (found := re.match(r"(#+) (.+)$", line)):
            out.append((i, len(found[1]), found[2].strip()))
    return out


def _section(title: str) -> str:
    """docs/deploy.md from the heading ``title`` to the next heading of its level or above."""
    lines = DEPLOY.read_text().splitlines()
    headings = _headings()
    at = [k for k, (_, _, t) in enumerate(headings) if t == title]
    assert at, f"docs/deploy.md lost its section {title!r}"
    first, level, _ = headings[at[0]]
    ends = [i for i, lv, _ in headings[at[0] + 1 :] if lv <= level]
    return "\n".join(lines[first + 1 : ends[0] if ends else len(lines)])


def _anchors() -> set[str]:
    """GitHub's anchors of docs/deploy.md's headings."""
    return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for _, _, t in _headings()}


def test_the_dashboard_is_importable_and_documented() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "kvcore"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {variables[n]["type"] for n in ("pool", "model_name")} == {"query"}
    panels = dashboard_panels(dashboard)
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), titles
    top = dashboard["panels"]
    ids = [p["id"] for p in top] + [q["id"] for p in top for q in p.get("panels", [])]
    assert len(ids) == len(set(ids)), ids
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    table = re.findall(r"^\| ([^|]+?) \|", _section("The panels"), re.M)
    assert set(table) - {"panel"} == set(titles), "docs/deploy.md's panel table"


def test_the_rules_are_loadable_and_point_to_their_runbooks() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    assert set(rules) == {"groups"}
    anchors = _anchors()
    documented = set(re.findall(r"^#### (\w+)$", _section("The alerts"), re.M))
    names = []
    for group in rules["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            names.append(rule["alert"])
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
            assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
            notes = rule["annotations"]
            assert notes["summary"] and notes["description"], rule["alert"]
            page, _, anchor = notes["runbook"].partition("#")
            assert page == "docs/deploy.md" and anchor in anchors, notes["runbook"]
            assert anchor == rule["alert"].lower(), "each rule's runbook is its own section"
    assert len(names) == len(set(names)) and set(names) == documented


def test_up_names_the_jobs_the_docs_scrape() -> None:
    """``up`` is Prometheus' own (no scrape holds it): its ``job`` must be one that
    docs/deploy.md's scrape config declares, and no other label is matched."""
    blocks = re.findall(r"```yaml\n(.*?)```", _section("Loading them"), re.S)
    jobs = {
        job["job_name"]
        for block in blocks
        for job in (yaml.safe_load(block) or {}).get("scrape_configs", [])
    }
    assert jobs == {"kvcore", "vllm"}, jobs
    ups = [(where, r) for where, r in shipped_refs() if r.name == "up"]
    assert ups, "KvcoreDaemonDown reads up"
    for where, ref in ups:
        assert {m.label for m in ref.matchers} == {"job"} and not ref.grouping, where
        assert {m.value for m in ref.matchers} <= jobs, where


def test_every_shipped_query_parses() -> None:
    """(tests/test_vllm_metrics.py checks them against scrapes; this needs no vLLM.)"""
    exprs = shipped_exprs()
    assert len(exprs) >= 30
    for where, kind, text in exprs:
        try:
            found = variable_refs(text) if kind == "variable" else refs(text)
        except PromQLError as exc:
            pytest.fail(f"{where}: {exc}")
        assert found, f"{where}: reads no metric"
