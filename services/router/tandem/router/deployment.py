"""The router as a Ray Serve deployment, answering tandem.v1.Router.

Serve's gRPC proxy (started by :mod:`tandem.router.__main__` with
``add_RouterServicer_to_server``) calls :meth:`RouterDeployment.Schedule` and
:meth:`RouterDeployment.Release` by RPC name, in the replica chosen for the
request's ``session_id`` metadata. The methods decode the protos, call
:class:`tandem.router.scheduler.Scheduler`, and map tandem errors to a gRPC
status code plus a ``tandem-error`` trailer on the Serve gRPC context (set,
then return an empty message: Serve sends the code we set, and nothing is
logged as a crash for an expected "no capacity").

Each replica follows every worker's KV events (its own
:class:`tandem.router.kv_subscriber.KVEventSubscriber` and index, rebuilt
from the publishers' replay when the replica starts) and shares its budgets
with the other replicas through Redis as they change (:mod:`tandem.router.ledger`), so
replicas are active-active with one view: any of them can place any request, and the
tenants' fair share is the router's, not one replica's.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from typing import Any

from ray import serve
from ray.serve.deployment import Application
from ray.serve.grpc_util import RayServegRPCContext

from tandem.common.errors import BackendUnavailableError, TandemError
from tandem.common.registry import WorkerRecord, WorkerRegistry
from tandem.common.router_wire import METADATA_PRIORITY, status_for_error
from tandem.router.budget import BudgetConfig
from tandem.router.fair_share import TenantShares
from tandem.router.gc_tuning import tune_gc
from tandem.router.kv_index import KVIndex
from tandem.router.kv_subscriber import KVEventSubscriber
from tandem.router.ledger import Ledger
from tandem.router.ledger_auth import check_secret_file, read_secret
from tandem.router.metrics import RayRouterMetrics
from tandem.router.policy import ScheduleRequest, create_policy
from tandem.router.reservations import ReservationTable
from tandem.router.scheduler import PlacementDecision, QueueConfig, Scheduler
from tandem.router.settings import RouterConfig
from tandem.router.worker_view import CachedWorkerView
from tandem.v1 import router_pb2

logger = logging.getLogger(__name__)

#: Period of the replica's upkeep (lease sweep, gauge refresh); well below
#: Ray's gauge TTL of about two export intervals (2 x 10 s).
_TICK_INTERVAL_S = 5.0
#: Ray Serve's consistent-hash request router (keyed by the ``session_id``
#: metadata, which the client sets to the request id).
_STICKY_REQUEST_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


class RouterDeployment:
    """One router replica: its own reservation table, policy state and registry cache."""

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = RouterConfig.model_validate(config)
        tune_gc(cfg.gc_young_threshold)
        redis_url = cfg.redis.connection_url()  # the router's own Redis user (tandem.common.redis_acl)
        self._registry = WorkerRegistry(redis_url, key_prefix=cfg.registry.key_prefix, ttl_s=cfg.registry.ttl_s)
        view = CachedWorkerView(
            self._registry,
            refresh_interval_s=cfg.registry_refresh_interval_s,
            max_stale_s=cfg.registry.ttl_s,
            refresh_in_background=True,  # a Schedule never waits for the registry read (worker_view)
        )
        q = cfg.queue
        young_s = 2 * cfg.registry.heartbeat_interval_s + 1.0
        metrics = RayRouterMetrics()
        self._ledger = Ledger(
            redis_url,
            key_prefix=cfg.registry.key_prefix,
            replica_id=uuid.uuid4().hex[:12],
            secret=_ledger_secret(cfg),
            max_replicas=cfg.ledger.max_replicas,
            max_message_age_s=cfg.ledger.max_message_age_s,
            metrics=metrics,
            lease_s=cfg.lease_s,
            young_s=young_s,
            flush_interval_s=cfg.ledger.flush_interval_s,
            snapshot_interval_s=cfg.replica_sync_interval_s,
            ttl_s=cfg.ledger.replica_ttl_s,
            shares=TenantShares(half_life_s=q.fair_share_half_life_s, weights=dict(q.tenant_weights)),
        )
        self._subscriber = KVEventSubscriber(
            KVIndex(max_blocks_per_worker=cfg.kv_index.max_blocks_per_worker),
            replay_timeout_s=cfg.kv_index.replay_timeout_s,
            catch_up_interval_s=cfg.kv_index.catch_up_interval_s,
        )
        self._scheduler = Scheduler(
            view,
            create_policy(cfg.policy, cfg.weights),
            ReservationTable(lease_s=cfg.lease_s, young_s=young_s),
            metrics,
            budget=BudgetConfig(cfg.budget.prefill_tokens_in_flight, cfg.budget.decode_kv_fraction),
            subscriber=self._subscriber,
            ledger=self._ledger,
            queue=QueueConfig(
                priority_classes=tuple(q.priority_classes),
                default_priority=q.default_priority,
                tenant_priorities=dict(q.tenant_priorities),
                timeout_s=q.timeout_s,
                poll_interval_s=q.poll_interval_s,
                max_depth=q.max_depth,
                tenant_weights=dict(q.tenant_weights),
                fair_share_half_life_s=q.fair_share_half_life_s,
                handoff_timeout_s=q.handoff_timeout_s,
            ),
            min_uncached_tokens_to_disaggregate=cfg.disaggregation.min_uncached_tokens,
        )
        self._ticker: asyncio.Task[None] | None = None
        self._syncer: asyncio.Task[None] | None = None

    def _ensure_ticker(self) -> None:
        # Started from the first RPC (the router's readiness probe is one): that
        # runs on the replica's event loop, which the constructor does not necessarily do.
        loop = asyncio.get_running_loop()
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._tick_forever())
        if self._syncer is None or self._syncer.done():
            self._syncer = loop.create_task(self._sync_forever())
        self._ledger.start()

    async def _sync_forever(self) -> None:
        """Share budgets with the other replicas and keep following the registered workers' KV events."""
        while True:
            try:
                await self._scheduler.refresh_workers()
                await self._scheduler.sync_replicas()
            except BackendUnavailableError:
                pass  # Redis is down: the view and the sync log it; Schedule answers for itself
            except Exception:
                logger.exception("router replica sync failed")
            await asyncio.sleep(self._ledger.snapshot_interval_s)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(_TICK_INTERVAL_S)
            try:
                self._scheduler.tick()
            except Exception:
                logger.exception("router upkeep failed")

    async def Schedule(  # Serve dispatches by RPC name
        self, request: router_pb2.ScheduleRequest, grpc_context: RayServegRPCContext
    ) -> router_pb2.Placement:
        self._ensure_ticker()
        priority = _metadata_value(grpc_context, METADATA_PRIORITY)
        try:
            decision = await self._scheduler.schedule(schedule_request_from_proto(request, priority=priority))
        except TandemError as exc:
            _set_error(grpc_context, exc, request.request_id)
            return router_pb2.Placement(request_id=request.request_id)
        return placement_to_proto(decision)

    async def Release(  # Serve dispatches by RPC name
        self, request: router_pb2.RouterReleaseRequest, grpc_context: RayServegRPCContext
    ) -> router_pb2.RouterReleaseResponse:
        self._ensure_ticker()
        found = await self._scheduler.end_reservation_anywhere(request.request_id)
        return router_pb2.RouterReleaseResponse(found=found)

    async def check_health(self) -> None:
        """Serve's periodic replica health check (every 5 s, on the replica's event loop): it
        also starts the upkeep loops, so a new replica follows the workers' KV events and
        shares its budgets before its first request. The registry being down is not a replica fault."""
        self._ensure_ticker()


