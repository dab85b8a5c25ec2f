"""The kvcore command: serve | stats | top | keys | demo | bench | conformance.

Each subcommand lives in its own module, which defines
``add_arguments(parser)`` and ``main(args) -> int`` and keeps heavy imports
(torch, kernels) inside ``main``, so ``kvcore --help`` stays fast. Every flag
has help text; :class:`HelpFormatter` adds its default and strips the
docstrings' reST quotes. Bare ``kvcore`` prints the help.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence
from types import ModuleType

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvcore.daemon.serve", "run the manager daemon"),
    "stats": ("kvcore.statsview", "print a running daemon's pools, sessions and cache figures"),
    "top": ("kvcore.top", "a live view of one daemon: pools, tiers, sessions, busiest prefixes"),
    "keys": ("kvcore.keys", "write a CURVE key pair (tcp:// daemons and their clients)"),
    "demo": ("kvcore.demo", "two engine processes sharing one prefix cache"),
    "bench": ("kvcore.bench", "benchmarks: capacity, ops, rpc, kernels, e2e, load, vllm, ..."),
    "conformance": ("kvcore.testing.cli", "hold a kernel backend to the reference"),
}


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            return None  # that part of kvcore is not in this build
        raise


class HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help unless it says its default already (or the
    default is None or False: off); shows ``literal`` as `literal`."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" not in text
            and default is not None
            and default is not False
            and default is not argparse.SUPPRESS
            and (action.option_strings or action.nargs in ("?", "*"))
        ):
            text += " (default: %(default)s)"
        return text

    def _format_text(self, text: str) -> str:
        return super()._format_text(text.replace("``", "`"))

    def _expand_help(self, action: argparse.Action) -> str:
        return super()._expand_help(action).replace("``", "`")


def version() -> str:
    try:
        return importlib.metadata.version("kvcore")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcore", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvcore {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = _load(module_name)
        if module is None:
            continue
        command = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        module.add_arguments(command)
        command.set_defaults(_main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `kvcore`
        parser.print_help()
        return 0
    code: int = args._main(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
