"""pytest plugin ``kvcore``: run the kernel conformance suite on your backend.

Installed with kvcore (entry point ``pytest11: kvcore``). In your tests::

    from kvcore.testing.pytest_plugin import KernelConformance

    class TestMyBackendConformance(KernelConformance):
        backend = "mybackend"   # a registered name, a Backend instance, or a factory
        device = "cuda"          # default "cpu"

and ``pytest`` runs one test per property of :mod:`kvcore.testing.kernels`.
A subclass that leaves ``backend = None`` takes it from the command line::

    pytest --kvcore-backend mybackend --kvcore-device cuda --kvcore-profile full

``--kvcore-device`` and ``--kvcore-profile`` override every subclass;
``$KVCORE_CONFORMANCE_EXAMPLES`` scales the number of examples per property.
A CUDA device without CUDA, or a device the backend does not declare, skips.

This module imports neither torch nor hypothesis: runs that do not use the
suite pay nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import pytest

if TYPE_CHECKING:
    from kvcore.backend import Backend
    from kvcore.testing.kernels import Suite


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcore", "kvcore kernel conformance")
    group.addoption(
        "--kvcore-backend",
        default=None,
        help="backend for KernelConformance subclasses that name none",
    )
    group.addoption("--kvcore-device", default=None, help="device: cpu or cuda (overrides)")
    group.addoption(
        "--kvcore-profile",
        default=None,
        choices=("quick", "full"),
        help="conformance profile (default $KVCORE_CONFORMANCE_PROFILE or quick)",
    )


@pytest.fixture(scope="class")
def kvcore_suite(request: pytest.FixtureRequest) -> Suite:
    """The Suite of the requesting KernelConformance subclass's backend, device and
    profile (built once per class).

    A module-level fixture of this plugin (not a method of the class): pytest
    deprecates class-scoped fixtures defined as instance methods, and a plugin's
    fixtures are visible to every test module.
    """
    config = request.config
    cls = request.cls
    assert cls is not None and issubclass(cls, KernelConformance), (
        "kvcore_suite serves KernelConformance subclasses"
    )
    backend = cls.backend or config.getoption("--kvcore-backend")
    if backend is None:
        pytest.skip("no backend: set KernelConformance.backend or pass --kvcore-backend")
    device: str = config.getoption("--kvcore-device") or cls.device
    profile: str | None = config.getoption("--kvcore-profile") or cls.profile

    import torch

    from kvcore.errors import Unsupported
    from kvcore.testing.kernels import Suite

    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    if callable(backend) and not isinstance(backend, str):
        from kvcore.backend import Backend as BackendBase

        if not isinstance(backend, BackendBase):
            backend = backend()
    try:
        return Suite(backend, device=device, profile=profile)
    except Unsupported as exc:
        pytest.skip(str(exc))


class KernelConformance:
    """Base class of a conformance test class; see the module docstring."""

    backend: ClassVar[str | Backend | Callable[[], Backend] | None] = None
    device: ClassVar[str] = "cpu"
    profile: ClassVar[str | None] = None

    def _run(self, suite: Suite, name: str) -> None:
        suite.run(name)

    def test_decode_matches_oracle(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "decode_matches_oracle")

    def test_prefill_matches_oracle(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "prefill_matches_oracle")

    def test_prefill_last_token_is_decode(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "prefill_last_token_is_decode")

    def test_decode_invariant_under_page_permutation(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "decode_invariant_under_page_permutation")

    def test_decode_invariant_under_page_size(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "decode_invariant_under_page_size")

    def test_write_then_attend_is_dense_attention(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "write_then_attend_is_dense_attention")

    def test_copy_pages_is_exact(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "copy_pages_is_exact")

    def test_one_plan_serves_every_layer(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "one_plan_serves_every_layer")

    def test_out_of_range_pages_rejected(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "out_of_range_pages_rejected")

    def test_unsupported_raises(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "unsupported_raises")

    # one per feature: checked where declared, refused (Unsupported) where not

    def test_feature_fp8(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "feature_fp8")

    def test_feature_window(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "feature_window")

    def test_feature_soft_cap(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "feature_soft_cap")

    def test_feature_sinks(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "feature_sinks")

    def test_feature_mla(self, kvcore_suite: Suite) -> None:
        self._run(kvcore_suite, "feature_mla")


__all__ = ["KernelConformance", "kvcore_suite", "pytest_addoption"]
