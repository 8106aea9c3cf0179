"""Entry point: ``python -m tandem.router``.

Reads :class:`tandem.router.settings.TandemRouterSettings` once, starts a
local Ray (or connects to ``RAY_ADDRESS``), starts Serve with its gRPC proxy
serving tandem.v1.Router, deploys :mod:`tandem.router.deployment` as the
application ``tandem-router``, logs one line when it answers, and shuts Serve
and Ray down on SIGTERM/SIGINT. With ``TANDEM_ROUTER_TLS__ENABLED`` it also
serves the gateway over mutual TLS on ``TANDEM_ROUTER_TLS_PORT``
(:mod:`tandem.router.tls_front`, on a thread of its own).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

import grpc

from tandem.common.logging import configure_logging
from tandem.common.router_wire import APPLICATION_NAME, METADATA_APPLICATION
from tandem.common.tls import warn_if_plaintext
from tandem.router.ledger_auth import LedgerSecretError, check_secret_file
from tandem.router.policy import create_policy
from tandem.router.settings import TandemRouterSettings
from tandem.router.tls_front import TLSFrontSettings, start_front
from tandem.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger("tandem.router")

_SERVICER_FUNCTION = "tandem.v1.router_pb2_grpc.add_RouterServicer_to_server"
#: How long to wait for the gRPC proxy to list the application after serve.run.
_READY_TIMEOUT_S = 60.0


def _quiet_ray_loggers() -> None:
    for name in ("ray", "ray.serve", "ray.data", "ray.tune", "ray.train"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _start_ray(settings: TandemRouterSettings) -> None:
    import ray

    if settings.ray_address:
        ray.init(address=settings.ray_address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        # A local Ray on a loaded host (a 2-core machine running vLLM engines) can take longer than the
        # raylet's default 30 s to hear from its dashboard agent; it then aborts and the router never
        # starts (seen when the fault suite restarted the router). Give it three minutes.
        os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
        ray.init(
            num_cpus=settings.ray_num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
            _metrics_export_port=settings.metrics_port,
        )


def _start_serve(settings: TandemRouterSettings) -> None:
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions
    from ray.serve.schema import LoggingConfig

    from tandem.router.deployment import build_app

    _quiet_ray_loggers()  # importing ray.serve configured its logger at INFO
    quiet = LoggingConfig(log_level="WARNING", enable_access_log=False)
    serve.start(
        http_options=HTTPOptions(host=settings.http_host, port=settings.http_port),
        grpc_options=gRPCOptions(port=settings.grpc_port, grpc_servicer_functions=[_SERVICER_FUNCTION]),
        logging_config=quiet,
    )
    serve.run(
        build_app(settings.router_config(), num_replicas=settings.num_replicas),
        name=APPLICATION_NAME,
        # gRPC ingress needs the app in the route table, which route_prefix=None would skip.
        route_prefix=f"/{APPLICATION_NAME}",
        logging_config=quiet,
    )


def _wait_until_answering(grpc_port: int, timeout_s: float) -> None:
    """Wait until a Release for a request nobody scheduled goes all the way to
    a replica and back through Serve's gRPC proxy (it changes nothing)."""
    deadline_s = time.monotonic() + timeout_s
    last_error = ""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        probe = router_pb2.RouterReleaseRequest(request_id="tandem-router-ready-probe")
        while time.monotonic() < deadline_s:
            try:
                stub.Release(probe, timeout=2.0, metadata=((METADATA_APPLICATION, APPLICATION_NAME),))
                return
            except grpc.RpcError as exc:
                last_error = f"{exc.code()}: {exc.details()}"
            time.sleep(0.2)
    raise TimeoutError(f"router not answering on :{grpc_port} after {timeout_s:.0f} s ({last_error})")


def _start_tls_front(settings: TLSFrontSettings) -> threading.Event:
    """The TLS front on a thread with its own event loop; set the returned event to stop it."""
    stop = threading.Event()
    started = threading.Event()
    failed: list[BaseException] = []

    async def run() -> None:
        try:
            server, front = await start_front(settings)
        except BaseException as exc:
            failed.append(exc)
            started.set()
            return
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await server.stop(grace=2.0)
        await front.aclose()

    threading.Thread(target=asyncio.run, args=(run(),), name="tandem-router-tls-front", daemon=True).start()
    started.wait(30.0)
    if failed:
        raise RuntimeError(f"the router's TLS front did not start: {failed[0]}")
    return stop


def _shutdown(settings: TandemRouterSettings) -> None:
    import ray
    from ray import serve

    try:
        if settings.ray_address:
            # A shared cluster keeps Serve for others; take only our application away.
            serve.delete(APPLICATION_NAME)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def main() -> int:
    settings = TandemRouterSettings()
    configure_logging(settings.log_level)
    create_policy(settings.policy)  # fail in a second on a typo, not after Ray is up
    try:  # the same for the ledger's secret
        check_secret_file(settings.ledger.secret_file, num_replicas=settings.num_replicas)
    except LedgerSecretError as exc:
        logger.error("router cannot start: %s", exc)
        return 1
    _quiet_ray_loggers()
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("router stopping", extra={"signal": signal.Signals(signum).name})
        stop.set()

    started_s = time.monotonic()
    front_settings = TLSFrontSettings()
    warn_if_plaintext(front_settings.tls, "the router (gateway → router hop)")
    front_stop: threading.Event | None = None
    try:
        _start_ray(settings)
        # After ray.init: Ray's core worker installs its own SIGTERM handler,
        # which would kill the process without shutting Serve down.
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        _start_serve(settings)
        _wait_until_answering(settings.grpc_port, _READY_TIMEOUT_S)
        if front_settings.tls.enabled:
            front_stop = _start_tls_front(front_settings)
    except Exception:
        logger.exception("router failed to start")
        _shutdown(settings)
        return 1
    logger.info(
        "router ready",
        extra={
            "grpc_address": f"0.0.0.0:{settings.grpc_port}",
            "tls_address": f"{front_settings.tls_host}:{front_settings.tls_port}" if front_stop else None,
            "application": APPLICATION_NAME,
            "policy": settings.policy,
            "num_replicas": settings.num_replicas,
            "startup_s": round(time.monotonic() - started_s, 2),
        },
    )
    stop.wait()
    if front_stop is not None:
        front_stop.set()
    _shutdown(settings)
    logger.info("router stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
