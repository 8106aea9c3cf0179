"""Hand-offs between router replicas: placing another replica's waiter here, and adopting a
placement another replica made for a waiter of this one.

The queue is the router's, not one replica's. :class:`tandem.router.waiting.WaitingRoom`'s drain
asks :meth:`HandOffs.ahead_of` for another replica's waiter that goes before its own head (the
ledger's :meth:`tandem.router.ledger.Ledger.remote_heads`, ranked by priority, fair share and
age) and :meth:`HandOffs.place_for` to place it here: the placement is reserved here and published
to the waiter's replica (:meth:`tandem.router.ledger.Ledger.handed_off`), which adopts it
(:meth:`HandOffs.adopt`: the reservation moves there, the placer's copy ends in the same message)
or refuses it when the request no longer waits. A placement never answered ends after
``QueueSettings.handoff_timeout_s`` (:meth:`HandOffs.expire`).

On the wire (msgpack through the ledger): :class:`tandem.router.scheduler.Scheduler` publishes a
waiting request through :meth:`tandem.router.ledger.Ledger.queued` with :func:`_encode_pending`; a
replica where budget frees rebuilds it with :func:`_decode_pending`, places it, and sends the
placement back with :func:`_encode_handoff`; the waiter's replica adopts it with
:func:`_decode_handoff`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tandem.common.errors import TandemError
from tandem.common.registry import WorkerRecord
from tandem.router.fair_share import TenantShares
from tandem.router.gauges import Gauges
from tandem.router.intake import WorkerIntake
from tandem.router.ledger import HandOff, Ledger, RemoteWaiter
from tandem.router.ledger_events import BlockHashes, HandOffPlacement, WaitingRequest, WorkerRef
from tandem.router.metrics import RouterMetrics
from tandem.router.placement import Choice, NoBudget, PendingRequest, PlacementDecision, Placer
from tandem.router.policy import ScheduleRequest
from tandem.router.reservations import Reservation, ReservationTable

if TYPE_CHECKING:
    from tandem.router.waiting import Rank, WaitingRoom

logger = logging.getLogger(__name__)

#: Other replicas' waiters decoded for a placement here, at most (a cache: cleared when full).
MAX_REMOTE_PENDING = 10_000


class HandOffs:
    """Owns the placements made here for other replicas' waiters. Not thread-safe."""

    def __init__(
        self,
        ledger: Ledger,
        room: WaitingRoom,
        placer: Placer,
        intake: WorkerIntake,
        reservations: ReservationTable,
        shares: TenantShares,
        gauges: Gauges,
        metrics: RouterMetrics,
        end_reservation: Callable[[str], bool],
    ) -> None:
        self._ledger = ledger
        self._room = room
        self._placer = placer
        self._intake = intake
        self._reservations = reservations
        self._shares = shares
        self._gauges = gauges
        self._metrics = metrics
        #: Ends this replica's reservation of a request id (False: there was none).
        self._end_reservation = end_reservation
        #: Placements made here for other replicas' waiters, not adopted or refused yet: request id ->
        #: (the waiter's replica, when).
        self.handed_off: dict[str, tuple[str, float]] = {}
        #: Other replicas' waiters decoded for a placement here.
        self._remote_pending: dict[str, PendingRequest] = {}

    def anyone_waiting(self) -> bool:
        """Another replica's queue holds a request this one may place."""
        return any(r.request_id not in self.handed_off for r in self._ledger.remote_waiters())

    def ahead_of_new(self, request: ScheduleRequest) -> bool:
        """Whether another replica's waiter goes before a new ``request`` (no rank is computed when no
        other replica has a waiter: the usual case)."""
        if not self._ledger.has_remote_waiters:
            return False
        return self.ahead_of(self._room.rank_of_new(request)) is not None

    def ahead_of(self, rank: Rank | None, skip: set[str] | None = None) -> RemoteWaiter | None:
        """The best-ranked waiting request of another replica that goes before one of ``rank`` (a
        higher class, or the same class and a tenant served less, or the same service and waiting
        longer; any, when ``rank`` is None), or None. Requests handed off from here already, and those
        in ``skip``, do not count. Each tenant's service is read once per call (it decays as time
        passes: read twice, a tenant would rank before itself)."""
        served: dict[str, float] = {}
        queue = self._room.queue

        def key(priority_index: int, tenant: str, enqueued_at_unix: float) -> tuple[int, float, float]:
            service = served.get(tenant)
            if service is None:
                service = served[tenant] = self._shares.served(tenant)
            return queue.rank(priority_index, service, enqueued_at_unix)

        best_key = (
            key(rank.priority_index, rank.tenant, rank.enqueued_at_unix)
            if rank is not None
            else (float("inf"), float("inf"), float("inf"))
        )
        best: RemoteWaiter | None = None
        handed_off, own, held = self.handed_off, self._room.waiters_by_id, self._reservations
        skipped = skip or ()

        def passed_over(request_id: str) -> bool:
            # Handed off from here already; or a request this replica waits for or holds itself (the
            # gateway retried it here, and the other replica's copy is stale): never placed twice.
            if request_id in handed_off or request_id in skipped or request_id in own:
                return True
            return held.get(request_id) is not None

        for remote in self._ledger.remote_heads(passed_over):
            remote_key = key(remote.priority_index, remote.tenant, remote.enqueued_at_unix)
            if remote_key < best_key:
                best_key, best = remote_key, remote
        return best

    def place_for(self, remote: RemoteWaiter, workers: Sequence[WorkerRecord]) -> bool:
        """Place another replica's waiter here and hand the placement to its replica; False when it
        does not fit now, or cannot be placed here at all (no payload: an older replica; a model or
        worker this replica does not know): its own replica's queue still holds it."""
        choice = self._decide(remote, workers)
        if choice is None:
            return False
        self._hand_off(remote, choice)
        return True

    def _decide(self, remote: RemoteWaiter, workers: Sequence[WorkerRecord]) -> Choice | None:
        pending = self._remote_pending.get(remote.request_id)
        if pending is None:
            pending = _decode_pending(remote)
            if pending is None:
                return None
            if len(self._remote_pending) >= MAX_REMOTE_PENDING:
                self._remote_pending.clear()
            self._remote_pending[remote.request_id] = pending
        try:
            return self._placer.decide(pending, workers)
        except (NoBudget, TandemError):
            return None

    def _hand_off(self, remote: RemoteWaiter, choice: Choice) -> None:
        """Reserve ``choice`` for another replica's waiter here and publish it to that replica."""
        self._remote_pending.pop(remote.request_id, None)
        decision = self._placer.commit(choice)
        reservation = self._reservations.get(remote.request_id)
        assert reservation is not None
        self.handed_off[remote.request_id] = (remote.replica_id, time.monotonic())
        self._ledger.handed_off(remote.replica_id, remote.request_id, _encode_handoff(decision, reservation))
        self._metrics.count_handoff("placed")

    def adopt(self, handoff: HandOff) -> None:
        """Another replica placed one of this replica's waiters: hold the placement here (and the
        placer's copy goes, in the same message), or refuse it when the request no longer waits."""
        waiter = self._room.waiters_by_id.get(handoff.request_id)
        if waiter is None or waiter.future.done():
            self._ledger.forward_end_to(handoff.placer_id, handoff.request_id)
            self._metrics.count_handoff("refused")
            return
        try:
            decision, worker_ids, tokens, tenant, age_s = _decode_handoff(handoff, self._intake.last_workers or ())
        except (TypeError, ValueError):
            logger.warning("undecodable hand-off of %s from %s: refused", handoff.request_id, handoff.placer_id)
            self._ledger.forward_end_to(handoff.placer_id, handoff.request_id)
            self._metrics.count_handoff("refused")
            return
        reservation = self._reservations.reserve(
            handoff.request_id, worker_ids, tokens, tenant=tenant, reserved_at_s=self._reservations.now_s() - age_s
        )
        for worker in (decision.prefill, decision.decode):
            if worker is not None and worker.worker_id in reservation.worker_ids:
                self._gauges.note_role(worker)
        # The tenant's service was counted once, by the placer's reservation: 0 here.
        self._ledger.reserved(reservation, 0)
        self._ledger.forward_end_to(handoff.placer_id, handoff.request_id)
        self._gauges.publish(reservation)
        self._room.admit(waiter, decision)
        self._metrics.count_handoff("adopted")

    def expire(self, timeout_s: float) -> None:
        """End the reservations of placements handed off and never answered (a lost message, a
        replica gone)."""
        if not self.handed_off:
            return
        horizon_s = time.monotonic() - timeout_s
        for request_id, (_, at_s) in list(self.handed_off.items()):
            if at_s <= horizon_s:
                del self.handed_off[request_id]
                if self._end_reservation(request_id):
                    self._metrics.count_handoff("expired")


