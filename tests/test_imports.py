"""An engine process pays only for what it uses: importing the client or the
configuration loads no tier (no Mooncake glue, no atexit hook), and the
configuration and the tiers do not import each other in a circle.

docs/architecture.md, "Which part may import which", checked on the source (every
import statement, those inside functions included):

* a plugin imports, of the project's packages, only itself and the kvcore modules the
  page's ``plugins/*`` line names (read from the page, so the two cannot drift);
* no module of kvcore, kvcore_ipc or a plugin imports a module that imports it back,
  directly or through others, even lazily inside a function (a function that needs
  the server lives beside the server). Imports under ``if TYPE_CHECKING:`` are left
  out: they never run. So are ``importlib.import_module`` calls (kvcore.tiers' and
  ``kvcore bench``'s loaders, by computed name): only import statements count.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "plugins"
# the project's top-level packages: import name -> its directory
PACKAGES = {
    "kvcore": ROOT / "kvcore",
    "kvcore_ipc": ROOT / "ipc" / "kvcore_ipc",
    **{d.name: d for d in sorted(PLUGINS.iterdir()) if (d / "__init__.py").is_file()},
}


def _modules_after(statement: str) -> list[str]:
    """The kvcore modules a fresh interpreter holds after running ``statement``."""
    probe = (
        f"import json, sys; {statement}; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvcore'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    modules: list[str] = json.loads(done.stdout)
    return modules


@pytest.mark.parametrize("module", ["kvcore.client", "kvcore.config", "kvcore"])
def test_the_client_and_the_configuration_load_no_tier(module: str) -> None:
    modules = _modules_after(f"import {module}")
    assert module in modules
    assert [m for m in modules if m == "kvcore.tiers" or m.startswith("kvcore.tiers.")] == []


def test_the_tiers_package_loads_no_tier_implementation() -> None:
    modules = _modules_after("import kvcore.tiers")
    assert {"kvcore.tiers.disk", "kvcore.tiers.remote", "kvcore.tiers.worker"}.isdisjoint(modules)
    assert "kvcore.daemon" not in modules


def test_the_tiers_names_still_load_on_use() -> None:
    from kvcore import tiers
    from kvcore.tiers.disk import DiskTier

    assert tiers.DiskTier is DiskTier
    for name in tiers.__all__:
        assert getattr(tiers, name) is not None
    with pytest.raises(AttributeError):
        _ = tiers.NoSuchTier  # type: ignore[attr-defined]


def test_the_leaf_modules_import_neither_the_configuration_nor_the_tiers() -> None:
    for leaf in ("kvcore.sizes", "kvcore.paths"):
        modules = _modules_after(f"import {leaf}")
        assert leaf in modules
        assert [m for m in modules if m.startswith(("kvcore.config", "kvcore.tiers"))] == []


# -- the import rule and import circles, read from the source ----------------------------


def _module_files() -> dict[str, Path]:
    """Every module of the project's packages: dotted name -> file."""
    files = {}
    for name, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = [name, *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement, nested ones (functions, classes, try, with, if) included, but not
    the body of an ``if TYPE_CHECKING:`` (its ``else`` is kept)."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.orelse)
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _statements([child])
            elif isinstance(child, ast.excepthandler | ast.match_case):
                yield from _statements(child.body)


def imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for each import statement of ``module`` that runs.

    ``from a import b`` imports ``a.b`` when that is a module of the project, else
    ``a``; relative imports are resolved against the module's package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in MODULES else base), node.lineno


def _plugin_rule() -> set[str]:
    """The kvcore modules docs/architecture.md lets a plugin import."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### Which part may import which", 1)[1]
    line = next(ln for ln in section.splitlines() if ln.startswith("plugins/*"))
    allowed = set(re.findall(r"\bkvcore\.\w+", line.split("->", 1)[1].split("(", 1)[0]))
    assert allowed, line
    return allowed


def test_plugins_import_only_what_the_architecture_allows() -> None:
    allowed = _plugin_rule()
    plugins = {d.name for d in PLUGINS.iterdir() if d.name in PACKAGES}
    assert {"kvcore_torch", "kvcore_triton", "kvcore_cupy"} <= plugins
    broken = []
    for module, path in MODULES.items():
        own = module.split(".")[0]
        if own not in plugins:
            continue
        for target, line in _every_import(module):
            top = target.split(".")[0]
            if top not in PACKAGES or top == own:
                continue  # a library, or the plugin itself
            if top != "kvcore" or target not in allowed:
                broken.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not broken, (
        f"plugins may import only {sorted(allowed)} of the project "
        '(docs/architecture.md, "Which part may import which"):\n  ' + "\n  ".join(broken)
    )


def _every_import(module: str) -> Iterator[tuple[str, int]]:
    """Every import statement of ``module``, those under ``if TYPE_CHECKING:`` too: a
    plugin that names another kvcore module, even only for its types, depends on it."""
    path = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield (sub if sub in MODULES else node.module), node.lineno


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    graph: dict[str, dict[str, int]] = {module: {} for module in MODULES}
    for module in MODULES:
        for target, line in imports(module):
            if target in MODULES and target != module:
                graph[module].setdefault(target, line)
    circles = _circles(graph)
    report = [
        f"  {' <-> '.join(circle)}:\n"
        + "\n".join(
            f"    {MODULES[m].relative_to(ROOT)}:{line} imports {t}"
            for m in circle
            for t, line in sorted(graph[m].items())
            if t in circle
        )
        for circle in circles
    ]
    assert not circles, "import circles (each with the imports that close it):\n" + "\n".join(
        report
    )


def test_the_circle_check_sees_lazy_imports_and_skips_type_checking() -> None:
    """A guard on the check itself: the daemon imports the metrics server inside a
    function (seen), and metrics.py names it under ``if TYPE_CHECKING:`` (left out)."""
    daemon = dict(imports("kvcore.daemon.daemon"))
    assert "kvcore.daemon.metrics_server" in daemon
    assert "kvcore.daemon.metrics_server" not in dict(imports("kvcore.daemon.metrics"))
    assert _circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]
    ]
