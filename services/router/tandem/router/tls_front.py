"""The router's TLS front: mutual TLS on the gateway → router hop.

Ray Serve's gRPC proxy cannot serve TLS (Ray 2.60: ``gRPCOptions`` has no
certificate fields and the proxy binds with ``add_insecure_port``), and a
Schedule carries a request's placement. So each router host runs this small
grpc.aio server beside the proxy: it terminates mTLS on the router's TLS port,
refuses any caller whose certificate is not a gateway's
(:mod:`tandem.common.identity`), and forwards each ``tandem.v1.Router`` call
as it came (bytes, not decoded again; the caller's metadata, which picks the
Serve application and the sticky replica; its deadline) to the proxy on the
loopback of the same host, and the answer back (status, details and the
``tandem-error`` trailer included).

Called by the gateway (``tandem.common.router_client.RouterClient``); calls
Serve's gRPC proxy. Started by ``python -m tandem.router`` on a thread of its
own when ``TANDEM_ROUTER_TLS__ENABLED`` (the local stack), and as the
``tls-front`` container of each router pod in the chart:
``python -m tandem.router.tls_front``.
Only grpc and tandem.common: no Ray. What it costs per Schedule is measured by
``benchmarks/bench_router_tls.py`` (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

import grpc
import grpc.aio
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.common.identity import RoleCheck
from tandem.common.logging import configure_logging
from tandem.common.tls import TLSSettings, add_port

logger = logging.getLogger("tandem.router.tls_front")

SERVICE = "tandem.v1.Router"
METHODS = ("Schedule", "Release")
#: Metadata that belongs to one connection, not to the call: never forwarded.
_HOP_HEADERS = ("user-agent", "te", "content-type", "grpc-", ":")


class TLSFrontSettings(BaseSettings):
    """``TANDEM_ROUTER_*``, the same names as the router's own settings."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_ROUTER_", env_nested_delimiter="__", extra="ignore")

    #: Port of Serve's gRPC proxy on this host (plaintext, loopback only in use).
    grpc_port: int = Field(default=9000, ge=1, le=65535)
    #: Port the front serves mTLS on (what the gateway dials).
    tls_port: int = Field(default=9443, ge=1, le=65535)
    #: Address the front binds.
    tls_host: str = "0.0.0.0"
    #: The router's certificate (role ``router``), the CA, and client authentication.
    tls: TLSSettings = Field(default_factory=TLSSettings)
    log_level: str = "INFO"


def _forwarded(metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((k, v) for k, v in metadata or () if not k.startswith(_HOP_HEADERS))


class RouterFront:
    """Forwards Schedule and Release to ``upstream`` (Serve's gRPC proxy), bytes in, bytes out."""

    def __init__(self, upstream: str) -> None:
        # Many calls at once share one HTTP/2 connection to the proxy on the loopback.
        self._channel = grpc.aio.insecure_channel(upstream)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE, {name: grpc.unary_unary_rpc_method_handler(self._forward(name)) for name in METHODS}
        )

    def _forward(self, name: str) -> Any:
        call_upstream: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(f"/{SERVICE}/{name}")

        async def forward(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            remaining_s = context.time_remaining()
            call = call_upstream(
                request,
                metadata=_forwarded(context.invocation_metadata()),
                timeout=remaining_s if remaining_s is not None and remaining_s < 3600 else None,
            )
            try:
                response: bytes = await call
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "", _forwarded(exc.trailing_metadata()))
            trailers = _forwarded(await call.trailing_metadata())
            if trailers:
                context.set_trailing_metadata(trailers)
            return response

        return forward

    async def aclose(self) -> None:
        await self._channel.close()


async def start_front(settings: TLSFrontSettings) -> tuple[grpc.aio.Server, RouterFront]:
    """The front, serving; stop the server, then close the front."""
    front = RouterFront(f"127.0.0.1:{settings.grpc_port}")
    server = grpc.aio.server(interceptors=[RoleCheck()])
    server.add_generic_rpc_handlers((front.handler(),))
    address = f"{settings.tls_host}:{settings.tls_port}"
    if not settings.tls.enabled:
        raise SystemExit("the router's TLS front needs TANDEM_ROUTER_TLS__ENABLED and its files")
    if add_port(server, address, settings.tls) == 0:
        raise SystemExit(f"cannot bind {address}")
    await server.start()
    logger.info("router tls front ready", extra={"address": address, "upstream": f"127.0.0.1:{settings.grpc_port}"})
    return server, front


async def _serve(settings: TLSFrontSettings) -> None:
    server, front = await start_front(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)
    await front.aclose()


def main() -> int:
    settings = TLSFrontSettings()
    configure_logging(settings.log_level)
    asyncio.run(_serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
