"""Placement: where a request goes, and the one Python form of a request being placed.

The Schedule request has one form inside the router: :class:`tandem.router.policy.ScheduleRequest`
(the deployment decodes the ``tandem.v1.ScheduleRequest`` proto into it at the wire edge,
:func:`tandem.router.deployment.schedule_request_from_proto`). :class:`PendingRequest` is not a
second form of it: it is the router's working state while placing one request (the request itself,
unchanged, plus what placing it has learned so far: its block hashes per engine configuration,
computed once, and what its last try lacked). Another replica that places a waiter of this one
rebuilds it from the ledger (:mod:`tandem.router.handoff`).

Where a request goes (:meth:`Placer.decide`): a decode worker first (the policy, among those with a
paired prefill worker); the decode worker prefills the prompt alone when little of it is uncached
there (``DISAGGREGATION__MIN_UNCACHED_TOKENS``, the handoff's price in prompt tokens), or when the
prefill worker it would be handed to is backed up: a burst, weighed by the one formula of
:mod:`tandem.router.burst` (the prefill worker's tokens ahead against the decode worker's own backlog
and the stall its other streams take); otherwise the policy picks a prefill worker and the KV is
handed off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import numpy.typing as npt

from tandem.common.block_hash import BlockHasher
from tandem.common.errors import InvalidRequestError, NoCapacityError, TandemError
from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router.adapter_slots import AdapterOverlay
from tandem.router.burst import BurstCost, BurstLedger, burst_cost
from tandem.router.fair_share import TenantShares
from tandem.router.fleet import CachedPrefix, FleetTable
from tandem.router.gauges import Gauges
from tandem.router.intake import WorkerIntake
from tandem.router.kv_index import KVIndex
from tandem.router.ledger import Ledger
from tandem.router.metrics import RouterMetrics
from tandem.router.pairing import Pairing
from tandem.router.policy import RoutingPolicy, ScheduleRequest, ScoredWorker
from tandem.router.pool import PoolArrays
from tandem.router.reservations import ReservationTable

#: How long a caller told "no capacity" should wait before trying again.
NO_CAPACITY_RETRY_AFTER_S = 1.0
#: ... and one told that the pool has no worker at all: the autoscaler starts one within its interval,
#: and a worker's start (engine load, warm-up) takes tens of seconds; an earlier retry is refused again.
POOL_AT_ZERO_RETRY_AFTER_S = 10.0


class PoolAtZeroError(NoCapacityError):
    """No worker of ``role`` serves the request's model at all (the pool is at zero, or its last worker
    left): the same 503 with Retry-After to the caller (a NoCapacityError on the wire), and the
    scheduler counts it as the pool's pending demand (:mod:`tandem.router.pending_demand`)."""

    def __init__(self, message: str, *, role: str) -> None:
        super().__init__(message, retry_after_s=POOL_AT_ZERO_RETRY_AFTER_S)
        self.role = role


@dataclass(frozen=True)
class PlacementDecision:
    """Where a request goes; the deployment turns it into a tandem.v1.Placement."""

    request_id: str
    #: None for a local prefill: the decode worker computes the prompt itself.
    prefill: WorkerRecord | None
    decode: WorkerRecord
    lease_s: float
    #: Prompt tokens the prefill worker is expected to have cached (0 for a local prefill).
    num_cached_tokens: int
    reason: str
    #: Prompt tokens the decode worker is expected to have cached.
    num_decode_cached_tokens: int = 0

    @property
    def local_prefill(self) -> bool:
        return self.prefill is None


@dataclass
class PendingRequest:
    """A request being placed, with its block hashes per engine configuration (computed once)."""

    request: ScheduleRequest
    hashes: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    #: The roles whose budget it lacked at its last try (empty if not tried yet; both when both pools
    #: are full: each must grow before it can go), and its prompt tokens that no worker holds (the
    #: whole prompt until the KV index was asked).
    waiting_for: tuple[str, ...] = ()
    num_uncached_tokens: int = -1

    @property
    def num_uncached_estimate(self) -> int:
        """Its prompt tokens no worker holds, as last estimated (:meth:`Placer.estimate_uncached`, or each
        try of :meth:`Placer.decide`); the whole prompt until then. What the queue's gauge
        (``tandem_router_queued_uncached_tokens``) and the prefill pool's arrivals count."""
        return self.num_uncached_tokens if self.num_uncached_tokens >= 0 else self.request.num_tokens


