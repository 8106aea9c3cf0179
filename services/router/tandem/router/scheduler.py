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
   timeout passes (then NoCapacityError with a Retry-After).

Errors are tandem.common.errors; the deployment maps them to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

from tandem.common.block_hash import HASH_ALGO_SHA256, BlockHasher
from tandem.common.errors import InvalidRequestError, NoCapacityError, TandemError
from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router.admission import AdmissionQueue, QueueFullError, Waiter
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.metrics import NullRouterMetrics, RouterMetrics
from tandem.router.policy import RoutingPolicy, ScheduleRequest, ScoredWorker
from tandem.router.replica_sync import ReplicaSync
from tandem.router.reservations import Reservation, ReservationTable

#: How long a caller told "no capacity" should wait before trying again.
NO_CAPACITY_RETRY_AFTER_S = 1.0


class WorkerView(Protocol):
    async def workers(self) -> list[WorkerRecord]: ...


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


@dataclass
class _Pending:
    """A request being placed, with its block hashes per engine configuration (computed once)."""

    request: ScheduleRequest
    hashes: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    #: The roles whose budget it lacked at its last try (empty if not tried yet; both when both pools
    #: are full: each must grow before it can go), and its prompt tokens that no worker holds (the
    #: whole prompt until the KV index was asked).
    waiting_for: tuple[str, ...] = ()
    num_uncached_tokens: int = -1


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
        replica_sync: ReplicaSync | None = None,
        queue: QueueConfig | None = None,
        min_uncached_tokens_to_disaggregate: int = 0,
    ) -> None:
        self._view = view
        #: Below this many prompt tokens missing from the decode worker's cache, it prefills alone (0: never).
        self._min_uncached_tokens_to_disaggregate = min_uncached_tokens_to_disaggregate
        self._policy = policy
        self._reservations = reservations
        self._metrics: RouterMetrics = metrics or NullRouterMetrics()
        self._budget = budget or BudgetConfig()
        self._index = index if index is not None else (subscriber.index if subscriber else KVIndex())
        self._subscriber = subscriber
        self._replica_sync = replica_sync
        self._queue_config = queue or QueueConfig()
        self._queue: AdmissionQueue[_Pending] = AdmissionQueue(
            priority_classes=self._queue_config.priority_classes,
            default_priority=self._queue_config.default_priority,
            max_depth=self._queue_config.max_depth,
        )
        self._hashers: dict[tuple[int, str], BlockHasher] = {}
        self._last_workers: list[WorkerRecord] | None = None
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
        self._sweep()
        workers = await self._workers()
        # A repeated Schedule of one request is a retry elsewhere: its earlier
        # pair must not count as load while choosing the new one.
        self._publish(self._reservations.release(request.request_id))
        pending = _Pending(request)
        if not self._queue:
            try:
                return self._place(pending, workers)
            except _NoBudget as exc:
                pending.waiting_for = self._blocked_on = exc.roles
        else:
            self._check_servable(request, workers)
        return await self._wait_in_queue(pending)

    async def refresh_workers(self) -> None:
        """Read the registry (through the view's cache) and follow its workers' KV events."""
        await self._workers()

    async def _workers(self) -> list[WorkerRecord]:
        workers = await self._view.workers()
        if workers is not self._last_workers:
            self._last_workers = workers
            if self._subscriber is not None:
                self._subscriber.sync(workers)
            else:
                live = {w.worker_id for w in workers}
                for worker_id in self._index.workers():
                    if worker_id not in live:
                        self._index.remove_worker(worker_id)
        return workers

    def place_now(self, request: ScheduleRequest, workers: Sequence[WorkerRecord]) -> PlacementDecision:
        """One placement decision without queueing or I/O (benchmarks, tests); NoCapacityError when no budget."""
        try:
            return self._place(_Pending(request), workers)
        except _NoBudget:
            raise NoCapacityError("no worker has budget", retry_after_s=NO_CAPACITY_RETRY_AFTER_S) from None

    def _place(self, pending: _Pending, workers: Sequence[WorkerRecord]) -> PlacementDecision:
        request = pending.request
        cached = self._cached_tokens(pending, workers)
        pending.num_uncached_tokens = max(0, request.num_tokens - max(cached.values(), default=0))
        view = BudgetView(
            self._reservations,
            self._budget,
            self._replica_sync,
            cached_tokens=cached,
            num_indexed_blocks=self._index.num_blocks,
        )
        decode = self._policy.choose(request, ROLE_DECODE, workers, view)
        if decode is None:
            # Would prefill take it? If not, it waits for both pools (and both must grow for it to go).
            also = (
                (ROLE_PREFILL,)
                if pending.num_uncached_tokens >= self._min_uncached_tokens_to_disaggregate
                and self._num_candidates(request, workers, ROLE_PREFILL)
                and self._policy.choose(request, ROLE_PREFILL, workers, view) is None
                else ()
            )
            self._no_worker(request, workers, ROLE_DECODE, also_lacking=also)
        num_tokens = request.num_tokens
        num_decode_cached = cached.get(decode.worker.worker_id, 0)
        # A request that does not say how long its prompt is is not known to be short.
        local = num_tokens > 0 and num_tokens - num_decode_cached < self._min_uncached_tokens_to_disaggregate
        prefill = None if local else self._policy.choose(request, ROLE_PREFILL, workers, view)
        if prefill is None and not local:
            self._no_worker(request, workers, ROLE_PREFILL)
        chosen = [decode] if prefill is None else [prefill, decode]
        for scored in chosen:
            self._worker_roles[scored.worker.worker_id] = scored.worker.role
        tokens = {s.worker.worker_id: view.need_tokens(s.worker, num_tokens, request.max_tokens) for s in chosen}
        reservation = self._reservations.reserve(
            request.request_id, tuple(s.worker.worker_id for s in chosen), tokens, tenant=request.tenant
        )
        if self._replica_sync is not None:
            self._replica_sync.placed(request.request_id)
        self._publish(reservation)
        self._metrics.count_placement(local_prefill=local)
        num_cached = 0 if prefill is None else cached.get(prefill.worker.worker_id, 0)
        return PlacementDecision(
            request_id=request.request_id,
            prefill=None if prefill is None else prefill.worker,
            decode=decode.worker,
            lease_s=self._reservations.lease_s,
            num_cached_tokens=num_cached,
            reason=self._reason(prefill, decode, num_cached, num_decode_cached),
            num_decode_cached_tokens=num_decode_cached,
        )

    def _no_worker(
        self, request: ScheduleRequest, workers: Sequence[WorkerRecord], role: str, also_lacking: tuple[str, ...] = ()
    ) -> NoReturn:
        """Raise for a role without a worker to take the request: wait for budget (_NoBudget, with any
        other role found short too) when some exist, else the error that names what is missing."""
        if self._num_candidates(request, workers, role):
            raise _NoBudget((role, *also_lacking))
        raise self._no_worker_error(request, workers, role)

    def _cached_tokens(self, pending: _Pending, workers: Sequence[WorkerRecord]) -> dict[str, int]:
        """Prompt tokens each worker holds in its prefix cache, from the KV index."""
        request = pending.request
        if not (request.prompt_block_hashes or request.prompt_token_ids) or not self._index.num_workers:
            return {}
        cached: dict[str, int] = {}
        num_tokens = request.num_tokens
        for worker in workers:
            if worker.model != request.model or worker.block_size_tokens <= 0:
                continue
            if worker.block_hash_algo != HASH_ALGO_SHA256:
                continue  # not reproducible here: treated as cold
            key = (worker.block_size_tokens, worker.block_hash_seed)
            if key not in pending.hashes:
                if request.prompt_block_hashes:
                    # The gateway's hashes (it sends no token ids); a configuration it did not know is cold.
                    pending.hashes[key] = list(request.prompt_block_hashes.get(key, ()))
                else:
                    hasher = self._hashers.get(key)
                    if hasher is None:
                        hasher = self._hashers[key] = BlockHasher(*key)
                    pending.hashes[key] = hasher.block_hashes(request.prompt_token_ids, cache_salt=request.cache_salt)
                # one lookup per configuration, shared by its workers
                matched = self._index.match(pending.hashes[key])
                for worker_id, num_blocks in matched.items():
                    # vLLM recomputes at least the last prompt token even on a full hit.
                    cached[worker_id] = min(num_blocks * key[0], num_tokens - 1)
        return cached

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

    async def _wait_in_queue(self, pending: _Pending) -> PlacementDecision:
        request = pending.request
        cfg = self._queue_config
        priority = request.priority or cfg.tenant_priorities.get(request.tenant, "")
        try:
            waiter = self._queue.push(pending, tenant=request.tenant, priority=priority)
        except QueueFullError as exc:
            raise NoCapacityError(str(exc), retry_after_s=NO_CAPACITY_RETRY_AFTER_S) from None
        self._metrics.set_queue_depth(waiter.priority, self._queue.depth(waiter.priority))
        started_s = time.monotonic()
        outcome = "timeout"
        try:
            self._drain(self._last_workers or [])
            while True:
                remaining_s = started_s + cfg.timeout_s - time.monotonic()
                if waiter.future.done() or remaining_s <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(waiter.future), min(cfg.poll_interval_s, remaining_s))
                if not waiter.future.done():
                    self._sweep()
                    self._drain(await self._workers())
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
            self._queue.remove(waiter)
            if not waiter.future.done():
                waiter.future.cancel()
            self._metrics.set_queue_depth(waiter.priority, self._queue.depth(waiter.priority))
            self._metrics.observe_queue_wait(time.monotonic() - started_s, outcome=outcome)

    def _drain(self, workers: Sequence[WorkerRecord]) -> None:
        """Admit waiters in priority / fair-share order while the head one fits."""
        while True:
            waiter: Waiter[_Pending] | None = self._queue.next(self._reservations.num_in_flight_for_tenant)
            if waiter is None:
                return
            if waiter.future.done():
                self._queue.remove(waiter)
                continue
            try:
                decision = self._place(waiter.item, workers)
            except _NoBudget as exc:
                waiter.item.waiting_for = self._blocked_on = exc.roles
                return
            except TandemError as exc:
                self._queue.remove(waiter)
                waiter.future.set_exception(exc)
                continue
            self._queue.remove(waiter, admitted=True)
            waiter.future.set_result(decision)

    # -- Release and upkeep ------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Drop ``request_id``'s reservation held here; False when there was none (idempotent)."""
        self._sweep()
        reservation = self._reservations.release(request_id)
        self._publish(reservation)
        if reservation is not None and self._queue and self._last_workers is not None:
            self._drain(self._last_workers)
        return reservation is not None

    async def release_anywhere(self, request_id: str) -> bool:
        """Release here, or forward to the replica that holds the reservation."""
        if self.release(request_id):
            return True
        if self._replica_sync is not None:
            return await self._replica_sync.forward_release(request_id)
        return False

    def tick(self) -> None:
        """Periodic upkeep, called by the deployment every few seconds: drop
        expired leases even without traffic, and set every gauge again (Ray
        forgets a gauge that is not set for a couple of export intervals; the
        autoscaler must see a quiet pool's zeros)."""
        self._sweep()
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
        view = BudgetView(self._reservations, self._budget, self._replica_sync)
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
        """Share budgets with the other replicas and apply Releases they forwarded here."""
        if self._replica_sync is None:
            return
        forwarded = await self._replica_sync.sync(
            self._reservations.tokens_by_worker(), self._reservations.young_tokens_by_worker()
        )
        for request_id in forwarded:
            self.release(request_id)
        if self._queue and self._last_workers is not None:
            self._drain(self._last_workers)

    def _sweep(self) -> None:
        for reservation in self._reservations.sweep():
            self._publish(reservation)

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
        self, prefill: ScoredWorker | None, decode: ScoredWorker, num_cached_tokens: int, num_decode_cached: int
    ) -> str:
        decode_part = f"decode={decode.worker.worker_id}:{decode.score:.3f} decode_cached={num_decode_cached}"
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
