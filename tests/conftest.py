"""Shared test set-up: hypothesis profiles; Triton's interpreter on CPU-only machines.

``pytest --hypothesis-profile=long`` runs the property suites with many more
examples (minutes); the default profile keeps the whole suite fast on 2 cores.
Neither keeps an example database: a failure is reported once, with the blob
that reproduces it (``@reproduce_failure``), and a clean checkout never replays
another run's failures.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# Triton kernels run interpreted on a machine without CUDA. Triton reads
# TRITON_INTERPRET when @triton.jit decorates, i.e. when kvcore_triton is
# imported, so it is set here, before any test module imports a plugin.
# (An explicit TRITON_INTERPRET=0 in the environment wins.)
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test daemons are throwaway (temporary endpoints): they start cold and leave nothing in
# /dev/shm when they stop (kvcore.daemon.restart). The restart tests pass --restore.
os.environ.setdefault("KVCORE_RESTORE", "false")

settings.register_profile(
    "default",
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=2000,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")
