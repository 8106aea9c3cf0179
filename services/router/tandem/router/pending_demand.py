"""Pending demand: requests refused because their pool had no worker at all.

A pool at zero (``minReplicas: 0``, scaled down while idle) has no queue and no load to show: its
requests are refused at once (:class:`tandem.router.placement.PoolAtZeroError`, a 503 with
Retry-After at the gateway), so the autoscaler's usual signals read zero. :class:`PendingDemand`
remembers each such refusal for ``window_s`` and the router exports the count per pool
(``tandem_router_pending_demand{role, model}``, exported by Ray as ``ray_tandem_router_pending_demand``):
the operator starts a pool whose count is above zero within one interval
(:mod:`tandem_operator.autoscale`).

Raised here, not in the gateway: the router sees every placement of every gateway replica, knows
which role was missing (the gateway gets a 503 reason only), and its metrics are the ones the operator
reads with or without Prometheus (:class:`tandem_operator.signals.RouterSource` scrapes the router alone).

The count is of refusals, not of distinct requests (a client retrying after Retry-After counts again):
the operator reads only whether it is above zero. ``window_s`` must cover the operator's interval plus
Ray's export and Prometheus's scrape delays, or a refusal could come and go between two reads. Once a
pool's count is back at zero it is published as zero once more and then no more (as the other per-model
gauges, :mod:`tandem.router.gauges`): Ray drops the series, and the operator reads "no signal".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tandem.router.metrics import RouterMetrics

#: Refusals remembered per pool at most (a flood of retries must not grow memory): the count saturates.
MAX_COUNTED = 100_000


class PendingDemand:
    """Per (role, model), the refusals of the last ``window_s``. Not thread-safe (the replica's loop)."""

    def __init__(self, metrics: RouterMetrics, *, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._window_s = window_s
        self._clock = clock
        self._refused_at_s: dict[tuple[str, str], deque[float]] = {}

    def note(self, role: str, model: str) -> None:
        """A request for ``model`` was refused: no worker of ``role`` serves it. Published at once."""
        key = (role, model)
        self._refused_at_s.setdefault(key, deque(maxlen=MAX_COUNTED)).append(self._clock())
        self._metrics.set_pending_demand(role, model, self._count(key))

    def counts(self) -> dict[tuple[str, str], int]:
        """Per (role, model) with a refusal in the window, how many."""
        return {key: n for key in list(self._refused_at_s) if (n := self._count(key))}

    def refresh(self) -> None:
        """Publish every pool's count (the deployment's upkeep, every few seconds); a pool whose
        count fell to zero is published as zero this once, then forgotten."""
        for key in list(self._refused_at_s):
            num = self._count(key)
            self._metrics.set_pending_demand(*key, num)
            if not num:
                del self._refused_at_s[key]

    def _count(self, key: tuple[str, str]) -> int:
        times = self._refused_at_s[key]
        oldest_s = self._clock() - self._window_s
        while times and times[0] < oldest_s:
            times.popleft()
        return len(times)
