"""Schedule and the end of a budget reservation, without Ray or gRPC: a façade over one module per job.

:class:`tandem.router.deployment.RouterDeployment` calls :meth:`Scheduler.schedule` and
:meth:`Scheduler.end_reservation_anywhere` for each Schedule and Release RPC, and
:meth:`Scheduler.tick` / :meth:`Scheduler.refresh_workers` / :meth:`Scheduler.sync_replicas` from its
upkeep loops. A Schedule goes through, in order:

1. :mod:`tandem.router.intake` — the cached worker list as the list decisions use, and the KV-event
   subscriptions kept in step with it;
2. :mod:`tandem.router.placement` — the pure decision (the prompt's block hashes per engine
   configuration looked up in the :class:`tandem.router.kv_index.KVIndex`; the policy's filter →
   score → pick, :meth:`tandem.router.policy.RoutingPolicy.choose_in`, for a decode worker and,
   unless the decode worker prefills the prompt itself, a prefill worker) and its commit (a budget
   reservation, :mod:`tandem.router.reservations`);
3. :mod:`tandem.router.waiting` — when no worker of some role has budget: the admission queue until
   budget frees or the queue timeout passes (then NoCapacityError with a Retry-After);
4. :mod:`tandem.router.handoff` — with several replicas the queue is the router's: the replica where
   budget frees places the best-ranked waiter of any replica and hands the placement to the
   waiter's replica;
5. :mod:`tandem.router.gauges` — the per-worker and per-pool gauges;
6. :mod:`tandem.router.pending_demand` — a request refused because its pool has no worker at all
   (the pool is at zero) counts as that pool's pending demand, which the autoscaler reads.

"Release" named five things across the tree; here only one, by its own name: a *budget
reservation* ends (:meth:`Scheduler.end_reservation`: the request finished or was retried, or its
lease expired). Not the router's: a *KV hold* (a prefill worker keeps a prompt's blocks for the
pull), *prefetch staging* (KV a decode worker pulled ahead of its Decode), a *hash-table row* (a
block leaving :class:`tandem.router.kv_index.KVIndex`), a *quota slot* (the gateway's per-tenant
concurrency). The gRPC method stays ``Release`` (wire compatibility).

Errors are tandem.common.errors; the deployment maps them to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from tandem.common.errors import NoCapacityError, TandemError
from tandem.common.registry import WorkerRecord
from tandem.router.budget import BudgetConfig
from tandem.router.fair_share import TenantShares
from tandem.router.gauges import Gauges
from tandem.router.handoff import HandOffs
from tandem.router.intake import WorkerIntake, WorkerView
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.ledger import Ledger
from tandem.router.metrics import NullRouterMetrics, RouterMetrics
from tandem.router.pending_demand import PendingDemand
from tandem.router.placement import (
    NO_CAPACITY_RETRY_AFTER_S,
    NoBudget,
    PendingRequest,
    PlacementDecision,
    Placer,
    PoolAtZeroError,
    check_request,
    check_servable,
)
from tandem.router.policy import RoutingPolicy, ScheduleRequest
from tandem.router.reservations import Reservation, ReservationTable
from tandem.router.settings import QueueSettings
from tandem.router.waiting import BudgetEpoch, WaitingRoom

__all__ = ["PlacementDecision", "Scheduler"]


class Scheduler:
    """One per Serve replica. Not thread-safe; used from the replica's event loop."""

    def __init__(
        self,
        view: WorkerView,
        policy: RoutingPolicy,
        reservations: ReservationTable,
        metrics: RouterMetrics | None = None,
        *,
        budget: BudgetConfig | None = None,
        index: KVIndex | None = None,
        subscriber: KVEventSubscriber | None = None,
        ledger: Ledger | None = None,
        queue: QueueSettings | None = None,
        min_uncached_tokens_to_disaggregate: int = 0,
        burst_stall_weight: float | None = None,
    ) -> None:
        self._reservations = reservations
        self._metrics: RouterMetrics = metrics or NullRouterMetrics()
        budget = budget or BudgetConfig()
        self._index = index if index is not None else (subscriber.index if subscriber else KVIndex())
        self._ledger = ledger
        queue_config = queue or QueueSettings()
        #: Every tenant's recent service in uncached prompt tokens: this replica's placements, plus the
        #: other replicas' through the ledger (which then shares this object).
        weights = dict(queue_config.tenant_weights)
        self._shares = (
            ledger.shares
            if ledger is not None
            else TenantShares(half_life_s=queue_config.fair_share_half_life_s, weights=weights)
        )
        self._epoch = BudgetEpoch(ledger)
        self.intake = WorkerIntake(view, budget, reservations, self._index, subscriber, ledger, self._epoch.bump)
        self._gauges = Gauges(self._metrics, reservations, budget, ledger)
        self._pending_demand = PendingDemand(self._metrics, window_s=queue_config.pending_demand_window_s)
        self._placer = Placer(
            policy,
            self.intake,
            self._index,
            reservations,
            self._shares,
            ledger,
            self._gauges,
            self._metrics,
            min_uncached_tokens_to_disaggregate,
            burst_stall_weight,
        )
        self._room = WaitingRoom(
            queue_config, self._placer, self.intake, self._shares, ledger, self._metrics, self._epoch, self._sweep
        )
        self._handoffs: HandOffs | None = None
        if ledger is not None:
            parts = (self._room, self._placer, self.intake, reservations, self._shares, self._gauges, self._metrics)
            self._handoffs = HandOffs(ledger, *parts, end_reservation=self._end_here)
            self._room.remote = self._handoffs
            ledger.on_change = self._on_ledger_change
            ledger.own_table = reservations
        self._drain_soon: asyncio.Handle | None = None

    @property
    def reservations(self) -> ReservationTable:
        return self._reservations

    @property
    def index(self) -> KVIndex:
        return self._index

    @property
    def policy(self) -> RoutingPolicy:
        return self._placer.policy

    @property
    def queue_depth(self) -> int:
        return len(self._room)

    @property
    def shares(self) -> TenantShares:
        return self._shares

    # -- Schedule ----------------------------------------------------------------

    async def schedule(self, request: ScheduleRequest) -> PlacementDecision:
        """Choose and reserve a (prefill, decode) pair for ``request``. Raises InvalidRequestError (bad
        input, or ``code="model_not_found"`` when no live worker serves the model) or NoCapacityError (no
        worker of some role, or no budget within the queue timeout)."""
        started_s = time.perf_counter()
        outcome = "ok"
        try:
            return await self._schedule(request)
        except TandemError as exc:
            outcome = getattr(exc, "code", None) or type(exc).__name__
            if isinstance(exc, PoolAtZeroError):
                self._pending_demand.note(exc.role, self.intake.model_label(request.model))
            raise
        finally:
            self._metrics.observe_schedule(
                time.perf_counter() - started_s, outcome=outcome, model=self.intake.model_label(request.model)
            )

    @property
    def pending_demand(self) -> PendingDemand:
        return self._pending_demand

    async def _schedule(self, request: ScheduleRequest) -> PlacementDecision:
        check_request(request)
        self._sweep()
        workers = await self.intake.workers_for(request.model)
        # A repeated Schedule of one request is a retry elsewhere: its earlier
        # pair must not count as load while choosing the new one.
        if not self._end_here(request.request_id) and self._ledger is not None:
            await self._ledger.forward_end(request.request_id)  # it was placed by another replica
        pending = PendingRequest(request)
        if not self._room and not (self._handoffs is not None and self._handoffs.ahead_of_new(request)):
            try:
                decision = self._placer.place(pending, workers)
            except NoBudget as exc:
                pending.waiting_for = self._room.blocked_on = exc.roles
            else:
                self._placer.arrived(pending)
                return decision
        else:
            check_servable(request, workers)
            self._placer.estimate_uncached(pending, workers)
        # Demand arrives here once, placed at once (above) or queued, before the queue's tries.
        self._placer.arrived(pending)
        return await self._room.wait(pending)

    async def refresh_workers(self) -> None:
        """Read the registry (through the view's cache) and follow its workers' KV events; returns
        once the list read is the one decisions use."""
        await self.intake.refresh()

    def place_now(self, request: ScheduleRequest, workers: Sequence[WorkerRecord]) -> PlacementDecision:
        """One placement decision without queueing or I/O (benchmarks, tests); NoCapacityError when no budget."""
        try:
            return self._placer.place(PendingRequest(request), workers)
        except NoBudget:
            raise NoCapacityError("no worker has budget", retry_after_s=NO_CAPACITY_RETRY_AFTER_S) from None

    def decide(self, request: ScheduleRequest, workers: Sequence[WorkerRecord]) -> PlacementDecision:
        """Where :meth:`place_now` would place ``request`` now, reserving nothing (a dry run: the
        replica-agreement benchmark asks an oracle); NoCapacityError when no budget."""
        try:
            return self._placer.decision(self._placer.decide(PendingRequest(request), workers))
        except NoBudget:
            raise NoCapacityError("no worker has budget", retry_after_s=NO_CAPACITY_RETRY_AFTER_S) from None

    # -- the end of a budget reservation -------------------------------------------------

    def end_reservation(self, request_id: str) -> bool:
        """End ``request_id``'s budget reservation held here; False when there was none (idempotent)."""
        self._sweep()
        found = self._end_here(request_id)
        if found and self.intake.last_workers is not None and self._anyone_waiting():
            self._room.drain(self.intake.last_workers)
        return found

    async def end_reservation_anywhere(self, request_id: str) -> bool:
        """End the reservation here, or forward its end to the replica that holds it (the Release RPC)."""
        if self.end_reservation(request_id):
            return True
        if self._ledger is not None:
            return await self._ledger.forward_end(request_id)
        return False

    def _end_here(self, request_id: str) -> bool:
        return self._ended(self._reservations.end(request_id))

    def _ended(self, reservation: Reservation | None) -> bool:
        """A reservation of this replica ended (ended, expired or replaced): gauges and the ledger."""
        if reservation is None:
            return False
        self._epoch.bump()
        if self._handoffs is not None:
            # A placement handed off and then ended here (a retry of its request placed here afresh,
            # its Release) is no longer the hand-off's: the timeout must not end what replaced it.
            self._handoffs.handed_off.pop(reservation.request_id, None)
        self._gauges.publish(reservation)
        if self._ledger is not None:
            self._ledger.reservation_ended(reservation)
        return True

    def _sweep(self) -> None:
        for reservation in self._reservations.sweep():
            self._ended(reservation)
        if self._handoffs is not None:
            self._handoffs.expire(self._room.config.handoff_timeout_s)

    # -- other replicas and upkeep -----------------------------------------------------

    def _on_ledger_change(self) -> None:
        """Another replica freed budget, forwarded a Release or changed its queue: drain soon (not
        inside the ledger's receive)."""
        if self._drain_soon is None:
            self._drain_soon = asyncio.get_running_loop().call_soon(self._drain_now)

    def _drain_now(self) -> None:
        self._drain_soon = None
        if self._ledger is not None and self._handoffs is not None:
            for request_id in self._ledger.take_forwarded():
                self._handoffs.handed_off.pop(request_id, None)
                self._end_here(request_id)
            for handoff in self._ledger.take_handoffs():
                self._handoffs.adopt(handoff)
        if self._anyone_waiting() and self.intake.last_workers is not None:
            self._room.drain(self.intake.last_workers)

    def _anyone_waiting(self) -> bool:
        """This replica's queue, or another replica's that this one may place for, holds a request."""
        return bool(self._room) or (self._handoffs is not None and self._handoffs.anyone_waiting())

    async def sync_replicas(self) -> None:
        """Apply the reservation ends other replicas forwarded here, and retry the queue (budget may
        have come free elsewhere). The ledger shares everything else as it happens."""
        self._drain_now()

    def tick(self) -> None:
        """Periodic upkeep, called by the deployment every few seconds: end expired leases even
        without traffic, and set every gauge again (:mod:`tandem.router.gauges`)."""
        self._sweep()
        self._shares.forget_idle()
        queue = self._room.queue
        for priority in queue.priority_classes:
            self._metrics.set_queue_depth(priority, queue.depth(priority))
        self._gauges.refresh(self.intake.last_workers or (), self._room.queued())
        self._pending_demand.refresh()

    def pools(self) -> dict[tuple[str, str], tuple[float, int]]:
        """Per (model, role), the average budget fraction in use and the requests this replica placed there."""
        return self._gauges.pools(self.intake.last_workers or ())

    def queued(self, model: str | None = None) -> dict[str, tuple[int, int]]:
        """Per role, (requests, prompt tokens no worker holds) waiting for that role's budget: of
        ``model``'s requests, or of all (None)."""
        return self._room.queued_by_role(model)