# -- hand-offs on the wire (msgpack through the ledger) -----------------------------------------------


def _encode_pending(pending: PendingRequest, priority: str) -> WaitingRequest:
    """What another replica needs to place a waiting request: sizes, exclusions and block hashes."""
    request = pending.request
    return WaitingRequest(
        model=request.model,
        num_prompt_tokens=request.num_tokens,
        max_tokens=request.max_tokens,
        block_hashes=[BlockHashes(size, algo, list(hashes)) for (size, algo), hashes in pending.hashes.items()],
        exclude_worker_ids=sorted(request.exclude_worker_ids),
        prefill_done_on_worker_id=request.prefill_done_on_worker_id,
        priority=priority,
        local_prefill_only=request.local_prefill_only,
        adapter=request.adapter,
    )


def _decode_pending(remote: RemoteWaiter) -> PendingRequest | None:
    """:func:`_encode_pending` undone (None when the waiter came without one: an older replica)."""
    waiting = remote.payload
    if waiting is None:
        return None
    hashes = {(b.block_size, b.algo): b.hashes for b in waiting.block_hashes}
    request = ScheduleRequest(
        request_id=remote.request_id,
        model=waiting.model,
        num_prompt_tokens=waiting.num_prompt_tokens,
        max_tokens=waiting.max_tokens,
        tenant=remote.tenant,
        prompt_block_hashes=hashes,
        exclude_worker_ids=frozenset(waiting.exclude_worker_ids),
        priority=waiting.priority,
        prefill_done_on_worker_id=waiting.prefill_done_on_worker_id,
        local_prefill_only=waiting.local_prefill_only,
        adapter=waiting.adapter,
    )
    return PendingRequest(request, hashes=dict(hashes))


