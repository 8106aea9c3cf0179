"""Hand-offs between router replicas on the wire (msgpack through the ledger).

:class:`tandem.router.scheduler.Scheduler` publishes a waiting request through
:meth:`tandem.router.ledger.Ledger.queued` with :func:`_encode_pending`; a replica where budget
frees rebuilds it with :func:`_decode_pending`, places it, and sends the placement back with
:func:`_encode_handoff`; the waiter's replica adopts it with :func:`_decode_handoff`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tandem.common.registry import WorkerRecord
from tandem.router.ledger import HandOff, RemoteWaiter
from tandem.router.ledger_events import BlockHashes, HandOffPlacement, WaitingRequest, WorkerRef
from tandem.router.placement import PendingRequest, PlacementDecision
from tandem.router.policy import ScheduleRequest
from tandem.router.reservations import Reservation


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
