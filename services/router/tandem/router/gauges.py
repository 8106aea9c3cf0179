"""The router's per-worker and per-pool gauges.

:class:`tandem.router.placement.Placer` calls :meth:`Gauges.publish` for each reservation it makes,
:class:`tandem.router.scheduler.Scheduler` for each one that ends, and
:meth:`tandem.router.scheduler.Scheduler.tick` calls :meth:`Gauges.refresh` every few seconds: Ray
forgets a gauge that is not set for a couple of export intervals, and the autoscaler must see a
quiet pool's zeros, not "no data". Writes to :class:`tandem.router.metrics.RouterMetrics` only.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.ledger import Ledger
from tandem.router.metrics import RouterMetrics
from tandem.router.reservations import Reservation, ReservationTable


class Gauges:
    """Owns which workers' gauges are set and every placed worker's role."""

    def __init__(
        self, metrics: RouterMetrics, reservations: ReservationTable, budget: BudgetConfig, ledger: Ledger | None
    ) -> None:
        self._metrics = metrics
        self._reservations = reservations
        self._budget = budget
        self._ledger = ledger
        # Workers whose gauges are non-zero, so refresh() can set them again, and every placed worker's role.
        self._published_worker_ids: set[str] = set()
        self._worker_roles: dict[str, str] = {}

    def note_role(self, worker: WorkerRecord) -> None:
        self._worker_roles[worker.worker_id] = worker.role

    def publish(self, reservation: Reservation | None) -> None:
        """Set the gauges of ``reservation``'s workers (after it was made or ended)."""
        if reservation is not None:
            for worker_id in set(reservation.worker_ids):
                self._set(worker_id)

    def refresh(self, workers: Sequence[WorkerRecord], queued: dict[str, tuple[int, int]]) -> None:
        """Set every known worker's gauges (zeros included), the queue's per role and the pools'."""
        for worker in workers:
            self._worker_roles.setdefault(worker.worker_id, worker.role)
            self._published_worker_ids.add(worker.worker_id)
        for worker_id in list(self._published_worker_ids):
            self._set(worker_id)
        live = {w.worker_id for w in workers} | self._published_worker_ids
        for worker_id in [w for w in self._worker_roles if w not in live]:
            del self._worker_roles[worker_id]  # a worker gone for good (a pod replaced has a new id)
        for role, (num_requests, num_tokens) in queued.items():
            self._metrics.set_queued(role, num_requests, num_tokens)
        for role, (used_fraction, num_in_flight) in self.pools(workers).items():
            self._metrics.set_pool(role, used_fraction, num_in_flight)

    def pools(self, workers: Sequence[WorkerRecord]) -> dict[str, tuple[float, int]]:
        """Per role, the average budget fraction in use over its registered workers (every replica's
        reservations, as :meth:`BudgetView.fits` counts them) and the requests this replica placed on it."""
        view = BudgetView(self._reservations, self._budget, self._ledger)
        pools: dict[str, tuple[float, int]] = {}
        for role in (ROLE_PREFILL, ROLE_DECODE):
            members = [w for w in workers if w.role == role]
            fractions = [view.load_fraction(w) for w in members if view.capacity_tokens(w) > 0]
            pools[role] = (
                sum(fractions) / len(fractions) if fractions else 0.0,
                sum(self._reservations.num_in_flight(w.worker_id) for w in members),
            )
        return pools

    def _set(self, worker_id: str) -> None:
        num_in_flight = self._reservations.num_in_flight(worker_id)
        self._metrics.set_in_flight(worker_id, num_in_flight)
        self._metrics.set_tokens_in_flight(
            worker_id,
            self._worker_roles.get(worker_id, ROLE_PREFILL),
            self._reservations.num_tokens_in_flight(worker_id),
        )
        if num_in_flight:
            self._published_worker_ids.add(worker_id)
        else:
            self._published_worker_ids.discard(worker_id)