@dataclass(frozen=True)
class Choice:
    """A placement decided and not reserved yet."""

    request: ScheduleRequest
    prefill: ScoredWorker | None
    decode: ScoredWorker
    #: The prefill worker of the placement: the chosen one, the one named by a decode-only request, or
    #: None for a local prefill.
    prefill_worker: WorkerRecord | None
    local: bool
    num_cached_tokens: int
    num_decode_cached_tokens: int
    #: Prompt tokens this placement makes a worker compute (the tenant's fair-share cost).
    num_uncached_tokens: int
    tokens: dict[str, int]
    #: A local prefill because no prefill worker shares the decode worker's KV fingerprint.
    unpaired: bool = False
    #: A local prefill because the prefill worker was backed up (:mod:`tandem.router.burst`): the formula's
    #: two sides; None otherwise.
    burst: BurstCost | None = None


class NoBudget(Exception):
    """Workers of the role exist, but none has budget left: wait in the queue."""

    def __init__(self, roles: tuple[str, ...]) -> None:
        super().__init__(*roles)
        self.roles = roles


class Placer:
    """Decides (:meth:`decide`: no side effects but the policy's own rotation) and commits
    (:meth:`commit`: reserves the budget and tells everyone who counts it). Not thread-safe."""

    def __init__(
        self,
        policy: RoutingPolicy,
        intake: WorkerIntake,
        index: KVIndex,
        reservations: ReservationTable,
        shares: TenantShares,
        ledger: Ledger | None,
        gauges: Gauges,
        metrics: RouterMetrics,
        min_uncached_tokens_to_disaggregate: int,
        burst_stall_weight: float | None = None,
    ) -> None:
        self.policy = policy
        self._intake = intake
        self._index = index
        self._reservations = reservations
        self._shares = shares
        self._ledger = ledger
        self._gauges = gauges
        self._metrics = metrics
        #: Below this many prompt tokens missing from the decode worker's cache, it prefills alone (0: never).
        self._min_uncached_tokens_to_disaggregate = min_uncached_tokens_to_disaggregate
        #: Local prefills in bursts (:mod:`tandem.router.burst`): the stall weight of its formula; None: off.
        self._burst_stall_weight = burst_stall_weight if min_uncached_tokens_to_disaggregate > 0 else None
        self._bursts = BurstLedger(reservations)
        self._hashers: dict[tuple[int, str], BlockHasher] = {}
        #: Adapters this replica placed lately, as loaded on their workers before the records say so.
        self.adapters = AdapterOverlay(clock=reservations.now_s)

    def place(self, pending: PendingRequest, workers: Sequence[WorkerRecord]) -> PlacementDecision:
        return self.commit(self.decide(pending, workers))

    def decide(self, pending: PendingRequest, workers: Sequence[WorkerRecord]) -> Choice:
        """The placement for ``pending`` (raises NoBudget or the error naming what is missing); no side
        effects but the policy's own rotation."""
        request = pending.request
        fleet, decode_pool, prefill_pool = self._pools(pending, workers)
        if request.adapter:
            for pool in (decode_pool, prefill_pool):
                if pool is not None:
                    pool.overlay = self.adapters
        decode_only = bool(request.prefill_done_on_worker_id)
        local_only = request.local_prefill_only
        pairing = Pairing.of(request, workers, fleet.kv_fingerprints.get(request.model, frozenset()))
        unpaired = False
        if decode_pool is None:
            decode = None
        elif decode_only:
            decode = self.policy.choose_in(pairing.decode_for(request.prefill_done_on_worker_id), decode_pool)
        elif local_only:
            decode = self.policy.choose_in(request, decode_pool)
        else:
            # A decode worker with a prefill worker of its KV fingerprint first; else one without, which
            # computes the prompt itself (a rollout's unpaired side: see tandem.router.pairing).
            decode = self.policy.choose_in(pairing.paired_decode(workers), decode_pool)
            if decode is None and pairing.has_unpaired_decode(workers):
                decode = self.policy.choose_in(request, decode_pool)
                unpaired = decode is not None
        if decode is None:
            # Would prefill take it? If not, it waits for both pools (and both must grow for it to go).
            also = (
                (ROLE_PREFILL,)
                if self.for_prefill(pending)
                and num_candidates(request, workers, ROLE_PREFILL)
                and (prefill_pool is None or self.policy.choose_in(request, prefill_pool) is None)
                else ()
            )
            _no_worker(request, workers, ROLE_DECODE, also_lacking=also)
        num_tokens = request.num_tokens
        assert decode_pool is not None
        num_decode_cached = int(decode_pool.cached_tokens[decode.position])
        # A request that does not say how long its prompt is is not known to be short.
        local = local_only or unpaired or (
            not decode_only
            and num_tokens > 0
            and num_tokens - num_decode_cached < self._min_uncached_tokens_to_disaggregate
        )
        prefill: ScoredWorker | None = None
        prefill_worker: WorkerRecord | None = None
        burst: BurstCost | None = None
        if decode_only:
            # The prefill ran already (a dead decode worker's replacement): its worker holds the KV and
            # is named back; nothing more is computed there, so no prefill budget is booked.
            prefill_worker = next(
                (w for w in workers if w.worker_id == request.prefill_done_on_worker_id), None
            ) or WorkerRecord(request.prefill_done_on_worker_id, ROLE_PREFILL, request.model, "")
        elif not local:
            paired = pairing.prefill_for(decode.worker)
            prefill = None if prefill_pool is None else self.policy.choose_in(paired, prefill_pool)
            burst = self._burst(paired, prefill_pool, prefill, decode_pool, decode, num_tokens - num_decode_cached)
            if burst is not None and burst.local:
                local, prefill = True, None
            elif prefill is None:
                _no_worker(request, workers, ROLE_PREFILL)
            else:
                burst = None
                assert prefill_pool is not None
                num_prefill_cached = int(prefill_pool.cached_tokens[prefill.position])
                if self._recomputes_too_much(num_tokens, num_decode_cached, num_prefill_cached):
                    local, prefill = True, None
                else:
                    prefill_worker = prefill.worker
        tokens = {decode.worker.worker_id: num_tokens + request.max_tokens}
        num_cached = 0
        num_uncached = 0
        if prefill is not None:
            assert prefill_pool is not None
            num_cached = int(prefill_pool.cached_tokens[prefill.position])
            num_uncached = tokens[prefill.worker.worker_id] = max(0, num_tokens - num_cached)
        elif local:
            num_uncached = max(0, num_tokens - num_decode_cached)
        return Choice(
            request, prefill, decode, prefill_worker, local, num_cached, num_decode_cached, num_uncached, tokens,
            unpaired=unpaired, burst=burst if local else None,
        )

    def _pools(
        self, pending: PendingRequest, workers: Sequence[WorkerRecord]
    ) -> tuple[FleetTable, PoolArrays | None, PoolArrays | None]:
        """The fleet, and the decode and the prefill pool of ``pending``'s model as a decision sees them
        now; sets its uncached-token estimate (``pending.num_uncached_tokens``: the prompt less the most
        any worker of either pool holds)."""
        request = pending.request
        fleet = self._intake.fleet_for(workers)
        cached = self._lookup(pending, fleet)
        now_s = self._reservations.now_s()
        decode_pool = fleet.arrays(ROLE_DECODE, request.model, cached, now_s)
        prefill_pool = fleet.arrays(ROLE_PREFILL, request.model, cached, now_s, self._index)
        num_most_cached = max(
            (float(p.cached_tokens.max()) for p in (decode_pool, prefill_pool) if p is not None and len(p)),
            default=0.0,
        )
        pending.num_uncached_tokens = max(0, request.num_tokens - int(num_most_cached))
        return fleet, decode_pool, prefill_pool

    def estimate_uncached(self, pending: PendingRequest, workers: Sequence[WorkerRecord]) -> None:
        """Set ``pending``'s uncached-token estimate as :meth:`decide` would, deciding nothing: for a
        request that goes into the queue behind others untried. One lookup in the KV index and one
        budget computation per request that arrives at a queue (about what one try of the queue costs),
        so that a prompt mostly in some worker's cache is not counted whole, in the queue's gauge or in
        the prefill pool's arrivals."""
        self._pools(pending, workers)

    def for_prefill(self, pending: PendingRequest) -> bool:
        """Whether the prefill pool would compute ``pending``, as far as is known before a decode worker
        is chosen: neither decode-only (its prefill ran already) nor local-only, and at least the
        disaggregation threshold of its prompt uncached by the last estimate. A decode worker holding
        more of the prompt than any other, or a burst, may still run it alone (:meth:`decide`)."""
        request = pending.request
        return (
            not request.prefill_done_on_worker_id
            and not request.local_prefill_only
            and pending.num_uncached_estimate >= self._min_uncached_tokens_to_disaggregate
        )

    def arrived(self, pending: PendingRequest) -> None:
        """Count ``pending`` into the prefill pool's demand (``tandem_router_prefill_arrived_uncached_tokens``)
        if it is headed there (:meth:`for_prefill`). The scheduler calls this once per Schedule, at its
        first admission attempt, whether it was placed at once or went into the queue (where it may be
        placed later, here or by another replica, or time out: it was demand all the same); never on a
        try from the queue. Not for a request refused at once (no worker of a pool: the pool's pending
        demand counts those). Placed counts only what the pool computed, at most its capacity; the
        autoscaler's ``token_rate`` needs what arrived, which a saturated pool's placements cannot
        show. A burst (a long prompt run on its decode worker because the prefill worker was backed
        up) counts: the prefill pool was short of it."""
        if self.for_prefill(pending) and pending.num_uncached_estimate > 0:
            self._metrics.count_prefill_arrival(pending.num_uncached_estimate, model=pending.request.model)

    def _burst(
        self,
        paired: ScheduleRequest,
        prefill_pool: PoolArrays | None,
        prefill: ScoredWorker | None,
        decode_pool: PoolArrays,
        decode: ScoredWorker,
        num_decode_uncached: int,
    ) -> BurstCost | None:
        """:mod:`tandem.router.burst`'s formula for handing the request to ``prefill`` (None: no prefill
        worker has budget left; then the least loaded usable one is what it would wait for) against its
        decode worker computing it now; None when bursts are off, the prompt's length is not known, or no
        prefill worker could take it at all."""
        if self._burst_stall_weight is None or paired.num_tokens <= 0 or prefill_pool is None or not len(prefill_pool):
            return None
        if prefill is not None:
            wait = float(prefill_pool.load_tokens[prefill.position])
        else:
            usable = _usable(paired, prefill_pool)
            if not usable.any():
                return None
            wait = float(prefill_pool.load_tokens[usable].min())
        return burst_cost(
            wait_tokens=wait,
            ahead_on_decode=self._bursts.ahead_on(decode.worker.worker_id),
            num_decode_streams=float(decode_pool.num_in_flight[decode.position]),
            uncached_on_decode=num_decode_uncached,
            stall_weight=self._burst_stall_weight,
        )

    def _recomputes_too_much(self, num_tokens: int, num_decode_cached: int, num_prefill_cached: int) -> bool:
        """The handoff would make the prefill worker compute what the decode worker holds already: more of
        the prompt than the decode worker would compute itself, by the threshold or more (a chain's turn
        whose previous turn was finished on the decode worker alone: the prefill worker's copy of the prefix
        is a turn or more behind). The threshold is the handoff's price in prompt tokens
        (``make bench-local-prefill``); tokens the prefill worker computes again add to it, so the decode
        worker prefills alone while its own uncached tokens are below both. With a threshold of 0 (always
        hand off), or for a request that does not say how long its prompt is, never."""
        threshold = self._min_uncached_tokens_to_disaggregate
        num_decode_uncached = num_tokens - num_decode_cached
        num_recomputed = max(0, num_decode_cached - num_prefill_cached)
        return threshold > 0 and num_tokens > 0 and num_decode_uncached < threshold + num_recomputed

    def commit(self, choice: Choice) -> PlacementDecision:
        """Reserve ``choice`` and tell everyone who counts it."""
        request = choice.request
        chosen = [choice.decode] if choice.prefill is None else [choice.prefill, choice.decode]
        for scored in chosen:
            self._gauges.note_role(scored.worker)
            self.adapters.placed(scored.worker.worker_id, request.adapter)
        reservation = self._reservations.reserve(
            request.request_id, tuple(s.worker.worker_id for s in chosen), choice.tokens, tenant=request.tenant
        )
        # Service in the fair share: what this placement makes a worker compute.
        self._shares.add(request.tenant, choice.num_uncached_tokens)
        if self._ledger is not None:
            self._ledger.reserved(reservation, choice.num_uncached_tokens)
        self._gauges.publish(reservation)
        self._metrics.count_placement(local_prefill=choice.local, model=request.model)
        if choice.prefill is not None and choice.num_uncached_tokens > 0:
            self._metrics.count_prefill_tokens(choice.num_uncached_tokens, model=request.model)
        if choice.unpaired:
            self._metrics.count_unpaired(model=request.model)
        if choice.burst is not None:
            self._bursts.placed(request.request_id, choice.decode.worker.worker_id, choice.num_uncached_tokens)
            self._metrics.count_burst(model=request.model)
        return self.decision(choice)

    def decision(self, choice: Choice) -> PlacementDecision:
        return PlacementDecision(
            request_id=choice.request.request_id,
            prefill=choice.prefill_worker,
            decode=choice.decode.worker,
            lease_s=self._reservations.lease_s,
            num_cached_tokens=choice.num_cached_tokens,
            reason=self._reason(choice),
            num_decode_cached_tokens=choice.num_decode_cached_tokens,
        )

    def _lookup(self, pending: PendingRequest, fleet: FleetTable) -> CachedPrefix | None:
        """How much of the prompt each worker holds, from the KV index: one lookup per hashing
        configuration of the model's workers (None: nothing to look up)."""
        request = pending.request
        if not (request.prompt_block_hashes or request.prompt_token_ids) or not self._index.num_workers:
            return None
        fleet.sync_index_slots(self._index)
        by_config: dict[tuple[int, str], npt.NDArray[np.int64]] = {}
        for group in fleet.hash_groups.get(request.model, ()):
            key = group.config
            if key not in pending.hashes:
                if request.prompt_block_hashes:
                    # The gateway's hashes (it sends no token ids); a configuration it did not know is cold.
                    pending.hashes[key] = list(request.prompt_block_hashes.get(key, ()))
                else:
                    hasher = self._hashers.get(key)
                    if hasher is None:
                        hasher = self._hashers[key] = BlockHasher(*key)
                    pending.hashes[key] = hasher.block_hashes(request.prompt_token_ids, cache_salt=request.cache_salt)
            by_config[key] = self._index.match_by_slot(pending.hashes[key])
        return CachedPrefix(by_config, request.num_tokens)

    def _reason(self, choice: Choice) -> str:
        prefill, decode = choice.prefill, choice.decode
        decode_part = (
            f"decode={decode.worker.worker_id}:{decode.score:.3f} decode_cached={choice.num_decode_cached_tokens}"
        )
        if prefill is None and choice.prefill_worker is not None:
            return f"{self.policy.name} decode_only prefill_done_on={choice.prefill_worker.worker_id} {decode_part}"
        if prefill is None and choice.burst is not None:
            burst = choice.burst
            return (
                f"{self.policy.name} local_prefill burst wait={burst.wait_tokens} extra={burst.extra_tokens} "
                f"{decode_part}"
            )
        if prefill is None:
            unpaired = " unpaired" if choice.unpaired else ""
            return f"{self.policy.name} local_prefill{unpaired} {decode_part}"
        return (
            f"{self.policy.name} prefill={prefill.worker.worker_id}:{prefill.score:.3f} "
            f"{decode_part} cached={choice.num_cached_tokens}"
        )


