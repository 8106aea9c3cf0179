"""The wait for budget: the admission queue, its poller and its drain.

:class:`tandem.router.scheduler.Scheduler` calls :meth:`WaitingRoom.wait` when a request finds no
worker with budget (or others wait before it), and :meth:`WaitingRoom.drain` whenever budget may
have come free (a reservation ended or expired, a new worker list, another replica's ledger
message). The request waits in the :class:`tandem.router.admission.AdmissionQueue` (priority, then
the tenants' fair share) until budget frees up or ``QueueSettings.timeout_s`` passes (then
NoCapacityError with a Retry-After). With several replicas the queue is the router's: a drain also
places other replicas' waiters that go first (:mod:`tandem.router.handoff`, through the
:class:`RemotePlacer` it is given), and each waiter is published on the ledger for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.common.errors import NoCapacityError, TandemError
from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router.admission import AdmissionQueue, QueueFullError, Waiter
from tandem.router.fair_share import TenantShares
from tandem.router.handoff import _encode_pending
from tandem.router.intake import WorkerIntake
from tandem.router.ledger import Ledger, RemoteWaiter
from tandem.router.metrics import RouterMetrics
from tandem.router.placement import NO_CAPACITY_RETRY_AFTER_S, NoBudget, PendingRequest, PlacementDecision, Placer
from tandem.router.policy import ScheduleRequest
from tandem.router.settings import QueueSettings

logger = logging.getLogger(__name__)

#: Other replicas' waiters a drain tries and finds no budget for (or cannot place here) before it
#: turns to this replica's own head alone: each try is a placement decision.
MAX_REMOTE_MISSES = 4


@dataclass(frozen=True)
class Rank:
    """Where a request stands in the fair-share order (its tenant's service is read when compared)."""

    priority_index: int
    tenant: str
    enqueued_at_unix: float


class BudgetEpoch:
    """Moves whenever budget may have come free here (a reservation ended or expired, a new worker
    list, a poll of the queue: time passing ages reservations) or at another replica."""

    def __init__(self, ledger: Ledger | None) -> None:
        self._ledger = ledger
        self._num_frees = 0

    def bump(self) -> None:
        self._num_frees += 1

    @property
    def value(self) -> int:
        return self._num_frees + (self._ledger.num_frees if self._ledger is not None else 0)


class RemotePlacer(Protocol):
    """Places other replicas' waiters here (:class:`tandem.router.handoff.HandOffs`)."""

    def ahead_of(self, rank: Rank | None, skip: set[str]) -> RemoteWaiter | None:
        """The best-ranked other replica's waiter that goes before ``rank`` (any, for None), or None."""

    def place_for(self, remote: RemoteWaiter, workers: Sequence[WorkerRecord]) -> bool:
        """Place ``remote`` here and hand the placement off; False when it does not fit here now."""


class WaitingRoom:
    """Owns this replica's waiters. Not thread-safe; used from the replica's event loop."""

    def __init__(
        self,
        config: QueueSettings,
        placer: Placer,
        intake: WorkerIntake,
        shares: TenantShares,
        ledger: Ledger | None,
        metrics: RouterMetrics,
        epoch: BudgetEpoch,
        sweep: Callable[[], None],
    ) -> None:
        self.config = config
        self._placer = placer
        self._intake = intake
        self._shares = shares
        self._ledger = ledger
        self._metrics = metrics
        self._epoch = epoch
        #: Ends expired reservations (before each poll's drain).
        self._sweep = sweep
        #: Other replicas' waiters, placed here (set once the hand-offs exist: they rank against this room).
        self.remote: RemotePlacer | None = None
        self.queue: AdmissionQueue[PendingRequest] = AdmissionQueue(
            priority_classes=config.priority_classes,
            default_priority=config.default_priority,
            max_depth=config.max_depth,
        )
        #: This replica's waiters by request id (a hand-off names one).
        self.waiters_by_id: dict[str, Waiter[PendingRequest]] = {}
        #: The requests found not to fit at one budget epoch: not tried again until it moves (a drain
        #: runs on every ledger message, and most add load, not free it).
        self._misses: tuple[int, set[str]] = (-1, set())
        self._poller: asyncio.Task[None] | None = None
        #: What the queue's head lacked at its last try: everyone behind it waits for the same.
        self.blocked_on: tuple[str, ...] = (ROLE_PREFILL,)

    def __len__(self) -> int:
        return len(self.queue)

    async def wait(self, pending: PendingRequest) -> PlacementDecision:
        """Wait in the queue until ``pending`` is placed (here or by another replica) or times out."""
        request = pending.request
        cfg = self.config
        priority = request.priority or cfg.tenant_priorities.get(request.tenant, "")
        try:
            waiter = self.queue.push(pending, tenant=request.tenant, priority=priority)
        except QueueFullError as exc:
            raise NoCapacityError(str(exc), retry_after_s=NO_CAPACITY_RETRY_AFTER_S) from None
        self.waiters_by_id[request.request_id] = waiter
        if self._ledger is not None:
            self._ledger.queued(
                request.request_id,
                request.tenant,
                self.queue.priority_index(waiter.priority),
                waiter.enqueued_at_unix,
                _encode_pending(pending, waiter.priority),
            )
        self._metrics.set_queue_depth(waiter.priority, self.queue.depth(waiter.priority))
        started_s = time.monotonic()
        outcome = "timeout"
        try:
            self.drain(self._intake.last_workers or [])
            self._ensure_poller()
            if not waiter.future.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(waiter.future), cfg.timeout_s)
            if waiter.future.done():
                outcome = "admitted" if waiter.future.exception() is None else "error"
                result = waiter.future.result()
                assert isinstance(result, PlacementDecision)
                return result
            raise NoCapacityError(
                f"no worker had budget for {cfg.timeout_s:g} s ({len(self.queue)} requests waiting)",
                retry_after_s=max(NO_CAPACITY_RETRY_AFTER_S, cfg.timeout_s),
            )
        finally:
            self.dequeue(waiter)
            if self.waiters_by_id.get(request.request_id) is waiter:
                del self.waiters_by_id[request.request_id]
            if not waiter.future.done():
                waiter.future.cancel()
            self._metrics.set_queue_depth(waiter.priority, self.queue.depth(waiter.priority))
            self._metrics.observe_queue_wait(time.monotonic() - started_s, outcome=outcome, model=request.model)

    def _ensure_poller(self) -> None:
        """One task re-tries the queue every ``poll_interval_s`` while it holds anyone (budget also
        frees without an event here: leases expire, worker reports age reservations, the registry
        changes); ended reservations and the ledger's changes drain it at once. One poller, not one
        per waiter: each try is a placement decision, and a waiter each polling made the work grow
        with the queue."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_while_queued())

    async def _poll_while_queued(self) -> None:
        while self.queue:
            await asyncio.sleep(self.config.poll_interval_s)
            self._epoch.bump()  # time passed: reservations aged, worker reports moved
            try:
                self._sweep()
                self.drain(await self._intake.workers())
            except TandemError as exc:  # the registry is down: the waiters time out on their own
                logger.warning("admission queue poll failed: %s", exc)

    def dequeue(self, waiter: Waiter[PendingRequest]) -> None:
        if self.queue.remove(waiter) and self._ledger is not None:
            self._ledger.dequeued(waiter.item.request.request_id)

    def admit(self, waiter: Waiter[PendingRequest], decision: PlacementDecision) -> None:
        self.dequeue(waiter)
        waiter.future.set_result(decision)

    def rank(self, waiter: Waiter[PendingRequest]) -> Rank:
        return Rank(self.queue.priority_index(waiter.priority), waiter.tenant, waiter.enqueued_at_unix)

    def rank_of_new(self, request: ScheduleRequest) -> Rank:
        priority = self.queue.priority_of(request.priority or self.config.tenant_priorities.get(request.tenant, ""))
        return Rank(self.queue.priority_index(priority), request.tenant, time.time())

    def _missed_now(self) -> set[str]:
        """The requests that did not fit since budget last came free (a set to add to)."""
        epoch = self._epoch.value
        if self._misses[0] != epoch:
            self._misses = (epoch, set())
        return self._misses[1]

    def drain(self, workers: Sequence[WorkerRecord]) -> None:
        """Admit waiters in the router's priority / fair-share order while the head one fits: this
        replica's own, and other replicas' (placed here and handed off to their replica, see
        :mod:`tandem.router.ledger`). Admitting in the same loop iteration as the reservation's end
        that freed the budget puts both in one ledger message: no other replica ever sees that
        budget free. Each request that did not fit is tried again only once budget may have come free."""
        missed = self._missed_now()
        num_remote_misses = 0
        while True:
            waiter: Waiter[PendingRequest] | None = self.queue.next(self._shares.served)
            if waiter is not None and waiter.future.done():
                self.dequeue(waiter)
                continue
            remote = None
            if self.remote is not None and num_remote_misses < MAX_REMOTE_MISSES:
                remote = self.remote.ahead_of(None if waiter is None else self.rank(waiter), missed)
            if remote is not None:
                assert self.remote is not None
                if not self.remote.place_for(remote, workers):
                    # It does not fit now, or cannot be placed here: its own replica's queue holds it
                    # (and blocks what would pass it there), this one goes on.
                    missed.add(remote.request_id)
                    num_remote_misses += 1
                continue
            if waiter is None or waiter.item.request.request_id in missed:
                return
            try:
                choice = self._placer.decide(waiter.item, workers)
            except NoBudget as exc:
                waiter.item.waiting_for = self.blocked_on = exc.roles
                missed.add(waiter.item.request.request_id)
                return
            except TandemError as exc:
                self.dequeue(waiter)
                waiter.future.set_exception(exc)
                continue
            self.dequeue(waiter)
            waiter.future.set_result(self._placer.commit(choice))

    def queued(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Per model of the waiting requests, per role: (requests, prompt tokens no worker holds)
        waiting for that role's budget. A request not tried yet waits behind the head, for what the
        head lacks; a request that both pools lack budget for counts in both. Only models some worker
        served when the request came in wait (an unknown model is refused before the queue)."""
        queued: dict[str, dict[str, list[int]]] = {}
        for waiter in self.queue.waiters():
            pending = waiter.item
            by_role = queued.setdefault(pending.request.model, {ROLE_PREFILL: [0, 0], ROLE_DECODE: [0, 0]})
            for role in pending.waiting_for or self.blocked_on:
                counts = by_role[role]
                counts[0] += 1
                counts[1] += pending.num_uncached_estimate
        return {
            model: {role: (n, tokens) for role, (n, tokens) in by_role.items()} for model, by_role in queued.items()
        }

    def queued_by_role(self, model: str | None = None) -> dict[str, tuple[int, int]]:
        """:meth:`queued` summed over models: per role, of ``model``'s requests, or of all (None)."""
        totals = {ROLE_PREFILL: (0, 0), ROLE_DECODE: (0, 0)}
        for name, by_role in self.queued().items():
            if model is None or name == model:
                for role, (n, tokens) in by_role.items():
                    totals[role] = (totals[role][0] + n, totals[role][1] + tokens)
        return totals
