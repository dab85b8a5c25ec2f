"""Every fenced code block of README.md and docs/*.md is checked, so a snippet that stops
working fails here.

What each kind of block gets:

* ``python``: run. A file's blocks run in order in one namespace (a later block may
  use an earlier one's names, as a reader pasting them would), in a fresh process
  whose ``KVCORE_ENDPOINT`` is a real daemon with the default pool (and a pool
  named ``tiny`` that fits :class:`kvcore.demo_model.TinyLlama`). A block whose
  first line is a ``# path/to/file.py`` comment is also written to that path
  (a module a later block imports, a test file), as a reader would save it.
* ``toml``: parsed; a ``[project]`` table must have what pip needs (``name``,
  ``version``); any other TOML is decoded by the daemon's loader (``load_toml``).
* ``console`` / ``bash`` / ``sh``: every ``kvcore`` command is parsed by the real
  command line (a flag that no longer exists fails); a block marked
  ``<!-- run -->`` is also run, and each command must succeed.
* ``json`` (one document, or one per line) and ``yaml``: parsed.
* no language, ``text``: diagrams and output, not code.
* anything else must be marked ``<!-- fragment: why -->`` on the line before its
  fence; the marker also exempts a block of the kinds above that cannot run alone
  (keep them few: :data:`MAX_FRAGMENTS`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from kvcore.cli import build_parser
from kvcore.config import load_toml
from kvcore.daemon_process import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*$")
MARKER = re.compile(r"<!--\s*(?P<kind>fragment|run)\b[^>]*-->")
MAX_FRAGMENTS = 25  # across all docs
PROSE = {"", "text"}
SHELL = {"console", "bash", "sh", "shell"}
SLOW_PYTHON = {"engines.md"}  # loads a transformers model


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    marker: str  # "", "fragment" or "run"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, indent = i, len(m["indent"])
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        i += 1
        prev = lines[start - 1] if start else ""
        marker = MARKER.search(prev)
        yield Block(
            path,
            start + 1,
            m["lang"].lower(),
            "\n".join(body) + "\n",
            marker["kind"] if marker else "",
        )


ALL = [b for path in DOCS for b in blocks(path)]


def _ids(items: list[Block]) -> list[str]:
    return [b.where for b in items]


def test_blocks_are_known_kinds_or_marked() -> None:
    known = {"python", "toml", "json", "yaml", *SHELL, *PROSE}
    unmarked = [b.where + f" ({b.lang})" for b in ALL if b.lang not in known and not b.marker]
    assert not unmarked, "mark these <!-- fragment: why --> or give them a checked language"
    fragments = [b for b in ALL if b.marker == "fragment"]
    assert len(fragments) <= MAX_FRAGMENTS, [b.where for b in fragments]


# -- toml, json, yaml ------------------------------------------------------------------


TOML = [b for b in ALL if b.lang == "toml" and b.marker != "fragment"]


@pytest.mark.parametrize("block", TOML, ids=_ids(TOML))
def test_toml_loads(block: Block, tmp_path: Path) -> None:
    data = msgspec.toml.decode(block.body)
    if "project" in data:  # a pyproject.toml: what pip refuses without
        project = data["project"]
        assert "name" in project, f"{block.where}: [project] needs a name"
        assert "version" in project or "version" in project.get("dynamic", []), (
            f"{block.where}: [project] needs a version (pip refuses it)"
        )
        return
    path = tmp_path / "kvcore.toml"
    path.write_text(block.body)
    load_toml(path)  # the daemon's loader: unknown keys and wrong types fail


DATA = [b for b in ALL if b.lang in ("json", "yaml") and b.marker != "fragment"]


@pytest.mark.parametrize("block", DATA, ids=_ids(DATA))
def test_data_parses(block: Block) -> None:
    if block.lang == "yaml":
        yaml = pytest.importorskip("yaml")
        yaml.safe_load(block.body)
        return
    try:
        json.loads(block.body)
    except json.JSONDecodeError:  # JSON lines
        for line in filter(None, block.body.splitlines()):
            json.loads(line)


# -- shell -----------------------------------------------------------------------------


def commands(block: Block) -> list[str]:
    """The command lines of a shell block: ``$ `` lines of a console block (with their
    ``\\`` continuations and lines inside an open quote), every non-comment line of a
    bash block."""
    out: list[str] = []
    pending = ""
    for raw in block.body.splitlines():
        line = raw.strip()
        if pending:
            line, pending = pending + " " + line, ""
        elif block.lang == "console":
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        elif not line or line.startswith("#"):
            continue
        if line.endswith("\\") or not _closed(line):
            pending = line.removesuffix("\\")
            continue
        out.append(line)
    return out


def _closed(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:  # a quote that a later line closes
        return False
    return True


def kvcore_argvs(line: str) -> list[list[str]]:
    """The ``kvcore ...`` invocations of one command line (``a && b``; comments dropped)."""
    words = shlex.split(line, comments=True)
    argvs, current = [], []
    for word in [*words, "&&"]:
        if word in ("&&", ";", "||", "|"):
            if current and current[0] == "kvcore":
                argvs.append(current[1:])
            current = []
        else:
            current.append(word)
    return argvs


SHELL_BLOCKS = [b for b in ALL if b.lang in SHELL and b.marker != "fragment"]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=_ids(SHELL_BLOCKS))
def test_kvcore_commands_parse(block: Block) -> None:
    parser = build_parser()
    for line in commands(block):
        for argv in kvcore_argvs(line):
            try:
                parser.parse_args(argv)
            except SystemExit as exc:
                if exc.code:  # --help and --version exit 0
                    pytest.fail(f"{block.where}: `kvcore {shlex.join(argv)}` does not parse")


# -- runnable: python and marked shell blocks, against a real daemon -------------------


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    from kvcore.demo_model import TinyLlama

    default = "name=default"  # the default layout, as the docs assume
    with DaemonProcess.private(
        "--pool", default, "--pool", TinyLlama().pool_flag(name="tiny")
    ) as d:
        yield d


def _env(daemon: DaemonProcess) -> dict[str, str]:
    env = dict(os.environ)
    env["KVCORE_ENDPOINT"] = daemon.endpoint
    env.pop("PYTHONPATH", None)
    return env


DRIVER = r"""
import json, pathlib, re, sys, traceback
sys.path.insert(0, ".")
namespace = {"__name__": "__main__"}
for where, source in json.load(sys.stdin):
    saved = re.match(r"# ([\w./-]+\.py)\n", source)
    if saved:
        path = pathlib.Path(saved[1])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    try:
        exec(compile(source, where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED at {where}", file=sys.stderr)
        sys.exit(1)
"""


def _python_files() -> list[object]:
    files = sorted({b.path for b in ALL if b.lang == "python" and b.marker != "fragment"})
    return [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PYTHON else p for p in files]


def run_python_blocks(path: Path, cwd: Path, env: dict[str, str]) -> None:
    sources = [
        (b.where, b.body)
        for b in ALL
        if b.path == path and b.lang == "python" and b.marker != "fragment"
    ]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps(sources),
        text=True,
        capture_output=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", _python_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(path: Path, daemon: DaemonProcess, tmp_path: Path) -> None:
    run_python_blocks(path, tmp_path, _env(daemon))


def test_plugin_example_certifies_on_the_cpu(daemon: DaemonProcess, tmp_path: Path) -> None:
    """docs/plugins.md's package and its CPU conformance test, saved as the page says,
    pass the suite (the CUDA-only class is skipped here)."""
    run_python_blocks(ROOT / "docs" / "plugins.md", tmp_path, _env(daemon))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_conformance_cpu.py",
        ],
        text=True,
        capture_output=True,
        cwd=tmp_path,
        env={**_env(daemon), "PYTHONPATH": str(tmp_path)},
        timeout=300,
    )
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout + done.stderr


RUN = [b for b in ALL if b.lang in SHELL and b.marker == "run"]


@pytest.mark.parametrize("block", RUN, ids=_ids(RUN))
def test_marked_shell_blocks_run(block: Block, daemon: DaemonProcess, tmp_path: Path) -> None:
    for line in commands(block):
        done = subprocess.run(
            ["bash", "-c", line],
            text=True,
            capture_output=True,
            cwd=tmp_path,
            env=_env(daemon),
            timeout=120,
        )
        assert done.returncode == 0, f"{block.where}: `{line}`\n{done.stdout}{done.stderr}"
