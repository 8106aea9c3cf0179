"""``python -m tandem.gateway``: read settings, load the tokenizer, connect to
the router and the registry, serve the app with uvicorn, and log one JSON line
with the URL once it is listening.

SIGTERM drains (see :mod:`tandem.gateway.drain`): readiness false, new
requests 503, in-flight streams get ``stream.drain_grace_s``, then the server
stops. A second SIGTERM or SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Generator
from types import FrameType

import uvicorn

from tandem.common.logging import configure_logging
from tandem.common.registry import WorkerRegistry
from tandem.common.tls import warn_if_plaintext
from tandem.gateway.app import build_app, build_metrics_app
from tandem.gateway.drain import Drain
from tandem.gateway.http_server import guarded_protocol
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.prefix_hashes import PromptHasher
from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.readiness import GrpcConnectProbe, RouterAndWorkersReadiness
from tandem.gateway.router import connect_router
from tandem.gateway.settings import GatewaySettings

logger = logging.getLogger("tandem.gateway")


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains before it stops."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float, metrics: GatewayMetrics) -> None:
        super().__init__(config)
        self._drain = drain
        self._grace_s = grace_s
        self._metrics = metrics
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._drain_task is not None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # We are in a signal handler: hand the work to the loop rather than touch it from here.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._metrics.draining.set(1)
            self._drain_task = asyncio.create_task(self._drain_then_exit())

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def _drain_then_exit(self) -> None:
        await self._drain.start(self._grace_s)
        self.should_exit = True


def prompt_tokenizers(settings: GatewaySettings) -> tuple[dict[str, HfPromptTokenizer], dict[str, HfPromptTokenizer]]:
    """One tokenizer and chat template per served base model (settings.models; the first is the default),
    and the same tokenizers with each model's tool chat template where it has one (tool_choice "auto"); all
    rendered with settings.chat_template_variables."""
    variables = settings.chat_template_variables
    tokenizers = {m.name: HfPromptTokenizer.from_dir(m.model_dir, variables) for m in settings.models}
    tool_tokenizers = {
        m.name: tokenizers[m.name].with_chat_template(m.tool_chat_template.read_text(encoding="utf-8"), variables)
        for m in settings.models
        if m.tool_chat_template is not None
    }
    return tokenizers, tool_tokenizers


async def serve(settings: GatewaySettings) -> None:
    tokenizers, tool_tokenizers = prompt_tokenizers(settings)
    warn_if_plaintext(settings.tls, "the gateway (calls to the router and the workers)")
    router = connect_router(settings.router_address, timeout_s=settings.router_timeout_s, tls=settings.tls)
    registry = WorkerRegistry(
        settings.redis.connection_url(), key_prefix=settings.registry.key_prefix, ttl_s=settings.registry.ttl_s
    )
    readiness = RouterAndWorkersReadiness(
        GrpcConnectProbe(settings.router_address, timeout_s=settings.readiness_timeout_s, tls=settings.tls),
        registry,
        cache_s=settings.readiness_cache_s,
        timeout_s=settings.readiness_timeout_s,
    )
    drain = Drain()
    metrics = GatewayMetrics()
    app = build_app(
        settings,
        router=router,
        tokenizer=tokenizers[settings.default_model.name],
        tokenizers=tokenizers,
        tool_tokenizers=tool_tokenizers,
        readiness=readiness,
        drain=drain,
        metrics=metrics,
        prompt_hasher=PromptHasher(registry),
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep our JSON root handler
        access_log=False,  # one line per request comes from the gateway itself
        timeout_graceful_shutdown=5,  # streams were drained before; this only closes idle connections
        timeout_keep_alive=settings.http.keep_alive_timeout_s,
        http=guarded_protocol(settings.http),  # head/body deadlines, head size, connection cap
        ws="none",  # no WebSocket routes; an upgrade would bypass the HTTP limits
    )
    server = _DrainingServer(config, drain, settings.stream.drain_grace_s, metrics)
    task = asyncio.create_task(server.serve())
    metrics_server = _metrics_server(settings, metrics)
    metrics_task = asyncio.create_task(metrics_server.serve()) if metrics_server is not None else None
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            logger.info(
                "gateway ready",
                extra={
                    "url": f"http://{host}:{port}",
                    "models": [m.name for m in settings.models],
                    "router_address": settings.router_address,
                    "auth_mode": settings.auth.mode,
                    "worker_tls": settings.tls.enabled,
                    "router_tls": settings.tls.enabled,
                },
            )
        await task
    finally:
        if metrics_server is not None and metrics_task is not None:
            metrics_server.should_exit = True  # scrapes end with the API's server, drained or not
            await metrics_task
        await router.aclose()
        await registry.aclose()
        logger.info("gateway stopped")


def _metrics_server(settings: GatewaySettings, metrics: GatewayMetrics) -> uvicorn.Server | None:
    """``/metrics`` on ``settings.metrics_port`` alone (None: it is served beside the API)."""
    if settings.metrics_port is None:
        return None
    config = uvicorn.Config(
        build_metrics_app(metrics),
        host=settings.host,
        port=settings.metrics_port,
        log_config=None,
        access_log=False,
        ws="none",
    )
    return _MetricsServer(config)


class _MetricsServer(uvicorn.Server):
    """uvicorn, except that it leaves the signals to the API's server (which drains on SIGTERM first): two
    servers capturing them would each replace the other's handlers. It stops after the API's server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def main() -> None:
    settings = GatewaySettings()
    configure_logging(settings.log_level, json_logs=settings.json_logs)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
