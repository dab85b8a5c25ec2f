"""An engine process pays only for what it uses: importing the client or the
configuration loads no tier (no Mooncake glue, no atexit hook), and the
configuration and the tiers do not import each other in a circle."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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