def _usable(request: ScheduleRequest, pool: PoolArrays) -> npt.NDArray[np.bool_]:
    """Workers of ``pool`` that could take ``request`` given budget (not excluded; LoRA for an adapter)."""
    usable = np.ones(len(pool), np.bool_)
    for worker_id in request.exclude_worker_ids:
        position = pool.position(worker_id)
        if position is not None:
            usable[position] = False
    if request.adapter:
        usable &= pool.adapter_columns(request.adapter).capable
    return usable


def num_candidates(request: ScheduleRequest, workers: Sequence[WorkerRecord], role: str) -> int:
    """Workers of ``role`` that could take ``request`` given budget: its model, not excluded, and LoRA
    on for an adapter request."""
    return sum(
        1
        for w in workers
        if w.role == role
        and w.model == request.model
        and w.worker_id not in request.exclude_worker_ids
        and (not request.adapter or w.max_adapters > 0)
    )


def check_request(request: ScheduleRequest) -> None:
    """Raise InvalidRequestError for a Schedule request no worker list could make valid."""
    if not request.request_id:
        raise InvalidRequestError("request_id is required", param="request_id", code="invalid_request")
    if not request.model:
        raise InvalidRequestError("model is required", param="model", code="invalid_request")
    if request.local_prefill_only and request.prefill_done_on_worker_id:
        raise InvalidRequestError(
            "local_prefill_only and prefill_done_on_worker_id exclude each other",
            param="local_prefill_only",
            code="invalid_request",
        )


