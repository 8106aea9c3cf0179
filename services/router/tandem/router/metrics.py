"""Router metrics seam.

:class:`tandem.router.scheduler.Scheduler` reports through :class:`RouterMetrics`;
the Serve deployment passes :class:`RayRouterMetrics` (Ray's metrics API,
exported by Ray's Prometheus endpoint with deployment/replica tags), unit
tests pass :class:`NullRouterMetrics` or a recorder.
"""

from __future__ import annotations

from typing import Protocol

#: Upper bounds of the schedule-latency histogram, in seconds.
SCHEDULE_SECONDS_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]


class RouterMetrics(Protocol):
    def observe_schedule(self, duration_s: float, *, outcome: str) -> None:
        """One Schedule took ``duration_s``; outcome is ``ok`` or an error code."""
        ...

    def set_in_flight(self, worker_id: str, num_requests: int) -> None:
        """This replica now has ``num_requests`` reserved on ``worker_id``."""
        ...


class NullRouterMetrics:
    def observe_schedule(self, duration_s: float, *, outcome: str) -> None:
        pass

    def set_in_flight(self, worker_id: str, num_requests: int) -> None:
        pass


class RayRouterMetrics:
    """``tandem_router_schedule_seconds`` and ``tandem_router_in_flight_requests``
    through :mod:`ray.serve.metrics`. Construct inside a Serve replica."""

    def __init__(self) -> None:
        from ray.serve import metrics as serve_metrics  # heavy; only inside the replica

        self._schedule_seconds = serve_metrics.Histogram(
            "tandem_router_schedule_seconds",
            description="Time to answer one Schedule inside the router replica.",
            boundaries=SCHEDULE_SECONDS_BOUNDARIES,
            tag_keys=("outcome",),
        )
        self._in_flight = serve_metrics.Gauge(
            "tandem_router_in_flight_requests",
            description="Requests this router replica has reserved on a worker and not yet released.",
            tag_keys=("worker_id",),
        )

    def observe_schedule(self, duration_s: float, *, outcome: str) -> None:
        self._schedule_seconds.observe(duration_s, tags={"outcome": outcome})

    def set_in_flight(self, worker_id: str, num_requests: int) -> None:
        self._in_flight.set(num_requests, tags={"worker_id": worker_id})
