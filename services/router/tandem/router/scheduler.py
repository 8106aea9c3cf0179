"""Schedule and Release, without Ray or gRPC.

:class:`tandem.router.deployment.RouterDeployment` calls :meth:`Scheduler.schedule`
and :meth:`Scheduler.release` for each RPC. Schedule reads the cached worker
list (:mod:`tandem.router.worker_view`), asks the policy (:mod:`tandem.router.policy`)
for one prefill and one decode worker, and records the pair as a lease
(:mod:`tandem.router.reservations`). Errors are tandem.common.errors; the
deployment maps them to gRPC status codes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from tandem.common.errors import InvalidRequestError, NoCapacityError, TandemError
from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router.metrics import NullRouterMetrics, RouterMetrics
from tandem.router.policy import RoutingPolicy, ScheduleInput, ScoredWorker
from tandem.router.reservations import Reservation, ReservationTable

#: How long a caller told "no capacity" should wait before trying again.
NO_CAPACITY_RETRY_AFTER_S = 1.0


class WorkerView(Protocol):
    async def workers(self) -> list[WorkerRecord]: ...


@dataclass(frozen=True)
class PlacementDecision:
    """Where a request goes; the deployment turns it into a tandem.v1.Placement."""

    request_id: str
    prefill: WorkerRecord
    decode: WorkerRecord
    lease_s: float
    num_cached_tokens: int
    reason: str


class Scheduler:
    """One per Serve replica. Not thread-safe; used from the replica's event loop."""

    def __init__(
        self,
        view: WorkerView,
        policy: RoutingPolicy,
        reservations: ReservationTable,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._view = view
        self._policy = policy
        self._reservations = reservations
        self._metrics: RouterMetrics = metrics or NullRouterMetrics()
        # Workers whose in-flight gauge is non-zero, so tick() can refresh them.
        self._published_worker_ids: set[str] = set()

    @property
    def reservations(self) -> ReservationTable:
        return self._reservations

    async def schedule(self, request: ScheduleInput) -> PlacementDecision:
        """Choose and reserve a (prefill, decode) pair for ``request``.

        Raises InvalidRequestError (bad input, or ``code="model_not_found"``
        when no live worker serves the model) or NoCapacityError (the model is
        served but no worker of some role is left after filtering).
        """
        started_s = time.perf_counter()
        outcome = "ok"
        try:
            return await self._schedule(request)
        except TandemError as exc:
            outcome = getattr(exc, "code", None) or type(exc).__name__
            raise
        finally:
            self._metrics.observe_schedule(time.perf_counter() - started_s, outcome=outcome)

    async def _schedule(self, request: ScheduleInput) -> PlacementDecision:
        if not request.request_id:
            raise InvalidRequestError("request_id is required", param="request_id", code="invalid_request")
        if not request.model:
            raise InvalidRequestError("model is required", param="model", code="invalid_request")
        self._sweep()
        workers = await self._view.workers()
        # A repeated Schedule of one request is a retry elsewhere: its earlier
        # pair must not count as load while choosing the new one.
        self._publish(self._reservations.release(request.request_id))
        prefill = self._policy.choose(request, ROLE_PREFILL, workers, self._reservations)
        decode = self._policy.choose(request, ROLE_DECODE, workers, self._reservations)
        if prefill is None or decode is None:
            raise self._no_worker_error(request, workers, ROLE_PREFILL if prefill is None else ROLE_DECODE)
        reservation = self._reservations.reserve(
            request.request_id, (prefill.worker.worker_id, decode.worker.worker_id)
        )
        self._publish(reservation)
        return PlacementDecision(
            request_id=request.request_id,
            prefill=prefill.worker,
            decode=decode.worker,
            lease_s=self._reservations.lease_s,
            num_cached_tokens=0,
            reason=self._reason(prefill, decode),
        )

    def release(self, request_id: str) -> bool:
        """Drop ``request_id``'s reservation; False when there was none (idempotent)."""
        self._sweep()
        reservation = self._reservations.release(request_id)
        self._publish(reservation)
        return reservation is not None

    def tick(self) -> None:
        """Periodic upkeep, called by the deployment every few seconds: drop
        expired leases even without traffic, and set every in-flight gauge
        again (Ray forgets a gauge that is not set for a couple of export intervals)."""
        self._sweep()
        for worker_id in list(self._published_worker_ids):
            self._set_gauge(worker_id)

    def _sweep(self) -> None:
        for reservation in self._reservations.sweep():
            self._publish(reservation)

    def _publish(self, reservation: Reservation | None) -> None:
        if reservation is not None:
            for worker_id in set(reservation.worker_ids):
                self._set_gauge(worker_id)

    def _set_gauge(self, worker_id: str) -> None:
        num_in_flight = self._reservations.num_in_flight(worker_id)
        self._metrics.set_in_flight(worker_id, num_in_flight)
        if num_in_flight:
            self._published_worker_ids.add(worker_id)
        else:
            self._published_worker_ids.discard(worker_id)

    def _reason(self, prefill: ScoredWorker, decode: ScoredWorker) -> str:
        return (
            f"{self._policy.name} prefill={prefill.worker.worker_id}:{prefill.score:.3f} "
            f"decode={decode.worker.worker_id}:{decode.score:.3f}"
        )

    @staticmethod
    def _no_worker_error(request: ScheduleInput, workers: list[WorkerRecord], role: str) -> TandemError:
        served_models = sorted({w.model for w in workers})
        if served_models and request.model not in served_models:
            return InvalidRequestError(
                f"model {request.model!r} is not served here; served models: {', '.join(served_models)}",
                param="model",
                code="model_not_found",
            )
        num_of_role = sum(1 for w in workers if w.role == role and w.model == request.model)
        num_excluded = sum(
            1
            for w in workers
            if w.role == role and w.model == request.model and w.worker_id in request.exclude_worker_ids
        )
        return NoCapacityError(
            f"no {role} worker available for model {request.model!r} "
            f"({num_of_role} registered, {num_excluded} excluded by the caller)",
            retry_after_s=NO_CAPACITY_RETRY_AFTER_S,
        )
