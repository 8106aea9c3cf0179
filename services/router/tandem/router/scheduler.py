"""Schedule and Release, without Ray or gRPC.

:class:`tandem.router.deployment.RouterDeployment` calls :meth:`Scheduler.schedule`
and :meth:`Scheduler.release_anywhere` for each RPC, and :meth:`Scheduler.tick`
/ :meth:`Scheduler.sync_replicas` from its upkeep loops. Schedule:

1. reads the cached worker list (:mod:`tandem.router.worker_view`) and keeps
   the KV-event subscriptions in step with it (:mod:`tandem.router.kv_subscriber`);
2. hashes the prompt's blocks per engine configuration
   (:class:`tandem.common.block_hash.BlockHasher`) and looks up each worker's
   cached prefix in the :class:`tandem.router.kv_index.KVIndex`;
3. asks the policy (:mod:`tandem.router.policy`) for a decode worker within
   budget (:mod:`tandem.router.budget`); when fewer than
   ``min_uncached_tokens_to_disaggregate`` prompt tokens are missing from that
   worker's prefix cache, the decode worker prefills the prompt itself (a
   *local prefill*: no handoff, and the short request does not queue behind
   long prefills); otherwise the policy also picks a prefill worker. The
   chosen workers and their budget tokens are recorded as a lease
   (:mod:`tandem.router.reservations`);
4. when no worker of some role has budget, waits in the admission queue
   (:mod:`tandem.router.admission`) until budget frees up or the queue
   timeout passes (then NoCapacityError with a Retry-After). With several
   replicas the queue is the router's: the replica where budget frees places
   the best-ranked waiter of any replica there and then, and hands the
   placement to the waiter's replica (:mod:`tandem.router.ledger`, hand-offs).

Errors are tandem.common.errors; the deployment maps them to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import numpy as np
import numpy.typing as npt

from tandem.common.block_hash import BlockHasher
from tandem.common.errors import InvalidRequestError, NoCapacityError, TandemError
from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router.admission import AdmissionQueue, QueueFullError, Waiter
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.fair_share import TenantShares
from tandem.router.fleet import CachedPrefix, FleetTable
from tandem.router.handoff import _decode_handoff, _decode_pending, _encode_handoff, _encode_pending
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.ledger import HandOff, Ledger, RemoteWaiter
from tandem.router.metrics import NullRouterMetrics, RouterMetrics
from tandem.router.placement import PendingRequest, PlacementDecision
from tandem.router.policy import RoutingPolicy, ScheduleRequest, ScoredWorker
from tandem.router.reservations import Reservation, ReservationTable

logger = logging.getLogger(__name__)

#: How long a caller told "no capacity" should wait before trying again.
NO_CAPACITY_RETRY_AFTER_S = 1.0
#: From this many workers, a newer registry list in which only the workers' loads changed is taken
#: in the background, ``UPDATE_SLICE_S`` at a time between other work; smaller fleets take it at once.
#: Measured (2026-12-05, the fleet benchmark, 1,000 SIMULATED workers): taking the ~500 records a
#: refresh brings in one go held the Schedule that found them for 0.38 ms on average, up to 2.5 ms,
#: and every Schedule queued behind it.
SLICED_UPDATE_MIN_WORKERS = 256
UPDATE_SLICE_S = 0.0002
_UPDATE_CHUNK = 32


class WorkerView(Protocol):
    async def workers(self) -> list[WorkerRecord]: ...


class FreshWorkerView(WorkerView, Protocol):
    """A view that can also read the registry now (:class:`tandem.router.worker_view.CachedWorkerView`)."""

    async def workers_now(self, key: str = "") -> list[WorkerRecord]: ...

    def still_unknown(self, key: str) -> None: ...


@dataclass(frozen=True)
class QueueConfig:
    #: Priority classes, highest first.
    priority_classes: tuple[str, ...] = ("high", "normal", "low")
    default_priority: str = "normal"
    #: Tenant → priority class, for callers that do not send one.
    tenant_priorities: Mapping[str, str] = field(default_factory=dict)
    #: How long a request may wait for budget; must stay below the gateway's router timeout.
    timeout_s: float = 5.0
    #: How often a waiting request re-reads the budget (other replicas free budget too).
    poll_interval_s: float = 0.05
    max_depth: int = 10_000
    #: Tenant → weight of its fair share (1 unless listed).
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    #: Half-life of a tenant's service (uncached prompt tokens placed) in the fair-share order.
    fair_share_half_life_s: float = 60.0
    #: Longest a placement made for another replica's waiter holds its budget unanswered (that
    #: replica adopts or refuses it within milliseconds; this covers a lost message or a dead replica).
    handoff_timeout_s: float = 2.0


@dataclass(frozen=True)
class _Choice:
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


@dataclass(frozen=True)
class _Rank:
    """Where a request stands in the fair-share order (its tenant's service is read when compared)."""

    priority_index: int
    tenant: str
    enqueued_at_unix: float


class _NoBudget(Exception):
    """Workers of the role exist, but none has budget left: wait in the queue."""

    def __init__(self, roles: tuple[str, ...]) -> None:
        super().__init__(*roles)
        self.roles = roles


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
        queue: QueueConfig | None = None,
        min_uncached_tokens_to_disaggregate: int = 0,
    ) -> None:
        self._view = view
        #: The same view where it can read the registry on demand (a model missing from its list).
        self._fresh_view: FreshWorkerView | None = (
            view if hasattr(view, "workers_now") and hasattr(view, "still_unknown") else None  # type: ignore[assignment]
        )
        #: Below this many prompt tokens missing from the decode worker's cache, it prefills alone (0: never).
        self._min_uncached_tokens_to_disaggregate = min_uncached_tokens_to_disaggregate
        self._policy = policy
        self._reservations = reservations
        self._metrics: RouterMetrics = metrics or NullRouterMetrics()
        self._budget = budget or BudgetConfig()
        self._index = index if index is not None else (subscriber.index if subscriber else KVIndex())
        self._subscriber = subscriber
        self._ledger = ledger
        self._queue_config = queue or QueueConfig()
        #: Every tenant's recent service in uncached prompt tokens: this replica's placements, plus the
        #: other replicas' through the ledger (which then shares this object).
        self._shares = (
            ledger.shares
            if ledger is not None
            else TenantShares(
                half_life_s=self._queue_config.fair_share_half_life_s, weights=self._queue_config.tenant_weights
            )
        )
        if ledger is not None:
            ledger.on_change = self._on_ledger_change
            ledger.own_table = self._reservations
        #: Placements made here for other replicas' waiters, not adopted or refused yet: request id ->
        #: (the waiter's replica, when).
        self._handed_off: dict[str, tuple[str, float]] = {}
        #: This replica's waiters by request id (a hand-off names one).
        self._waiters_by_id: dict[str, Waiter[PendingRequest]] = {}
        #: Other replicas' waiters decoded for a placement here (a bounded cache: cleared when full).
        self._remote_pending: dict[str, PendingRequest] = {}
        #: Moves whenever budget may have come free here (a release or expiry, a new worker list, a
        #: poll of the queue: time passing ages reservations); see :meth:`_budget_epoch`.
        self._num_frees = 0
        #: The requests found not to fit at one budget epoch: not tried again until it moves (a drain
        #: runs on every ledger message, and most add load, not free it).
        self._misses: tuple[int, set[str]] = (-1, set())
        self._drain_soon: asyncio.Handle | None = None
        self._poller: asyncio.Task[None] | None = None
        self._queue: AdmissionQueue[PendingRequest] = AdmissionQueue(
            priority_classes=self._queue_config.priority_classes,
            default_priority=self._queue_config.default_priority,
            max_depth=self._queue_config.max_depth,
        )
        self._hashers: dict[tuple[int, str], BlockHasher] = {}
        self._last_workers: list[WorkerRecord] | None = None
        #: A newer list being taken in the background (:meth:`_take_in_slices`).
        self._taking: asyncio.Task[None] | None = None
        #: The last worker list as arrays (rebuilt when the list changes).
        self._fleet: FleetTable | None = None
        # Workers whose gauges are non-zero, so tick() can refresh them, and every placed worker's role.
        self._published_worker_ids: set[str] = set()
        self._worker_roles: dict[str, str] = {}
        #: What the queue's head lacked at its last try: everyone behind it waits for the same.
        self._blocked_on: tuple[str, ...] = (ROLE_PREFILL,)

    @property
    def reservations(self) -> ReservationTable:
        return self._reservations

    @property
    def index(self) -> KVIndex:
        return self._index

    @property
    def policy(self) -> RoutingPolicy:
        return self._policy

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def shares(self) -> TenantShares:
        return self._shares

    # -- Schedule ----------------------------------------------------------------

    async def schedule(self, request: ScheduleRequest) -> PlacementDecision:
        """Choose and reserve a (prefill, decode) pair for ``request``.

        Raises InvalidRequestError (bad input, or ``code="model_not_found"``
        when no live worker serves the model) or NoCapacityError (no worker of
        some role, or no budget within the queue timeout).
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

    async def _schedule(self, request: ScheduleRequest) -> PlacementDecision:
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
        self._sweep()
        workers = await self._workers()
        fleet = self._fleet
        if fleet is not None and not fleet.serves(request.model) and self._fresh_view is not None:
            # No worker of this model in the cached list: it may have registered since the last read.
            fresh = await self._fresh_view.workers_now(request.model)
            if fresh is not self._last_workers:
                if self._taking is not None:
                    self._taking.cancel()  # an older list's loads: this one is newer
                    self._taking = None
                workers = self._take(fresh)
            if self._fleet is None or not self._fleet.serves(request.model):
                self._fresh_view.still_unknown(request.model)
        # A repeated Schedule of one request is a retry elsewhere: its earlier
        # pair must not count as load while choosing the new one.
        if not self._released(self._reservations.release(request.request_id)) and self._ledger is not None:
            await self._ledger.forward_release(request.request_id)  # it was placed by another replica
        pending = PendingRequest(request)
        if not self._queue and not self._remote_waiter_ahead_of(request):
            try:
                return self._place(pending, workers)
            except _NoBudget as exc:
                pending.waiting_for = self._blocked_on = exc.roles
        else:
            self._check_servable(request, workers)
        return await self._wait_in_queue(pending)

    async def refresh_workers(self) -> None:
        """Read the registry (through the view's cache) and follow its workers' KV events; returns
        once the list read is the one decisions use."""
        await self._workers()
        if self._taking is not None:
            await asyncio.shield(self._taking)

    async def _workers(self) -> list[WorkerRecord]:
        workers = await self._view.workers()
        if workers is self._last_workers:
            return workers
        if self._taking is not None and not self._taking.done():
            assert self._last_workers is not None
            return self._last_workers  # a newer list is being taken in the background
        fleet = self._fleet
        if (
            fleet is not None
            and self._last_workers is not None
            and len(workers) >= SLICED_UPDATE_MIN_WORKERS
            and len(workers) == len(fleet.workers)
        ):
            self._taking = asyncio.get_running_loop().create_task(self._take_in_slices(workers, fleet))
            return self._last_workers
        return self._take(workers)

    def _take(self, workers: list[WorkerRecord]) -> list[WorkerRecord]:
        """Make ``workers`` the list decisions use, at once."""
        self._last_workers = workers
        self._num_frees += 1  # new reports, maybe new workers
        if self._fleet is not None and self._fleet.update(workers):
            return workers  # only loads changed: the same workers, the same KV-event publishers
        self._fleet = self._build_fleet(workers)
        if self._subscriber is not None:
            self._subscriber.sync(workers)
        else:
            live = {w.worker_id for w in workers}
            for worker_id in self._index.workers():
                if worker_id not in live:
                    self._index.remove_worker(worker_id)
        return workers

    async def _take_in_slices(self, workers: list[WorkerRecord], fleet: FleetTable) -> None:
        """Take a large fleet's newer list a slice at a time (see ``SLICED_UPDATE_MIN_WORKERS``):
        decisions meanwhile use the list they had, its workers' loads updated as they are reached. A
        list whose workers changed, not only their loads, is taken at once."""
        try:
            slice_end_s = time.perf_counter() + UPDATE_SLICE_S
            positions: list[int] = []
            for start in range(0, len(workers), _UPDATE_CHUNK):
                found = fleet.changed_positions(workers, start, start + _UPDATE_CHUNK)
                if found is None:
                    self._take(workers)
                    return
                positions += found
                if time.perf_counter() >= slice_end_s:
                    await asyncio.sleep(0)
                    slice_end_s = time.perf_counter() + UPDATE_SLICE_S
                    if self._fleet is not fleet:
                        return  # replaced meanwhile: the next read starts afresh
            for start in range(0, len(positions), _UPDATE_CHUNK):
                fleet.take_records(workers, positions[start : start + _UPDATE_CHUNK])
                if time.perf_counter() >= slice_end_s:
                    await asyncio.sleep(0)
                    slice_end_s = time.perf_counter() + UPDATE_SLICE_S
                    if self._fleet is not fleet:
                        return
            fleet.workers = workers
            self._last_workers = workers
            self._num_frees += 1
        except Exception:  # the next read tries again; decisions keep the list they have
            logger.exception("taking the registry's newer worker list failed")

    def _build_fleet(self, workers: Sequence[WorkerRecord]) -> FleetTable:
        return FleetTable.build(workers, self._budget, self._reservations, self._ledger)

    def _fleet_for(self, workers: Sequence[WorkerRecord]) -> FleetTable:
        """The fleet table of ``workers``, brought up to date with every reservation change since the
        last decision (this replica's and the other replicas')."""
        fleet = self._fleet
        if fleet is None or fleet.workers is not workers:
            fleet = self._fleet = self._build_fleet(workers)
        fleet.refresh_own(self._reservations.drain_changed(), self._reservations)
        if self._ledger is not None:
            fleet.refresh_others(self._ledger.drain_changed(), self._ledger)
        return fleet

    def place_now(self, request: ScheduleRequest, workers: Sequence[WorkerRecord]) -> PlacementDecision:
        """One placement decision without queueing or I/O (benchmarks, tests); NoCapacityError when no budget."""
        try:
            return self._place(PendingRequest(request), workers)
        except _NoBudget:
            raise NoCapacityError("no worker has budget", retry_after_s=NO_CAPACITY_RETRY_AFTER_S) from None

    def decide(self, request: ScheduleRequest, workers: Sequence[WorkerRecord]) -> PlacementDecision:
        """Where :meth:`place_now` would place ``request`` now, reserving nothing (a dry run: the
        replica-agreement benchmark asks an oracle); NoCapacityError when no budget."""
        try:
            return self._decision(self._decide(PendingRequest(request), workers))
        except _NoBudget:
            raise NoCapacityError("no worker has budget", retry_after_s=NO_CAPACITY_RETRY_AFTER_S) from None

    def _place(self, pending: PendingRequest, workers: Sequence[WorkerRecord]) -> PlacementDecision:
        return self._commit(self._decide(pending, workers))

    def _decide(self, pending: PendingRequest, workers: Sequence[WorkerRecord]) -> _Choice:
        """The placement for ``pending`` (raises _NoBudget or the error naming what is missing); no side
        effects but the policy's own rotation."""
        request = pending.request
        fleet = self._fleet_for(workers)
        cached = self._lookup(pending, fleet)
        now_s = self._reservations.now_s()
        decode_pool = fleet.arrays(ROLE_DECODE, request.model, cached, now_s)
        prefill_pool = fleet.arrays(ROLE_PREFILL, request.model, cached, now_s, self._index)
        num_most_cached = max(
            (float(p.cached_tokens.max()) for p in (decode_pool, prefill_pool) if p is not None and len(p)),
            default=0.0,
        )
        pending.num_uncached_tokens = max(0, request.num_tokens - int(num_most_cached))
        decode = None if decode_pool is None else self._policy.choose_in(request, decode_pool)
        decode_only = bool(request.prefill_done_on_worker_id)
        local_only = request.local_prefill_only
        if decode is None:
            # Would prefill take it? If not, it waits for both pools (and both must grow for it to go).
            also = (
                (ROLE_PREFILL,)
                if not decode_only
                and not local_only
                and pending.num_uncached_tokens >= self._min_uncached_tokens_to_disaggregate
                and self._num_candidates(request, workers, ROLE_PREFILL)
                and (prefill_pool is None or self._policy.choose_in(request, prefill_pool) is None)
                else ()
            )
            self._no_worker(request, workers, ROLE_DECODE, also_lacking=also)
        num_tokens = request.num_tokens
        assert decode_pool is not None
        num_decode_cached = int(decode_pool.cached_tokens[decode.position])
        # A request that does not say how long its prompt is is not known to be short.
        local = local_only or (
            not decode_only
            and num_tokens > 0
            and num_tokens - num_decode_cached < self._min_uncached_tokens_to_disaggregate
        )
        prefill: ScoredWorker | None = None
        prefill_worker: WorkerRecord | None = None
        if decode_only:
            # The prefill ran already (a dead decode worker's replacement): its worker holds the KV and
            # is named back; nothing more is computed there, so no prefill budget is booked.
            prefill_worker = next(
                (w for w in workers if w.worker_id == request.prefill_done_on_worker_id), None
            ) or WorkerRecord(request.prefill_done_on_worker_id, ROLE_PREFILL, request.model, "")
        elif not local:
            prefill = None if prefill_pool is None else self._policy.choose_in(request, prefill_pool)
            if prefill is None:
                self._no_worker(request, workers, ROLE_PREFILL)
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
        return _Choice(
            request, prefill, decode, prefill_worker, local, num_cached, num_decode_cached, num_uncached, tokens
        )

    def _commit(self, choice: _Choice) -> PlacementDecision:
        """Reserve ``choice`` and tell everyone who counts it."""
        request = choice.request
        chosen = [choice.decode] if choice.prefill is None else [choice.prefill, choice.decode]
        for scored in chosen:
            self._worker_roles[scored.worker.worker_id] = scored.worker.role
        reservation = self._reservations.reserve(
            request.request_id, tuple(s.worker.worker_id for s in chosen), choice.tokens, tenant=request.tenant
        )
        # Service in the fair share: what this placement makes a worker compute.
        self._shares.add(request.tenant, choice.num_uncached_tokens)
        if self._ledger is not None:
            self._ledger.reserved(reservation, choice.num_uncached_tokens)
        self._publish(reservation)
        self._metrics.count_placement(local_prefill=choice.local)
        return self._decision(choice)

    def _decision(self, choice: _Choice) -> PlacementDecision:
        return PlacementDecision(
            request_id=choice.request.request_id,
            prefill=choice.prefill_worker,
            decode=choice.decode.worker,
            lease_s=self._reservations.lease_s,
            num_cached_tokens=choice.num_cached_tokens,
            reason=self._reason(
                choice.prefill,
                choice.decode,
                choice.num_cached_tokens,
                choice.num_decode_cached_tokens,
                decode_only_for=choice.prefill_worker,
            ),
            num_decode_cached_tokens=choice.num_decode_cached_tokens,
        )

    def _no_worker(
        self, request: ScheduleRequest, workers: Sequence[WorkerRecord], role: str, also_lacking: tuple[str, ...] = ()
    ) -> NoReturn:
        """Raise for a role without a worker to take the request: wait for budget (_NoBudget, with any
        other role found short too) when some exist, else the error that names what is missing."""
        if self._num_candidates(request, workers, role):
            raise _NoBudget((role, *also_lacking))
        raise self._no_worker_error(request, workers, role)

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

    def _num_candidates(self, request: ScheduleRequest, workers: Sequence[WorkerRecord], role: str) -> int:
        return sum(
            1
            for w in workers
            if w.role == role and w.model == request.model and w.worker_id not in request.exclude_worker_ids
        )

    def _check_servable(self, request: ScheduleRequest, workers: Sequence[WorkerRecord]) -> None:
        for role in (ROLE_PREFILL, ROLE_DECODE):
            if not self._num_candidates(request, workers, role):
                raise self._no_worker_error(request, workers, role)

    # -- the admission queue -------------------------------------------------------

    async def _wait_in_queue(self, pending: PendingRequest) -> PlacementDecision:
        request = pending.request
        cfg = self._queue_config
        priority = request.priority or cfg.tenant_priorities.get(request.tenant, "")
        try:
            waiter = self._queue.push(pending, tenant=request.tenant, priority=priority)
        except QueueFullError as exc:
            raise NoCapacityError(str(exc), retry_after_s=NO_CAPACITY_RETRY_AFTER_S) from None
        self._waiters_by_id[request.request_id] = waiter
        if self._ledger is not None:
            self._ledger.queued(
                request.request_id,
                request.tenant,
                self._queue.priority_index(waiter.priority),
                waiter.enqueued_at_unix,
                _encode_pending(pending, waiter.priority),
            )
        self._metrics.set_queue_depth(waiter.priority, self._queue.depth(waiter.priority))
        started_s = time.monotonic()
        outcome = "timeout"
        try:
            self._drain(self._last_workers or [])
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
                f"no worker had budget for {cfg.timeout_s:g} s ({len(self._queue)} requests waiting)",
                retry_after_s=max(NO_CAPACITY_RETRY_AFTER_S, cfg.timeout_s),
            )
        finally:
            self._dequeue(waiter)
            if self._waiters_by_id.get(request.request_id) is waiter:
                del self._waiters_by_id[request.request_id]
            if not waiter.future.done():
                waiter.future.cancel()
            self._metrics.set_queue_depth(waiter.priority, self._queue.depth(waiter.priority))
            self._metrics.observe_queue_wait(time.monotonic() - started_s, outcome=outcome)

    def _ensure_poller(self) -> None:
        """One task re-tries the queue every ``poll_interval_s`` while it holds anyone (budget also
        frees without an event here: leases expire, worker reports age reservations, the registry
        changes); releases and the ledger's changes drain it at once. One poller, not one per waiter:
        each try is a placement decision, and a waiter each polling made the work grow with the queue."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_while_queued())

    async def _poll_while_queued(self) -> None:
        while self._queue:
            await asyncio.sleep(self._queue_config.poll_interval_s)
            self._num_frees += 1  # time passed: reservations aged, worker reports moved
            try:
                self._sweep()
                self._drain(await self._workers())
            except TandemError as exc:  # the registry is down: the waiters time out on their own
                logger.warning("admission queue poll failed: %s", exc)

    def _dequeue(self, waiter: Waiter[PendingRequest]) -> None:
        if self._queue.remove(waiter) and self._ledger is not None:
            self._ledger.dequeued(waiter.item.request.request_id)

    # -- the fair-share order across replicas ------------------------------------------------------

    def _rank(self, waiter: Waiter[PendingRequest]) -> _Rank:
        return _Rank(self._queue.priority_index(waiter.priority), waiter.tenant, waiter.enqueued_at_unix)

    def _rank_of_new(self, request: ScheduleRequest) -> _Rank:
        priority = self._queue.priority_of(
            request.priority or self._queue_config.tenant_priorities.get(request.tenant, "")
        )
        return _Rank(self._queue.priority_index(priority), request.tenant, time.time())

    def _remote_waiter_ahead_of(self, request: ScheduleRequest) -> bool:
        """Whether another replica's waiter goes before a new ``request`` (no rank is computed when no
        other replica has a waiter: the usual case)."""
        if self._ledger is None or not self._ledger.has_remote_waiters:
            return False
        return self._remote_waiter_ahead(self._rank_of_new(request)) is not None

    def _remote_waiter_ahead(self, rank: _Rank | None, skip: set[str] | None = None) -> RemoteWaiter | None:
        """The best-ranked waiting request of another replica that goes before one of ``rank`` (a
        higher class, or the same class and a tenant served less, or the same service and waiting
        longer; any, when ``rank`` is None), or None. Requests handed off from here already, and those
        in ``skip``, do not count. Each tenant's service is read once per call (it decays as time
        passes: read twice, a tenant would rank before itself)."""
        if self._ledger is None:
            return None
        served: dict[str, float] = {}

        def key(priority_index: int, tenant: str, enqueued_at_unix: float) -> tuple[int, float, float]:
            service = served.get(tenant)
            if service is None:
                service = served[tenant] = self._shares.served(tenant)
            return self._queue.rank(priority_index, service, enqueued_at_unix)

        best_key = (
            key(rank.priority_index, rank.tenant, rank.enqueued_at_unix)
            if rank is not None
            else (float("inf"), float("inf"), float("inf"))
        )
        best: RemoteWaiter | None = None
        handed_off, own, held = self._handed_off, self._waiters_by_id, self._reservations
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

    def _budget_epoch(self) -> int:
        return self._num_frees + (self._ledger.num_frees if self._ledger is not None else 0)

    def _missed_now(self) -> set[str]:
        """The requests that did not fit since budget last came free (a set to add to)."""
        epoch = self._budget_epoch()
        if self._misses[0] != epoch:
            self._misses = (epoch, set())
        return self._misses[1]

    def _drain(self, workers: Sequence[WorkerRecord]) -> None:
        """Admit waiters in the router's priority / fair-share order while the head one fits: this
        replica's own, and other replicas' (placed here and handed off to their replica, see
        :mod:`tandem.router.ledger`). Admitting in the same loop iteration as the release that freed
        the budget puts both in one ledger message: no other replica ever sees that budget free.
        Each request that did not fit is tried again only once budget may have come free."""
        missed = self._missed_now()
        num_remote_misses = 0
        while True:
            waiter: Waiter[PendingRequest] | None = self._queue.next(self._shares.served)
            if waiter is not None and waiter.future.done():
                self._dequeue(waiter)
                continue
            remote = None
            if num_remote_misses < self._MAX_REMOTE_MISSES:
                remote = self._remote_waiter_ahead(None if waiter is None else self._rank(waiter), missed)
            if remote is not None:
                choice = self._decide_remote(remote, workers)
                if choice is None:
                    # It does not fit now, or cannot be placed here: its own replica's queue holds it
                    # (and blocks what would pass it there), this one goes on.
                    missed.add(remote.request_id)
                    num_remote_misses += 1
                else:
                    self._hand_off(remote, choice)
                continue
            if waiter is None or waiter.item.request.request_id in missed:
                return
            try:
                choice = self._decide(waiter.item, workers)
            except _NoBudget as exc:
                waiter.item.waiting_for = self._blocked_on = exc.roles
                missed.add(waiter.item.request.request_id)
                return
            except TandemError as exc:
                self._dequeue(waiter)
                waiter.future.set_exception(exc)
                continue
            self._dequeue(waiter)
            waiter.future.set_result(self._commit(choice))

    _MAX_REMOTE_PENDING = 10_000

    #: Other replicas' waiters a drain tries and finds no budget for (or cannot place here) before it
    #: turns to this replica's own head alone: each try is a placement decision.
    _MAX_REMOTE_MISSES = 4

    def _decide_remote(self, remote: RemoteWaiter, workers: Sequence[WorkerRecord]) -> _Choice | None:
        """A placement here for another replica's waiter; None when it does not fit now, or cannot be
        placed here at all (no payload: an older replica; a model or worker this replica does not
        know): its own replica's queue still holds it."""
        pending = self._remote_pending.get(remote.request_id)
        if pending is None:
            pending = _decode_pending(remote)
            if pending is None:
                return None
            if len(self._remote_pending) >= self._MAX_REMOTE_PENDING:
                self._remote_pending.clear()
            self._remote_pending[remote.request_id] = pending
        try:
            return self._decide(pending, workers)
        except (_NoBudget, TandemError):
            return None

    def _hand_off(self, remote: RemoteWaiter, choice: _Choice) -> None:
        """Reserve ``choice`` for another replica's waiter here and publish it to that replica."""
        assert self._ledger is not None
        self._remote_pending.pop(remote.request_id, None)
        decision = self._commit(choice)
        reservation = self._reservations.get(remote.request_id)
        assert reservation is not None
        self._handed_off[remote.request_id] = (remote.replica_id, time.monotonic())
        self._ledger.handed_off(remote.replica_id, remote.request_id, _encode_handoff(decision, reservation))
        self._metrics.count_handoff("placed")

    def _adopt(self, handoff: HandOff) -> None:
        """Another replica placed one of this replica's waiters: hold the placement here (and the
        placer's copy goes, in the same message), or refuse it when the request no longer waits."""
        assert self._ledger is not None
        waiter = self._waiters_by_id.get(handoff.request_id)
        if waiter is None or waiter.future.done():
            self._ledger.forward_release_to(handoff.placer_id, handoff.request_id)
            self._metrics.count_handoff("refused")
            return
        try:
            decision, worker_ids, tokens, tenant, age_s = _decode_handoff(handoff, self._last_workers or ())
        except (TypeError, ValueError):
            logger.warning("undecodable hand-off of %s from %s: refused", handoff.request_id, handoff.placer_id)
            self._ledger.forward_release_to(handoff.placer_id, handoff.request_id)
            self._metrics.count_handoff("refused")
            return
        reservation = self._reservations.reserve(
            handoff.request_id, worker_ids, tokens, tenant=tenant, reserved_at_s=self._reservations.now_s() - age_s
        )
        for worker in (decision.prefill, decision.decode):
            if worker is not None and worker.worker_id in reservation.worker_ids:
                self._worker_roles[worker.worker_id] = worker.role
        # The tenant's service was counted once, by the placer's reservation: 0 here.
        self._ledger.reserved(reservation, 0)
        self._ledger.forward_release_to(handoff.placer_id, handoff.request_id)
        self._publish(reservation)
        self._dequeue(waiter)
        waiter.future.set_result(decision)
        self._metrics.count_handoff("adopted")

    def _expire_handoffs(self) -> None:
        """Release placements handed off and never answered (a lost message, a replica gone)."""
        if not self._handed_off:
            return
        horizon_s = time.monotonic() - self._queue_config.handoff_timeout_s
        for request_id, (_, at_s) in list(self._handed_off.items()):
            if at_s <= horizon_s:
                del self._handed_off[request_id]
                if self._released(self._reservations.release(request_id)):
                    self._metrics.count_handoff("expired")

    def _on_ledger_change(self) -> None:
        """Another replica freed budget, forwarded a Release or changed its queue: drain soon (not
        inside the ledger's receive)."""
        if self._drain_soon is None:
            self._drain_soon = asyncio.get_running_loop().call_soon(self._drain_now)

    def _drain_now(self) -> None:
        self._drain_soon = None
        if self._ledger is not None:
            for request_id in self._ledger.take_forwarded():
                self._handed_off.pop(request_id, None)
                self._released(self._reservations.release(request_id))
            for handoff in self._ledger.take_handoffs():
                self._adopt(handoff)
        if self._anyone_waiting() and self._last_workers is not None:
            self._drain(self._last_workers)

    def _anyone_waiting(self) -> bool:
        """This replica's queue, or another replica's that this one may place for, holds a request."""
        if self._queue:
            return True
        return self._ledger is not None and any(
            r.request_id not in self._handed_off for r in self._ledger.remote_waiters()
        )

    # -- Release and upkeep ------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Drop ``request_id``'s reservation held here; False when there was none (idempotent)."""
        self._sweep()
        reservation = self._reservations.release(request_id)
        self._released(reservation)
        if reservation is not None and self._last_workers is not None and self._anyone_waiting():
            self._drain(self._last_workers)
        return reservation is not None

    async def release_anywhere(self, request_id: str) -> bool:
        """Release here, or forward to the replica that holds the reservation."""
        if self.release(request_id):
            return True
        if self._ledger is not None:
            return await self._ledger.forward_release(request_id)
        return False

    def tick(self) -> None:
        """Periodic upkeep, called by the deployment every few seconds: drop
        expired leases even without traffic, and set every gauge again (Ray
        forgets a gauge that is not set for a couple of export intervals; the
        autoscaler must see a quiet pool's zeros)."""
        self._sweep()
        self._shares.forget_idle()
        # Every known worker's gauges, zeros included: a pool at rest must read 0, not "no data".
        for worker in self._last_workers or ():
            self._worker_roles.setdefault(worker.worker_id, worker.role)
            self._published_worker_ids.add(worker.worker_id)
        for worker_id in list(self._published_worker_ids):
            self._set_gauges(worker_id)
        live = {w.worker_id for w in self._last_workers or ()} | self._published_worker_ids
        for worker_id in [w for w in self._worker_roles if w not in live]:
            del self._worker_roles[worker_id]  # a worker gone for good (a pod replaced has a new id)
        for priority in self._queue.priority_classes:
            self._metrics.set_queue_depth(priority, self._queue.depth(priority))
        self._publish_queue()
        self._publish_pools()

    def pools(self) -> dict[str, tuple[float, int]]:
        """Per role, the average budget fraction in use over its registered workers (every replica's
        reservations, as :meth:`BudgetView.fits` counts them) and the requests this replica placed on it."""
        workers = self._last_workers or ()
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

    def _publish_pools(self) -> None:
        for role, (used_fraction, num_in_flight) in self.pools().items():
            self._metrics.set_pool(role, used_fraction, num_in_flight)

    async def sync_replicas(self) -> None:
        """Apply the Releases other replicas forwarded here, and retry the queue (budget may have come
        free elsewhere). The ledger shares everything else as it happens."""
        self._drain_now()

    def _sweep(self) -> None:
        for reservation in self._reservations.sweep():
            self._released(reservation)
        self._expire_handoffs()

    def _released(self, reservation: Reservation | None) -> bool:
        """A reservation of this replica ended (released, expired or replaced): gauges and the ledger."""
        if reservation is None:
            return False
        self._num_frees += 1
        # A placement handed off and then released here (a retry of its request placed here afresh,
        # its Release) is no longer the hand-off's: the timeout must not release what replaced it.
        self._handed_off.pop(reservation.request_id, None)
        self._publish(reservation)
        if self._ledger is not None:
            self._ledger.released(reservation)
        return True

    def _publish(self, reservation: Reservation | None) -> None:
        if reservation is not None:
            for worker_id in set(reservation.worker_ids):
                self._set_gauges(worker_id)

    def queued(self) -> dict[str, tuple[int, int]]:
        """Per role, (requests, prompt tokens no worker holds) waiting for that role's budget. A
        request not tried yet waits behind the head, for what the head lacks; a request that both
        pools lack budget for counts in both."""
        queued = {ROLE_PREFILL: [0, 0], ROLE_DECODE: [0, 0]}
        for waiter in self._queue.waiters():
            pending = waiter.item
            for role in pending.waiting_for or self._blocked_on:
                counts = queued[role]
                counts[0] += 1
                counts[1] += (
                    pending.num_uncached_tokens if pending.num_uncached_tokens >= 0 else pending.request.num_tokens
                )
        return {role: (n, tokens) for role, (n, tokens) in queued.items()}

    def _publish_queue(self) -> None:
        """Set the queue's per-role gauges (from :meth:`tick`: one pass over the queue, not one per request)."""
        for role, (num_requests, num_tokens) in self.queued().items():
            self._metrics.set_queued(role, num_requests, num_tokens)

    def _set_gauges(self, worker_id: str) -> None:
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

    def _reason(
        self,
        prefill: ScoredWorker | None,
        decode: ScoredWorker,
        num_cached_tokens: int,
        num_decode_cached: int,
        *,
        decode_only_for: WorkerRecord | None = None,
    ) -> str:
        decode_part = f"decode={decode.worker.worker_id}:{decode.score:.3f} decode_cached={num_decode_cached}"
        if prefill is None and decode_only_for is not None:
            return f"{self._policy.name} decode_only prefill_done_on={decode_only_for.worker_id} {decode_part}"
        if prefill is None:
            return f"{self._policy.name} local_prefill {decode_part}"
        return (
            f"{self._policy.name} prefill={prefill.worker.worker_id}:{prefill.score:.3f} "
            f"{decode_part} cached={num_cached_tokens}"
        )

    @staticmethod
    def _no_worker_error(request: ScheduleRequest, workers: Sequence[WorkerRecord], role: str) -> TandemError:
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