def _worker_ref(worker: WorkerRecord) -> WorkerRef:
    return WorkerRef(worker.worker_id, worker.role, worker.model, worker.address)


def _encode_handoff(decision: PlacementDecision, reservation: Reservation) -> HandOffPlacement:
    return HandOffPlacement(
        worker_ids=list(reservation.worker_ids),
        tokens=[int(reservation.tokens_by_worker.get(w, 0)) for w in reservation.worker_ids],
        tenant=reservation.tenant,
        placed_at_unix=time.time(),
        prefill=None if decision.prefill is None else _worker_ref(decision.prefill),
        decode=_worker_ref(decision.decode),
        lease_s=decision.lease_s,
        num_cached_tokens=decision.num_cached_tokens,
        num_decode_cached_tokens=decision.num_decode_cached_tokens,
        reason=decision.reason,
    )


def _decode_handoff(
    handoff: HandOff, known: Sequence[WorkerRecord]
) -> tuple[PlacementDecision, tuple[str, ...], dict[str, int], str, float]:
    """The placement, its reservation's workers and tokens, its tenant, and its age in seconds."""
    placement = handoff.placement
    by_id = {w.worker_id: w for w in known}

    def record(ref: WorkerRef) -> WorkerRecord:
        return by_id.get(ref.worker_id) or WorkerRecord(ref.worker_id, ref.role, ref.model, ref.address)

    decision = PlacementDecision(
        request_id=handoff.request_id,
        prefill=None if placement.prefill is None else record(placement.prefill),
        decode=record(placement.decode),
        lease_s=placement.lease_s,
        num_cached_tokens=placement.num_cached_tokens,
        reason=placement.reason,
        num_decode_cached_tokens=placement.num_decode_cached_tokens,
    )
    ids = tuple(placement.worker_ids)
    age_s = max(0.0, time.time() - placement.placed_at_unix)
    return decision, ids, dict(zip(ids, placement.tokens, strict=False)), placement.tenant, age_s
