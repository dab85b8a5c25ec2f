"""The ``kvcore`` command: serve | stats | keys | demo | bench | conformance.

Each subcommand lives in its own module, which defines
``add_arguments(parser)`` and ``main(args) -> int`` and keeps heavy imports
(torch, kernels) inside ``main``, so ``kvcore --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvcore.daemon.serve", "run the manager daemon"),
    "stats": ("kvcore.statsview", "print a running daemon's pools, sessions and cache figures"),
    "keys": ("kvcore.keys", "write a CURVE key pair (tcp:// daemons and their clients)"),
    "demo": ("kvcore.demo", "two engine processes sharing one prefix cache"),
    "bench": ("kvcore.bench", "benchmarks: capacity, ops, rpc, kernels, e2e, load"),
    "conformance": ("kvcore.testing.cli", "hold a kernel backend to the reference"),
}


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            return None  # that part of kvcore is not in this build
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = _load(module_name)
        if module is None:
            continue
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(_main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args._main(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
