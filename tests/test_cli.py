"""The ``kvcore`` command reads well: a version, help when bare, every flag explained
with its default, no reST markup in any --help."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvcore.cli import build_parser, main


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("kvcore",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


# actions whose help argparse writes itself
SELF_EXPLAINED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def test_bare_kvcore_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvcore") and "serve" in out and "bench" in out


def test_version() -> None:
    command = [sys.executable, "-m", "kvcore.cli", "--version"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout.startswith("kvcore 0.") or done.stdout.startswith("kvcore 1.")


def test_every_flag_has_help_and_shows_its_default() -> None:
    missing = []
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text, f"{' '.join(path)} --help shows reST markup"
        for action in parser._actions:
            if isinstance(action, SELF_EXPLAINED):
                continue
            flag = f"{' '.join(path)} {(action.option_strings or [action.dest])[0]}"
            if not action.help:
                missing.append(f"{flag}: no help")
                continue
            switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            help_text = parser._get_formatter()._expand_help(action)
            off = action.default is None  # nothing to show: the help says what happens
            if action.option_strings and not switch and not off and "default" not in help_text:
                missing.append(f"{flag}: no default shown")
    assert not missing, "\n".join(missing)


def test_bench_prints_headline_figures_with_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "capacity", "--requests", "60", "--budget-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "utilization of the paged pool" in out and ">= 0.96" in out
    assert "met" in out and "e+" not in out and "plain.paged" not in out  # not the flat record
    assert len(out.splitlines()) < 40


def test_report_formats_numbers_for_people() -> None:
    from kvcore.bench.report import Figure, Target, fmt, rows

    formatted = [fmt(v) for v in (217_100.4, 0.98312, 12.345, 7, None)]
    assert formatted == ["217,100", "0.983", "12.3", "7", "-"]
    record = {"a": {"b": 3.0}, "best": 3.0, "worse": 2.0}
    assert rows(record, [Figure("a.b", "ab", Target("==", "best"))]) == [
        ("a.b", "ab", "3", "== best (3)", "met")
    ]
    assert rows(record, [Figure("worse", target=Target(">=", 2.5))])[0][4] == "NOT MET"
    scaled = Target(">=", "best", factor=0.5)
    assert rows(record, [Figure("worse", target=scaled)])[0][3:] == (">= 0.5 x best (1.5)", "met")
    listed = {"rows": [{"x": 1.5}, {"x": 2.5}]}  # "rows.1.x" indexes the list
    assert [r[2] for r in rows(listed, [Figure("rows.1.x"), Figure("rows.2.x")])] == ["2.5"]
