"""``python -m tandem.worker --role prefill|decode``: start the engine, the
gRPC worker service, the registry heartbeat and (optionally) a Prometheus
endpoint; drain on SIGTERM (unregister, finish in-flight, stop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from typing import Any

import grpc

from tandem.common.ids import new_worker_id
from tandem.common.logging import configure_logging
from tandem.common.registry import WorkerRegistry
from tandem.common.tls import add_port
from tandem.v1 import worker_pb2_grpc
from tandem.worker.registration import build_record, heartbeat_forever
from tandem.worker.service import WorkerService, wait_idle
from tandem.worker.settings import WorkerSettings

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


async def serve(settings: WorkerSettings) -> None:
    from tandem.worker.engine import build_engine
    from tandem.worker.metrics import start_metrics_server

    worker_id = settings.worker_id or new_worker_id(settings.role)
    started = time.perf_counter()
    engine = build_engine(settings)
    engine_start_s = time.perf_counter() - started
    service = WorkerService(settings, engine, worker_id=worker_id)
    await service.start()
    # so_reuseport off: a port someone else holds must fail the bind, not share its traffic.
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ]
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    address = f"{settings.bind_host}:{settings.port}"
    if add_port(server, address, settings.tls) == 0:
        raise SystemExit(f"cannot bind {address}")
    await server.start()
    if settings.metrics_port:
        start_metrics_server(settings.bind_host, settings.metrics_port, service)

    num_blocks, block_size = engine.kv_cache_shape()
    registry = WorkerRegistry(
        settings.redis.url, key_prefix=settings.registry.key_prefix, ttl_s=settings.registry.ttl_s
    )
    record = build_record(settings, worker_id, num_kv_blocks=num_blocks, block_size_tokens=block_size)
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
            "layout": service.layout.to_dict() if service.layout else None,
        },
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    logger.info("draining", extra={"worker_id": worker_id, "num_running": service.num_running})
    service.draining = True
    try:
        await registry.unregister(worker_id)
    except Exception as exc:
        logger.warning("unregister failed: %s", exc)
    await wait_idle(service, settings.drain_timeout_s)
    heartbeat.cancel()
    await server.stop(grace=1.0)
    await registry.aclose()
    engine.shutdown()
    logger.info("worker stopped", extra={"worker_id": worker_id})


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_logging(settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