def check_servable(request: ScheduleRequest, workers: Sequence[WorkerRecord]) -> None:
    """Raise the error naming what is missing when no worker of some role could ever take ``request``."""
    for role in (ROLE_PREFILL, ROLE_DECODE):
        if not num_candidates(request, workers, role):
            raise no_worker_error(request, workers, role)


def _no_worker(
    request: ScheduleRequest, workers: Sequence[WorkerRecord], role: str, also_lacking: tuple[str, ...] = ()
) -> NoReturn:
    """Raise for a role without a worker to take the request: wait for budget (NoBudget, with any
    other role found short too) when some exist, else the error that names what is missing."""
    if num_candidates(request, workers, role):
        raise NoBudget((role, *also_lacking))
    raise no_worker_error(request, workers, role)


def no_worker_error(request: ScheduleRequest, workers: Sequence[WorkerRecord], role: str) -> TandemError:
    served_models = sorted({w.model for w in workers})
    if served_models and request.model not in served_models:
        return InvalidRequestError(
            f"model {request.model!r} is not served here; served models: {', '.join(served_models)}",
            param="model",
            code="model_not_found",
        )
    num_of_role = sum(1 for w in workers if w.role == role and w.model == request.model)
    num_excluded = sum(
        1 for w in workers if w.role == role and w.model == request.model and w.worker_id in request.exclude_worker_ids
    )
    if not num_of_role:
        return PoolAtZeroError(f"no {role} worker registered for model {request.model!r}", role=role)
    if request.adapter:
        num_lora = sum(1 for w in workers if w.role == role and w.model == request.model and w.max_adapters > 0)
        return NoCapacityError(
            f"no {role} worker with LoRA adapters available for model {request.model!r} "
            f"({num_of_role} registered, {num_lora} with adapter slots, {num_excluded} excluded by the caller)",
            retry_after_s=NO_CAPACITY_RETRY_AFTER_S,
        )
    return NoCapacityError(
        f"no {role} worker available for model {request.model!r} "
        f"({num_of_role} registered, {num_excluded} excluded by the caller)",
        retry_after_s=NO_CAPACITY_RETRY_AFTER_S,
    )
