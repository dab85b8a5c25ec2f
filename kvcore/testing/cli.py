"""``kvcore conformance``: hold a kernel backend to the torch oracle.

    kvcore conformance --backend NAME [--device cpu|cuda] [--profile quick|full]

Runs every property of :mod:`kvcore.testing.kernels` (or those named with
``--property``), prints one line per property (a feature's line says whether the
backend declares it, so was checked, or does not, so must refuse it) and a
summary, and exits 0 when
all pass, 1 when any fails, 2 when the backend cannot run here (not installed,
libraries missing, device not declared or absent). A failure prints the
falsifying case hypothesis found, ready to paste into a test.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", required=True, help="registered backend name")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--profile",
        choices=("quick", "full"),
        default=None,
        help="shape grid (default $KVCORE_CONFORMANCE_PROFILE or quick)",
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=None,
        help="hypothesis examples per property (overrides the profile)",
    )
    parser.add_argument(
        "--property",
        action="append",
        default=None,
        metavar="NAME",
        help="run only this property (repeatable)",
    )
    parser.add_argument("--traceback", action="store_true", help="full tracebacks on failure")


def main(args: argparse.Namespace) -> int:
    if args.examples is not None:
        os.environ["KVCORE_CONFORMANCE_EXAMPLES"] = str(args.examples)

    import torch

    from kvcore.errors import KVCoreError
    from kvcore.testing.kernels import PROPERTIES, Suite

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"conformance: device {args.device} requested but CUDA is not available")
        return 2
    if args.device == "cpu" and not torch.cuda.is_available():
        # Triton kernels run on the CPU only interpreted; Triton reads this when
        # @triton.jit decorates, so it must be set before the backend is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        suite = Suite(args.backend, device=args.device, profile=args.profile)
    except KVCoreError as exc:
        print(f"conformance: cannot run backend {args.backend!r}: {exc}")
        return 2
    names = args.property or list(PROPERTIES)
    unknown = sorted(set(names) - set(PROPERTIES))
    if unknown:
        print(f"conformance: unknown properties {unknown}; known: {list(PROPERTIES)}")
        return 2

    features = sorted(suite.backend.capabilities.features)
    print(
        f"kvcore conformance: backend={suite.backend.name} device={suite.device} "
        f"profile={suite.profile.name} examples={suite.profile.examples}/property "
        f"features={','.join(features) or 'none'}"
    )
    failed: list[str] = []
    for name in names:
        start = time.perf_counter()
        try:
            note = suite.run(name)
        except Exception as exc:
            failed.append(name)
            print(f"FAIL  {name}  ({time.perf_counter() - start:.1f} s)")
            lines = (
                traceback.format_exception(exc)
                if args.traceback
                else traceback.format_exception_only(exc)
            )
            print("      " + "".join(lines).rstrip().replace("\n", "\n      "))
        else:
            what = f"  [{note}]" if note else ""
            print(f"pass  {name}{what}  ({time.perf_counter() - start:.1f} s)")
    passed = len(names) - len(failed)
    print(f"{passed} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
