"""docs/architecture.md's "The parts" tree and the source tree agree, both ways.

* Every ``.py`` file under kvcore/, plugins/ and ipc/ is named in the tree under its own
  directory: ``kvcore/bench/trace.py`` must be named in the ``bench/`` block, and a
  ``trace.py`` named elsewhere (or ``base.py`` of another package) does not count. A
  module counts as named where its directory's block names it: on a file line
  (``sizes.py, paths.py``) or in the description of that directory or of a file beside
  it (``vllm/  a KV connector: scheduler.py (...), records.py (...)``).
* Every directory and file the tree names exists (a renamed or deleted module fails
  here too); a name with a slash in it (``spec/hashing.md``) is a path from the root.

Exempt: ``__init__.py`` and ``__main__.py``. A package's ``__init__`` is what its
directory line describes (kvcore/'s public API, ``kvcore bench``'s dispatcher, a
plugin's entry point), and ``__main__`` is the ``python -m`` form of a command the
tree names already (``kvcore serve``); listing them would repeat the directory line.

The tree is parsed by indentation. A line indented to the description column (that of
the first line's description) continues the entry above it; any other line is an entry
whose names (a directory ending in ``/``, or files) stand before its first run of two
spaces, and whose parent is the nearest directory line indented less.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
CHECKED = ("kvcore", "plugins", "ipc")  # every .py under these must be named
EXEMPT = frozenset({"__init__.py", "__main__.py"})
SKIPPED_DIRS = frozenset({"__pycache__", "build", "dist"})  # build outputs, not sources

ENTRY = re.compile(r"^(?P<indent> *)(?P<names>\S.*?)(?: {2,}(?P<desc>.*))?$")
# a file's bare name (no slash before it): scheduler.py, common.cuh, vllm-events.md
BARE = re.compile(r"(?<![\w./-])(?P<name>[\w-]+\.(?:py|cuh|cu|md|json))(?![\w/])")
# a path from the repository root: spec/hashing.md, kvcore/bench/kernel_features.py
PATH = re.compile(r"(?<![\w./-])(?P<path>(?:[\w-]+/)+[\w-]+\.(?:py|cuh|cu|md|json))(?![\w/])")


@dataclass(slots=True)
class Block:
    """One directory line of the tree and what its block names."""

    path: str  # from the repository root, no trailing slash: "kvcore/bench"
    line: int  # 1-based, in docs/architecture.md
    files: dict[str, int] = field(default_factory=dict)  # bare name -> first line naming it


def tree_lines() -> Iterator[tuple[int, str]]:
    """(line number, text) of the fenced block that follows the "## The parts" heading."""
    lines = DOC.read_text().splitlines()
    start = lines.index("## The parts")
    fence = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    for i in range(fence + 1, end):
        if lines[i].strip():
            yield i + 1, lines[i]


def parse() -> tuple[dict[str, Block], list[tuple[int, str]]]:
    """The tree's directories (path -> block) and every path-from-the-root it names."""
    lines = list(tree_lines())
    first = ENTRY.match(lines[0][1])
    assert first is not None and first["desc"], "the tree's first line has a description"
    desc_col = lines[0][1].index(first["desc"])
    blocks: dict[str, Block] = {}
    paths: list[tuple[int, str]] = []
    stack: list[tuple[int, Block]] = []  # open directory lines: (indent, block)
    current: Block | None = None  # the directory the current entry's names belong to
    for number, text in lines:
        indent = len(text) - len(text.lstrip(" "))
        if indent >= desc_col:  # a continued description
            assert current is not None, f"docs/architecture.md:{number}: continues nothing"
            described = text
        else:
            m = ENTRY.match(text)
            assert m is not None, f"docs/architecture.md:{number}: not an entry: {text!r}"
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1].path + "/" if stack else ""
            names, described = m["names"], m["desc"] or ""
            if names.endswith("/"):
                assert " " not in names, f"docs/architecture.md:{number}: one directory a line"
                current = Block(parent + names.rstrip("/"), number)
                assert current.path not in blocks, f"{current.path}/ listed twice"
                blocks[current.path] = current
                stack.append((indent, current))
            else:
                assert stack, f"docs/architecture.md:{number}: a file outside any directory"
                current = stack[-1][1]
                described = names + "  " + described
        for found in BARE.finditer(described):
            current.files.setdefault(found["name"], number)
        paths.extend((number, found["path"]) for found in PATH.finditer(described))
    return blocks, paths


def modules() -> list[Path]:
    """Every .py file under the checked roots, relative to the root, exemptions left out."""
    found = []
    for top in CHECKED:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if path.name in EXEMPT or SKIPPED_DIRS.intersection(rel.parts):
                continue
            if any(part.startswith(".") or part.endswith(".egg-info") for part in rel.parts):
                continue
            found.append(rel)
    return sorted(found)


def test_the_tree_parses_into_its_directories() -> None:
    """The parser sees the blocks the tree is made of (a guard on the parser itself)."""
    blocks, _ = parse()
    for path in ("kvcore", "kvcore/daemon", "kvcore/bench", "kvcore/tiers", "ipc/kvcore_ipc"):
        assert path in blocks, path
    assert "trace.py" in blocks["kvcore/bench"].files
    assert "base.py" in blocks["kvcore/tiers"].files
    assert "base.py" not in blocks["kvcore"].files  # a subdirectory's files are its own
    assert "records.py" in blocks["kvcore/integrations/vllm"].files  # named in a description
    assert "hashing.md" not in blocks["kvcore"].files  # spec/hashing.md is a path, not a name


def test_every_module_is_named_under_its_own_directory() -> None:
    blocks, _ = parse()
    missing = []
    for rel in modules():
        directory = rel.parent.as_posix()
        block = blocks.get(directory)
        if block is None:
            missing.append(f"{rel} (no {directory}/ line)")
        elif rel.name not in block.files:
            missing.append(f"{rel} (not in the {directory}/ block, line {block.line})")
    assert not missing, (
        'docs/architecture.md, "The parts", does not name these modules under their own '
        "directories; add a line for each (what it is, in a few words):\n  " + "\n  ".join(missing)
    )


def test_everything_the_tree_names_exists() -> None:
    blocks, paths = parse()
    gone = [
        f"docs/architecture.md:{block.line}: {path}/ (no such directory)"
        for path, block in blocks.items()
        if not (ROOT / path).is_dir()
    ]
    gone += [
        f"docs/architecture.md:{number}: {path}/{name}"
        for path, block in blocks.items()
        for name, number in block.files.items()
        if not (ROOT / path / name).is_file()
    ]
    gone += [f"docs/architecture.md:{n}: {p}" for n, p in paths if not (ROOT / p).exists()]
    assert not gone, 'docs/architecture.md, "The parts", names what does not exist:\n  ' + (
        "\n  ".join(gone)
    )
