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
from tandem.common.registry import WorkerRecord
from tandem.common.router_wire import METADATA_PRIORITY, status_for_error
from tandem.router.gc_tuning import tune_gc
from tandem.router.ledger_auth import check_secret_file, read_secret
from tandem.router.metrics import RayRouterMetrics
from tandem.router.policy import ScheduleRequest
from tandem.router.replica import LedgerIdentity, build_replica
from tandem.router.scheduler import PlacementDecision
from tandem.router.settings import RouterConfig
from tandem.v1 import router_pb2

logger = logging.getLogger(__name__)

#: Period of the replica's upkeep (lease sweep, gauge refresh); well below
#: Ray's gauge TTL of about two export intervals (2 x 10 s).
_TICK_INTERVAL_S = 5.0
#: Ray Serve's consistent-hash request router (keyed by the ``session_id``
#: metadata, which the client sets to the request id).
_STICKY_REQUEST_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


class RouterDeployment:
    """One router replica (:func:`tandem.router.replica.build_replica`): its own reservation table,
    policy state, registry cache, KV index and ledger."""

    def __init__(self, config: dict[str, Any]) -> None:
        cfg = RouterConfig.model_validate(config)
        tune_gc(cfg.gc_young_threshold)
        replica = build_replica(
            cfg,
            metrics=RayRouterMetrics(),
            ledger=LedgerIdentity(replica_id=uuid.uuid4().hex[:12], secret=_ledger_secret(cfg)),
        )
        assert replica.ledger is not None
        self._ledger = replica.ledger
        self._scheduler = replica.scheduler
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
        adapter=request.adapter,
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
