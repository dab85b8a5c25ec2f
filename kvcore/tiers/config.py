"""TierConfig, the lower tiers a pool declares, under its old name.

The schema lives in :mod:`kvcore.config` beside the pool that holds it, so
that loading the configuration (every client does) imports no tier.
"""

from kvcore.config import TierConfig

__all__ = ["TierConfig"]
