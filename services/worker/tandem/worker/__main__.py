"""``python -m tandem.worker --role prefill|decode``: start the engine, the
gRPC worker service with the standard health service beside it, the registry
heartbeat and (optionally) a Prometheus endpoint; drain on SIGTERM (unregister,
finish in-flight, stop, exit 0). When the engine dies (tandem.worker.liveness):
NOT_SERVING, UNAVAILABLE for every call, unregister at once, and exit
:data:`~tandem.worker.liveness.EXIT_ENGINE_DEAD` for the supervisor to restart."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.common.adapters import AdapterCatalog
from tandem.common.identity import role_checks
from tandem.common.ids import new_worker_id
from tandem.common.logging import configure_logging
from tandem.common.registry import WorkerRegistry
from tandem.common.tls import add_port, warn_if_plaintext
from tandem.v1 import worker_pb2_grpc
from tandem.worker.adapters import AdapterResidency
from tandem.worker.liveness import EXIT_ENGINE_DEAD, EngineWatch
from tandem.worker.peers import PrefillPeers
from tandem.worker.registration import build_record, heartbeat_forever, kv_identity
from tandem.worker.service import WorkerService, wait_idle
from tandem.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from tandem.worker.engine import VLLMEngine

logger = logging.getLogger("tandem.worker")


def parse_settings(argv: list[str] | None = None) -> WorkerSettings:
    """Environment first, then the few flags given on the command line."""
    parser = argparse.ArgumentParser(prog="python -m tandem.worker")
    parser.add_argument("--role", choices=["prefill", "decode"])
    parser.add_argument("--port", type=int)
    parser.add_argument("--kv-port", type=int)
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument("--cpu-threads-bind")
    parser.add_argument("--model-dir")
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    updates: dict[str, Any] = {}
    if args.role:
        updates["role"] = args.role
    if args.port:
        updates["port"] = args.port
    if args.metrics_port is not None:
        updates["metrics_port"] = args.metrics_port
    if args.kv_port:
        updates["kv"] = settings.kv.model_copy(update={"port": args.kv_port})
    engine_updates: dict[str, Any] = {}
    if args.cpu_threads_bind:
        engine_updates["cpu_threads_bind"] = args.cpu_threads_bind
    if args.model_dir:
        engine_updates["model_dir"] = args.model_dir
    if engine_updates:
        updates["engine"] = settings.engine.model_copy(update=engine_updates)
    return settings.model_copy(update=updates)


#: The names the health service answers for: the server as a whole ("") and the Worker service.
HEALTH_SERVICES = ("", "tandem.v1.Worker")
#: A worker whose engine died stops within this long even if the engine does not shut down.
_DEATH_EXIT_S = 15.0


def _grpc_server(*, check_roles: bool = False) -> grpc.aio.Server:
    """``check_roles``: refuse callers whose certificate's role may not call the method
    (tandem.common.identity; only with TLS on, which gives the certificate)."""
    # so_reuseport off: a port someone else holds must fail the bind, not share its traffic.
    return grpc.aio.server(
        interceptors=role_checks(check_roles),
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ],
    )


def build_server(
    settings: WorkerSettings, service: worker_pb2_grpc.WorkerServicer, health_servicer: health.aio.HealthServicer
) -> tuple[grpc.aio.Server, str]:
    """The Worker service and the health service on ``bind_host:port`` (not started): over mutual TLS
    with the worker's certificate, each call checked for its caller's role (tandem.common.identity),
    when ``settings.tls`` is enabled; in plaintext, checking nobody, when not. Returns it and its address."""
    server = _grpc_server(check_roles=settings.tls.enabled)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{settings.bind_host}:{settings.port}"
    port = add_port(server, address, settings.tls)
    if port == 0:
        raise SystemExit(f"cannot bind {address}")
    return server, f"{settings.bind_host}:{port}"


def _set_health(servicer: health.aio.HealthServicer, status: int) -> list[asyncio.Task[None]]:
    return [asyncio.ensure_future(servicer.set(name, status)) for name in HEALTH_SERVICES]


async def serve(settings: WorkerSettings) -> int:
    """Serve until SIGTERM (0) or until the engine dies (EXIT_ENGINE_DEAD)."""
    from tandem.worker.engine import build_engine
    from tandem.worker.metrics import start_metrics_server

    worker_id = settings.worker_id or new_worker_id(settings.role)
    started = time.perf_counter()
    engine = build_engine(settings)
    engine_start_s = time.perf_counter() - started
    service = WorkerService(settings, engine, worker_id=worker_id)
    registry = WorkerRegistry(
        settings.redis.connection_url(), key_prefix=settings.registry.key_prefix, ttl_s=settings.registry.ttl_s
    )
    model = settings.engine.served_model_name
    catalog, adapters, adapter_refresh = _start_adapters(settings, engine, service)
    service.use_kv_peers(PrefillPeers(lambda: registry.list_workers(role="prefill", model=model)))
    await service.start()
    health_servicer = health.aio.HealthServicer()
    await asyncio.gather(*_set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING))
    warn_if_plaintext(settings.tls, f"the {settings.role} worker")
    server, address = build_server(settings, service, health_servicer)
    await server.start()
    servers = [server]
    if settings.health_port:
        # Health alone, in plaintext: what it says (SERVING or not) is no secret, and probes speak no TLS.
        health_server = _grpc_server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        if health_server.add_insecure_port(f"{settings.bind_host}:{settings.health_port}") == 0:
            raise SystemExit(f"cannot bind {settings.bind_host}:{settings.health_port}")
        await health_server.start()
        servers.append(health_server)
    if settings.metrics_port:
        start_metrics_server(settings.bind_host, settings.metrics_port, service)

    num_blocks, block_size = engine.kv_cache_shape()
    assert service.layout is not None  # service.start() read it from the engine
    revision, fingerprint = kv_identity(settings, service.layout)
    record = build_record(
        settings, worker_id, num_kv_blocks=num_blocks, block_size_tokens=block_size,
        model_revision=revision, kv_fingerprint=fingerprint,
    )
    heartbeat = asyncio.create_task(
        heartbeat_forever(registry, record, service, settings.registry.heartbeat_interval_s)
    )
    logger.info(
        "worker ready",
        extra={
            "worker_id": worker_id,
            "role": settings.role,
            "address": address,
            "kv_address": record.kv_address,
            "tls": settings.tls.enabled,
            "engine_start_s": round(engine_start_s, 2),
            "num_kv_blocks": num_blocks,
            "block_size_tokens": block_size,
            "layout": service.layout.to_dict(),
            "model_revision": revision,
            "kv_fingerprint": fingerprint,
        },
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch = EngineWatch(engine, has_work=lambda: service.num_running > 0, step_timeout_s=settings.engine.step_timeout_s)
    stopped = asyncio.ensure_future(stop.wait())
    died = asyncio.ensure_future(watch.wait_dead())
    await asyncio.wait([stopped, died], return_when=asyncio.FIRST_COMPLETED)

    if died.done():
        stopped.cancel()
        return await _die(died.result(), worker_id, service, health_servicer, registry, heartbeat, servers, engine)
    died.cancel()
    logger.info("draining", extra={"worker_id": worker_id, "num_running": service.num_running})
    await asyncio.gather(*_set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING))
    service.draining = True
    try:
        await registry.unregister(worker_id)
    except Exception as exc:
        logger.warning("unregister failed: %s", exc)
    await wait_idle(service, settings.drain_timeout_s)
    heartbeat.cancel()
    for each in servers:
        await each.stop(grace=1.0)
    await registry.aclose()
    await _stop_adapters(catalog, adapters, adapter_refresh)
    engine.shutdown()
    logger.info("worker stopped", extra={"worker_id": worker_id})
    return 0


async def _die(
    reason: str,
    worker_id: str,
    service: WorkerService,
    health_servicer: health.aio.HealthServicer,
    registry: WorkerRegistry,
    heartbeat: asyncio.Task[None],
    servers: list[grpc.aio.Server],
    engine: VLLMEngine,
) -> int:
    """The engine died: stop being found (health, every call, the registry) first, then shut the engine
    down and go."""
    died_at = time.monotonic()
    # The process goes even if a step below hangs on the dead engine.
    threading.Timer(_DEATH_EXIT_S, os._exit, args=(EXIT_ENGINE_DEAD,)).start()
    service.engine_died()
    heartbeat.cancel()
    await asyncio.gather(*_set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING))
    try:
        await asyncio.wait_for(registry.unregister(worker_id), 2.0)
    except Exception as exc:  # the registration expires after its TTL
        logger.warning("unregister failed: %s", exc)
    logger.error(
        "engine died; worker unregistered and exiting",
        extra={
            "worker_id": worker_id,
            "reason": reason,
            "num_running": service.num_running,
            "unregistered_after_s": round(time.monotonic() - died_at, 3),
        },
    )
    # Shutting a stuck engine down ends its requests with EngineDeadError (UNAVAILABLE to their callers);
    # a dead one has ended them already, and its shutdown only frees what is left.
    with contextlib.suppress(Exception):
        await asyncio.to_thread(engine.shutdown)
    # Give the in-flight calls' last messages a moment.
    for each in servers:
        await each.stop(grace=1.0)
    with contextlib.suppress(Exception):
        await registry.aclose()
    logger.info("worker stopped", extra={"worker_id": worker_id, "exit_status": EXIT_ENGINE_DEAD})
    return EXIT_ENGINE_DEAD


def _start_adapters(
    settings: WorkerSettings, engine: VLLMEngine, service: WorkerService
) -> tuple[AdapterCatalog | None, AdapterResidency | None, asyncio.Task[None] | None]:
    """With LoRA on: the adapter catalog, the engine's adapter residency (given to ``service``) and the
    task that keeps the catalog fresh; Nones with LoRA off."""
    conf = settings.adapters
    if not conf.max_adapters:
        return None, None, None
    catalog = AdapterCatalog.connect(settings.redis.connection_url(), key_prefix=settings.registry.key_prefix)
    adapters = AdapterResidency(
        engine,
        catalog.entries,
        model=settings.engine.served_model_name,
        max_adapters=conf.max_adapters,
        catalog_max_age_s=conf.catalog_max_age_s,
        catalog_stale_s=conf.catalog_stale_s,
        slot_wait_s=conf.slot_wait_s,
    )
    service.use_adapters(adapters)
    return catalog, adapters, asyncio.create_task(adapters.run())


async def _stop_adapters(
    catalog: AdapterCatalog | None, adapters: AdapterResidency | None, refresh: asyncio.Task[None] | None
) -> None:
    if refresh is not None:
        refresh.cancel()
    if adapters is not None:
        await adapters.aclose()
    if catalog is not None:
        with contextlib.suppress(Exception):
            await catalog.aclose()


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_logging(settings.log_level)
    from tandem.worker.engine import NoDeviceError

    try:
        code = asyncio.run(serve(settings))
    except NoDeviceError as exc:  # a missing GPU is the pod's or the node's to fix: its message, no traceback
        raise SystemExit(f"tandem.worker: {exc}") from None
    sys.exit(code)


if __name__ == "__main__":
    main()
