"""Each tenant's fair share, in the unit that costs prefill time: uncached prompt tokens.

:class:`tandem.router.scheduler.Scheduler` adds every placement it makes
(:meth:`TenantShares.add`: the prompt tokens the chosen worker does not hold, divided by the
tenant's weight) and :class:`tandem.router.ledger.Ledger` adds every placement the other router
replicas make, so all replicas count the same service. The admission queue
(:mod:`tandem.router.admission`) serves, within a priority class, the waiting tenant with the
least service first (virtual token counters, as in VTC, "Fairness in Serving Large Language
Models", OSDI '24): a tenant with a burst of long prompts cannot crowd out one with a few short
ones, and a cache hit costs the tenant nothing. Service decays with a half-life, so a tenant that
was busy an hour ago is not punished now and an idle one cannot bank credit for a later burst.
Pure bookkeeping, no I/O; times are wall-clock seconds, comparable across replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from tandem.router.decay import decayed


class TenantShares:
    def __init__(
        self,
        *,
        half_life_s: float = 60.0,
        weights: Mapping[str, float] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self._half_life_s = half_life_s
        self._weights = dict(weights or {})
        self._wall = wall_clock
        #: tenant -> (service, as of this wall-clock second)
        self._served: dict[str, tuple[float, float]] = {}

    def weight(self, tenant: str) -> float:
        """The tenant's weight (1 unless configured): its share is proportional to it."""
        return self._weights.get(tenant, 1.0)

    def _decayed(self, value: float, from_unix: float, to_unix: float) -> float:
        return decayed(value, to_unix - from_unix, self._half_life_s)

    def add(self, tenant: str, num_uncached_tokens: int, at_unix: float | None = None) -> None:
        """``tenant`` was placed a request with ``num_uncached_tokens`` to compute, at ``at_unix``."""
        at = self._wall() if at_unix is None else at_unix
        value, since = self._served.get(tenant, (0.0, at))
        later = max(since, at)
        self._served[tenant] = (
            self._decayed(value, since, later) + self._decayed(num_uncached_tokens / self.weight(tenant), at, later),
            later,
        )

    def served(self, tenant: str) -> float:
        """The tenant's service now: decayed uncached prompt tokens over its weight."""
        value, since = self._served.get(tenant, (0.0, 0.0))
        return self._decayed(value, since, self._wall()) if value else 0.0

    def snapshot(self) -> dict[str, tuple[float, float]]:
        """(service, as of) per tenant, for a replica that starts and has no history yet."""
        return dict(self._served)

    def learn(self, tenant: str, value: float, at_unix: float) -> None:
        """Take ``tenant``'s service from another replica's snapshot unless this replica counts it already."""
        if tenant not in self._served:
            self._served[tenant] = (value, at_unix)

    def forget_idle(self, below_tokens: float = 1.0) -> None:
        """Drop tenants whose service decayed to nothing (the map stays bounded)."""
        now = self._wall()
        for tenant in [t for t, (v, at) in self._served.items() if self._decayed(v, at, now) < below_tokens]:
            del self._served[tenant]
