"""``python -m tandem.gateway``: read settings, load the tokenizer, connect to
the router and the registry, serve the app with uvicorn, and log one JSON line
with the URL once it is listening."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from tandem.common.logging import configure_logging
from tandem.common.registry import WorkerRegistry
from tandem.gateway.app import build_app
from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.readiness import GrpcConnectProbe, RouterAndWorkersReadiness
from tandem.gateway.scheduler import connect_scheduler
from tandem.gateway.settings import GatewaySettings

logger = logging.getLogger("tandem.gateway")


async def serve(settings: GatewaySettings) -> None:
    tokenizer = HfPromptTokenizer.from_dir(settings.model_dir)
    scheduler = connect_scheduler(settings.router_address, timeout_s=settings.router_timeout_s)
    registry = WorkerRegistry(
        settings.redis.url, key_prefix=settings.registry.key_prefix, ttl_s=settings.registry.ttl_s
    )
    readiness = RouterAndWorkersReadiness(
        GrpcConnectProbe(settings.router_address, timeout_s=settings.readiness_timeout_s),
        registry,
        cache_s=settings.readiness_cache_s,
        timeout_s=settings.readiness_timeout_s,
    )
    app = build_app(settings, scheduler=scheduler, tokenizer=tokenizer, readiness=readiness)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep our JSON root handler
        access_log=False,  # one line per request comes from the gateway itself
        timeout_graceful_shutdown=30,
        timeout_keep_alive=75,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            logger.info(
                "gateway ready",
                extra={
                    "url": f"http://{host}:{port}",
                    "model": settings.served_model_name,
                    "router_address": settings.router_address,
                },
            )
        await task
    finally:
        await scheduler.aclose()
        await registry.aclose()


def main() -> None:
    settings = GatewaySettings()
    configure_logging(settings.log_level, json_logs=settings.json_logs)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
