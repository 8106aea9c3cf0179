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
from tandem.router.placement import PendingRequest, PlacementDecision
from tandem.router.policy import ScheduleRequest
from tandem.router.reservations import Reservation


def _encode_pending(pending: PendingRequest, priority: str) -> list[object]:
    """What another replica needs to place a waiting request: sizes, exclusions and block hashes."""
    request = pending.request
    return [
        request.model,
        request.num_tokens,
        request.max_tokens,
        [[block_size, algo, hashes] for (block_size, algo), hashes in pending.hashes.items()],
        sorted(request.exclude_worker_ids),
        request.prefill_done_on_worker_id,
        priority,
        request.local_prefill_only,
    ]


def _decode_pending(remote: RemoteWaiter) -> PendingRequest | None:
    """:func:`_encode_pending` undone (None when the waiter came without one, or it is malformed)."""
    if not isinstance(remote.payload, list | tuple):
        return None
    try:
        # A replica of the version before local_prefill_only sends seven fields.
        model, num_tokens, max_tokens, by_config, exclude, prefill_done_on, priority, *more = remote.payload
        local_only = bool(more[0]) if more else False
        hashes = {(int(block_size), str(algo)): [int(h) for h in values] for block_size, algo, values in by_config}
        request = ScheduleRequest(
            request_id=remote.request_id,
            model=str(model),
            num_prompt_tokens=int(num_tokens),
            max_tokens=int(max_tokens),
            tenant=remote.tenant,
            prompt_block_hashes=hashes,
            exclude_worker_ids=frozenset(str(w) for w in exclude),
            priority=str(priority),
            prefill_done_on_worker_id=str(prefill_done_on),
            local_prefill_only=local_only,
        )
    except (TypeError, ValueError):
        return None
    return PendingRequest(request, hashes=dict(hashes))


def _worker_fields(worker: WorkerRecord | None) -> list[str]:
    return [] if worker is None else [worker.worker_id, worker.role, worker.model, worker.address]


def _encode_handoff(decision: PlacementDecision, reservation: Reservation) -> list[object]:
    return [
        list(reservation.worker_ids),
        [int(reservation.tokens_by_worker.get(w, 0)) for w in reservation.worker_ids],
        reservation.tenant,
        time.time(),
        _worker_fields(decision.prefill),
        _worker_fields(decision.decode),
        decision.lease_s,
        decision.num_cached_tokens,
        decision.num_decode_cached_tokens,
        decision.reason,
    ]


def _decode_handoff(
    handoff: HandOff, known: Sequence[WorkerRecord]
) -> tuple[PlacementDecision, tuple[str, ...], dict[str, int], str, float]:
    """The placement, its reservation's workers and tokens, its tenant, and its age in seconds."""
    (worker_ids, tokens, tenant, placed_at_unix, prefill, decode, lease_s, num_cached, num_decode_cached, reason) = (
        handoff.placement
    )
    by_id = {w.worker_id: w for w in known}

    def record(fields: list[str]) -> WorkerRecord:
        worker_id, role, model, address = fields
        return by_id.get(worker_id) or WorkerRecord(worker_id, role, model, address)

    decision = PlacementDecision(
        request_id=handoff.request_id,
        prefill=record(prefill) if prefill else None,
        decode=record(decode),
        lease_s=float(lease_s),
        num_cached_tokens=int(num_cached),
        reason=str(reason),
        num_decode_cached_tokens=int(num_decode_cached),
    )
    ids = tuple(str(w) for w in worker_ids)
    return decision, ids, dict(zip(ids, (int(n) for n in tokens), strict=False)), str(tenant), max(
        0.0, time.time() - float(placed_at_unix)
    )
