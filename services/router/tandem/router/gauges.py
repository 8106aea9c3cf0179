"""The router's per-worker and per-pool gauges, per model.

:class:`tandem.router.placement.Placer` calls :meth:`Gauges.publish` for each reservation it makes,
:class:`tandem.router.scheduler.Scheduler` for each one that ends, and
:meth:`tandem.router.scheduler.Scheduler.tick` calls :meth:`Gauges.refresh` every few seconds: Ray
forgets a gauge that is not set for a couple of export intervals, and the autoscaler must see a
quiet pool's zeros, not "no data". Writes to :class:`tandem.router.metrics.RouterMetrics` only.

``publish`` only notes the reservation's workers; their gauges are set together :data:`FLUSH_S` later
(at once where no event loop runs), one budget computation for all the prefill workers noted. Set in
each decision, the prefill backlog's budget computation for one worker was about half of the
decision's commit (``FLEET_PROFILE=1 python benchmarks/router_fleet.py``, 2026-12-07: 0.32 of 0.70 s of
commits in 4,500 decisions at 1,000 SIMULATED workers), and it ran again in every release; Ray exports
a gauge every few seconds and Prometheus scrapes it every 15 s or so, so 50 ms later changes nothing a
reader sees.

A prefill worker's tokens in flight (the prefill pool's backlog, the autoscaler's ``uncached_tokens``)
count as its budget counts them: a reservation lives until Release, through the request's decode, but
once older than a heartbeat it counts only as far as the worker still reports prompt tokens in flight
(:func:`tandem.router.kernels.budget_state`); each replica publishes its share of that load (in
proportion to the tokens it reserved there), so the replicas' gauges add up to what the admission
counts. Counted until Release, short chats with long answers read as several times the prefill work
there was, and grew the prefill pool while one worker was 60 % busy (make autoscale-demo --scenario
short-chats). A decode worker's count is every reservation: decode holds the KV until Release.

Every series is tagged with its model (a worker's, or a waiting request's): the operator's
per-model pools select them by it, and its single-model form sums or averages them unselected (one
model: the same figures as before the tag). A model whose last worker left (and whose queue is
empty) gets its pool and queue gauges set to zero once and then no more: a stale non-zero load of a
pool that no longer exists would keep voting for replicas, and a zero re-published forever would
keep voting it down; once Ray drops the unset series the operator reads "no data" and holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Final

from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.ledger import Ledger
from tandem.router.metrics import RouterMetrics
from tandem.router.reservations import Reservation, ReservationTable

#: Per model, per role: (requests, prompt tokens no worker holds) waiting for that role's budget.
Queued = Mapping[str, Mapping[str, tuple[int, int]]]
ROLES = (ROLE_PREFILL, ROLE_DECODE)
#: How long after a reservation is made or ends its workers' gauges are set (module docstring).
FLUSH_S: Final = 0.05


class Gauges:
    """Owns which workers' and models' gauges are set, and every placed worker's role and model."""

    def __init__(
        self, metrics: RouterMetrics, reservations: ReservationTable, budget: BudgetConfig, ledger: Ledger | None
    ) -> None:
        self._metrics = metrics
        self._reservations = reservations
        self._budget = budget
        self._ledger = ledger
        # Workers whose gauges are non-zero, so refresh() can set them again, and every placed worker's
        # (role, model).
        self._published_worker_ids: set[str] = set()
        self._worker_labels: dict[str, tuple[str, str]] = {}
        # Models whose pool and queue gauges the last refresh() set: one that leaves gets its zeros once.
        self._published_models: set[str] = set()
        # The prefill workers' last records (their reports correct the gauge as they correct the budget).
        self._prefill_records: dict[str, WorkerRecord] = {}
        # Workers whose reservations changed since their gauges were last set, and the pending flush.
        self._dirty: set[str] = set()
        self._flush_soon: asyncio.TimerHandle | None = None

    def note_role(self, worker: WorkerRecord) -> None:
        self._worker_labels[worker.worker_id] = (worker.role, worker.model)
        if worker.role == ROLE_PREFILL:
            self._prefill_records[worker.worker_id] = worker

    def publish(self, reservation: Reservation | None) -> None:
        """Set the gauges of ``reservation``'s workers (after it was made or ended), :data:`FLUSH_S`
        from now with every other change meanwhile."""
        if reservation is None:
            return
        self._dirty.update(reservation.worker_ids)
        if self._flush_soon is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a tool, a synchronous test): now
            self.flush()
            return
        self._flush_soon = loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Set the gauges of the workers whose reservations changed since they were last set."""
        if self._flush_soon is not None:
            self._flush_soon.cancel()
            self._flush_soon = None
        dirty, self._dirty = self._dirty, set()
        if dirty:
            self._set_many(dirty)

    def refresh(self, workers: Sequence[WorkerRecord], queued: Queued) -> None:
        """Set every known worker's gauges (zeros included), and per model the queue's per role and
        the pools'; a model gone since the last refresh reads zero once."""
        for worker in workers:
            self._worker_labels.setdefault(worker.worker_id, (worker.role, worker.model))
            self._published_worker_ids.add(worker.worker_id)
            if worker.role == ROLE_PREFILL:
                self._prefill_records[worker.worker_id] = worker
        self._dirty |= self._published_worker_ids
        self.flush()
        live = {w.worker_id for w in workers} | self._published_worker_ids
        for worker_id in [w for w in self._worker_labels if w not in live]:
            del self._worker_labels[worker_id]  # a worker gone for good (a pod replaced has a new id)
            self._prefill_records.pop(worker_id, None)
        pools = self.pools(workers)
        models = {model for model, _ in pools} | {model for model, by_role in queued.items() if any(by_role.values())}
        for model in sorted(models | self._published_models):
            by_role = queued.get(model, {})
            for role in ROLES:
                num_requests, num_tokens = by_role.get(role, (0, 0))
                self._metrics.set_queued(role, model, num_requests, num_tokens)
                used_fraction, num_in_flight = pools.get((model, role), (0.0, 0))
                self._metrics.set_pool(role, model, used_fraction, num_in_flight)
        self._published_models = models

    def pools(self, workers: Sequence[WorkerRecord]) -> dict[tuple[str, str], tuple[float, int]]:
        """Per (model, role) of the registered workers, the average budget fraction in use over them
        (every replica's reservations, as :meth:`BudgetView.fits` counts them) and the requests this
        replica placed on them. A model with workers of one role only reads zeros for the other."""
        view = BudgetView(self._reservations, self._budget, self._ledger)
        members: dict[tuple[str, str], list[WorkerRecord]] = {}
        for model in {w.model for w in workers}:
            for role in ROLES:
                members[(model, role)] = []
        for worker in workers:
            if worker.role in ROLES:
                members[(worker.model, worker.role)].append(worker)
        pools: dict[tuple[str, str], tuple[float, int]] = {}
        for key, pool in members.items():
            fractions = [view.load_fraction(w) for w in pool if view.capacity_tokens(w) > 0]
            pools[key] = (
                sum(fractions) / len(fractions) if fractions else 0.0,
                sum(self._reservations.num_in_flight(w.worker_id) for w in pool),
            )
        return pools

    def _budget_tokens(self, worker_ids: Sequence[str]) -> list[int]:
        """This replica's budget tokens on each of ``worker_ids``; on a prefill worker, its share of the
        load the budget counts (see the module docstring), computed for all of them at once."""
        own = [self._reservations.num_tokens_in_flight(worker_id) for worker_id in worker_ids]
        shared = [
            (i, record)
            for i, worker_id in enumerate(worker_ids)
            if own[i] > 0 and (record := self._prefill_records.get(worker_id)) is not None
        ]
        if not shared:
            return own
        view = BudgetView(self._reservations, self._budget, self._ledger)
        loads = view.budgets(False, [record for _, record in shared])[1]["load_tokens"]
        for (i, record), load in zip(shared, loads, strict=True):
            others = self._ledger.others_tokens(record.worker_id) if self._ledger is not None else 0
            own[i] = round(int(load) * own[i] / (own[i] + max(0, others)))
        return own

    def _set_many(self, worker_ids: set[str]) -> None:
        ordered = sorted(worker_ids)
        for worker_id, num_tokens in zip(ordered, self._budget_tokens(ordered), strict=True):
            num_in_flight = self._reservations.num_in_flight(worker_id)
            role, model = self._worker_labels.get(worker_id, (ROLE_PREFILL, ""))
            self._metrics.set_in_flight(worker_id, model, num_in_flight)
            self._metrics.set_tokens_in_flight(worker_id, role, model, num_tokens)
            if num_in_flight:
                self._published_worker_ids.add(worker_id)
            else:
                self._published_worker_ids.discard(worker_id)
