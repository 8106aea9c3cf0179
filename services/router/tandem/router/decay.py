"""The one decay of the router's "lately" figures: a value that halves every ``half_life_s``.

Used for the tokens placed on a worker lately (:class:`tandem.router.reservations.ReservationTable`,
which the busy fraction adds to a worker's load) and for each tenant's recent service
(:class:`tandem.router.fair_share.TenantShares`). The compiled budget state
(:func:`tandem.router.kernels.budget_state`) decays the same figures in its loop with the same
expression, ``exp2(-age / half_life)``; ``tests/unit/router/test_kernels.py`` checks the kernel's
recent tokens against this function, so the two cannot drift apart.
"""

from __future__ import annotations

import math


def decayed(value: float, age_s: float, half_life_s: float) -> float:
    """``value`` after ``age_s`` seconds of halving every ``half_life_s``."""
    return value * math.exp2(-age_s / half_life_s)
