"""Shared test set-up: hypothesis profiles.

``pytest --hypothesis-profile=long`` runs the property suites with many more
examples (minutes); the default profile keeps the whole suite fast on 2 cores.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")