def _set_error(grpc_context: RayServegRPCContext, exc: TandemError, request_id: str) -> None:
    code, trailers = status_for_error(exc)
    grpc_context.set_code(code)
    grpc_context.set_details(str(exc))
    grpc_context.set_trailing_metadata(trailers)
    logger.info("schedule refused: %s", exc, extra={"request_id": request_id, "grpc_code": code.name})


def _metadata_value(grpc_context: RayServegRPCContext, key: str) -> str:
    try:
        for k, v in grpc_context.invocation_metadata() or ():
            if k == key:
                return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # metadata is advisory; never fail a Schedule on it
        pass
    return ""


def schedule_request_from_proto(request: router_pb2.ScheduleRequest, *, priority: str = "") -> ScheduleRequest:
    return ScheduleRequest(
        request_id=request.request_id,
        model=request.model,
        num_prompt_tokens=request.num_prompt_tokens,
        max_tokens=request.max_tokens,
        tenant=request.tenant,
        prompt_token_ids=tuple(request.prompt_token_ids),
        cache_salt=request.cache_salt,
        prompt_block_hashes={(h.block_size_tokens, h.hash_seed): tuple(h.hashes) for h in request.prompt_block_hashes},
        exclude_worker_ids=frozenset(request.exclude_worker_ids),
        priority=priority,
        prefill_done_on_worker_id=request.prefill_done_on_worker_id,
        local_prefill_only=request.local_prefill_only,
    )


def _worker_ref(worker: WorkerRecord) -> router_pb2.WorkerRef:
    return router_pb2.WorkerRef(
        worker_id=worker.worker_id, role=worker.role, address=worker.address, kv_address=worker.kv_address
    )


def placement_to_proto(decision: PlacementDecision) -> router_pb2.Placement:
    placement = router_pb2.Placement(
        request_id=decision.request_id,
        decode=_worker_ref(decision.decode),
        lease_s=decision.lease_s,
        num_cached_tokens=decision.num_cached_tokens,
        reason=decision.reason,
        local_prefill=decision.local_prefill,
        num_decode_cached_tokens=decision.num_decode_cached_tokens,
    )
    if decision.prefill is not None:
        placement.prefill.CopyFrom(_worker_ref(decision.prefill))
    return placement


def _ledger_secret(cfg: RouterConfig) -> bytes:
    """The ledger's shared secret from ``ledger.secret_file``; without one, a random secret of this
    replica's own (it then trusts no other replica: :func:`build_app` refuses several without one)."""
    if cfg.ledger.secret_file is not None:
        return read_secret(cfg.ledger.secret_file)
    logger.warning("no ledger.secret_file: this replica drops every other replica's ledger messages")
    return secrets.token_bytes(32)


def build_app(config: RouterConfig, *, num_replicas: int = 1) -> Application:
    """The router application, ready for ``serve.run``. Several replicas need a shared ledger secret
    (``ledger.secret_file``): without it they could not authenticate each other's ledger messages."""
    check_secret_file(config.ledger.secret_file, num_replicas=num_replicas)
    options: dict[str, Any] = {
        "name": "Router",
        "num_replicas": num_replicas,
        # Schedule is a few microseconds of CPU; one replica serves many at once.
        "max_ongoing_requests": 1000,
        "ray_actor_options": {"num_cpus": 0},
        "health_check_period_s": 5.0,
    }
    if num_replicas > 1:
        # Reservations live in the replica that made them: Release should reach
        # it (one that does not is forwarded through Redis, see ledger).
        options["request_router_config"] = {"request_router_class": _STICKY_REQUEST_ROUTER}
    return serve.deployment(**options)(RouterDeployment).bind(config.model_dump(mode="json"))
