"""The router for tests: a ``tandem.v1.Router`` gRPC servicer and the server
around it, standing in for the deployment in tests of its clients
(``RouterClient``, the gateway); the real router as a process
(:func:`router_process`) for the integration tests; and a real replica in-process
(:func:`make_scheduler`, :func:`make_replica`), assembled by the deployment's own
:func:`tandem.router.replica.build_replica`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import redis

from tandem.common.errors import TandemError
from tandem.common.registry import WorkerRecord
from tandem.common.router_wire import status_for_error
from tandem.router.gauges import FLUSH_S
from tandem.v1 import router_pb2, router_pb2_grpc
from tests.kit.net import free_port
from tests.kit.workers import StaticView

if TYPE_CHECKING:  # the router's modules load on first use: the gateway's tests use this kit too
    from tandem.router.intake import WorkerView
    from tandem.router.metrics import RouterMetrics
    from tandem.router.replica import Replica
    from tandem.router.scheduler import Scheduler

#: The ledger secret the tests' router replicas share (``Ledger(secret=...)``; at least 16 bytes).
LEDGER_SECRET = b"tests-router-ledger-secret-0123456789"


def make_replica(
    workers: list[WorkerRecord] | None = None,
    *,
    view: WorkerView | None = None,
    metrics: RouterMetrics | None = None,
    clock: Callable[[], float] = time.monotonic,
    replica_id: str = "",
    follow_kv_events: bool = False,
    **config: Any,
) -> Replica:
    """A real router replica over ``workers`` (``StaticView``: ``TWO_WORKERS`` unless given) or ``view``,
    built as the deployment builds one. ``config`` overrides :class:`RouterConfig`'s fields, groups as
    dicts (``lease_s=60, budget={"prefill_tokens_in_flight": 100}, queue={"timeout_s": 0.3}``); with a
    ``replica_id`` it shares budgets through a ledger on ``config``'s Redis (tagged with
    :data:`LEDGER_SECRET`; the caller starts it). Its KV index is fed by the test unless
    ``follow_kv_events``. Unless ``config`` sets ``disaggregation``, every request goes through a
    prefill worker (``min_uncached_tokens`` 0), as most tests of placement expect."""
    from tandem.router.replica import LedgerIdentity, build_replica
    from tandem.router.settings import RouterConfig

    config.setdefault("disaggregation", {"min_uncached_tokens": 0})
    return build_replica(
        RouterConfig.model_validate(config),
        view or StaticView(workers),
        metrics=metrics,
        ledger=LedgerIdentity(replica_id, LEDGER_SECRET) if replica_id else None,
        follow_kv_events=follow_kv_events,
        clock=clock,
    )


async def gauges_flushed() -> None:
    """Wait until gauges noted by a placement or a release are set (they go FLUSH_S later, together)."""
    await asyncio.sleep(2 * FLUSH_S)


def make_scheduler(workers: list[WorkerRecord] | None = None, **overrides: Any) -> Scheduler:
    """The scheduler of :func:`make_replica` (same arguments)."""
    return make_replica(workers, **overrides).scheduler


#: What the servicer hands out unless told otherwise.
DEFAULT_PLACEMENT = router_pb2.Placement(
    prefill=router_pb2.WorkerRef(worker_id="p0", role="prefill", address="h:1"),
    decode=router_pb2.WorkerRef(worker_id="d0", role="decode", address="h:2"),
    lease_s=600,
)


@dataclass
class FakeRouterServicer(router_pb2_grpc.RouterServicer):
    """Answers like the deployment: one placement (its ``reason`` lists the excluded
    workers, then ``prefill_done_on=<id>`` for a decode-only Schedule, whose reply names that
    prefill worker and is never a local prefill, then ``local_prefill_only`` for a local prefill's
    replacement, whose reply is a local prefill), or the error scripted for the request's model,
    or for every request; records what it was sent and the metadata that came with it."""

    placement: router_pb2.Placement = field(default_factory=lambda: DEFAULT_PLACEMENT)
    #: Handed out first, one per Schedule, before ``placement`` (e.g. a dead worker, then a live one).
    first_placements: list[router_pb2.Placement] = field(default_factory=list)
    #: Errors by model name, sent with the trailers the real deployment would send.
    errors_by_model: dict[str, TandemError] = field(default_factory=dict)
    #: Raised for every Schedule while set.
    error: TandemError | None = None
    #: Release answers found=True for these request ids only (None: for every id).
    known_request_ids: set[str] | None = None
    scheduled: list[router_pb2.ScheduleRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)

    async def Schedule(self, request: router_pb2.ScheduleRequest, context: Any) -> router_pb2.Placement:
        self.scheduled.append(request)
        self._record_metadata(context)
        error = self.errors_by_model.get(request.model) or self.error
        if error is not None:
            code, trailers = status_for_error(error)
            context.set_trailing_metadata(trailers)
            await context.abort(code, str(error))
        reply = router_pb2.Placement()
        reply.CopyFrom(self.first_placements.pop(0) if self.first_placements else self.placement)
        reply.request_id = request.request_id
        reply.reason = ",".join(request.exclude_worker_ids)
        if request.prefill_done_on_worker_id:
            # Decode-only: the prefill already ran there (the real router fills in its address from
            # the registry; here, from the scripted placement when it names the same worker).
            reply.reason += f";prefill_done_on={request.prefill_done_on_worker_id}"
            reply.local_prefill = False
            if reply.prefill.worker_id != request.prefill_done_on_worker_id:
                reply.prefill.CopyFrom(
                    router_pb2.WorkerRef(worker_id=request.prefill_done_on_worker_id, role="prefill")
                )
        if request.local_prefill_only:
            # A local prefill's replacement: the decode worker alone, as the real router places it.
            reply.reason += ";local_prefill_only"
            reply.local_prefill = True
            reply.ClearField("prefill")
        return reply

    async def Release(self, request: router_pb2.RouterReleaseRequest, context: Any) -> router_pb2.RouterReleaseResponse:
        self.released.append(request.request_id)
        self._record_metadata(context)
        known = self.known_request_ids is None or request.request_id in self.known_request_ids
        return router_pb2.RouterReleaseResponse(found=known)

    def _record_metadata(self, context: Any) -> None:
        self.metadata.append({k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)})


@asynccontextmanager
async def serving_router(servicer: FakeRouterServicer) -> AsyncIterator[str]:
    """Serves ``servicer`` on a free loopback port; yields its address."""
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


#: A router process (Ray, Serve, two replicas at most) is ready within this on a busy 2-core machine.
ROUTER_STARTUP_TIMEOUT_S = 180.0
ROUTER_STOP_TIMEOUT_S = 30.0


@dataclass
class RouterProcess:
    """``python -m tandem.router`` started by :func:`router_process`."""

    proc: subprocess.Popen[bytes]
    address: str
    key_prefix: str
    metrics_port: int
    log_path: Path
    startup_s: float
    #: The router's own JSON "router ready" log line.
    ready_line: dict[str, object]


@contextmanager
def router_process(log_dir: Path, redis_url: str, *, key_prefix: str, **settings: str) -> Iterator[RouterProcess]:
    """The real router (Ray Serve) on free ports, its registry under ``key_prefix``; ``settings`` are
    more of its environment variables without the ``TANDEM_ROUTER_`` prefix (``NUM_REPLICAS="2"``).
    Stopped with SIGTERM (a router that ignores it fails the test) and its Redis keys deleted."""
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("TANDEM_ROUTER_")}
    env.update(
        TANDEM_ROUTER_GRPC_PORT=str(grpc_port),
        TANDEM_ROUTER_HTTP_PORT=str(http_port),
        TANDEM_ROUTER_METRICS_PORT=str(metrics_port),
        TANDEM_ROUTER_REDIS__URL=redis_url,
        TANDEM_ROUTER_REGISTRY__KEY_PREFIX=key_prefix,
        TANDEM_ROUTER_RAY_NUM_CPUS="2",
    )
    secret_path = log_dir / "router-ledger-secret"  # several replicas refuse to start without one
    secret_path.write_bytes(LEDGER_SECRET)
    secret_path.chmod(0o600)
    env["TANDEM_ROUTER_LEDGER__SECRET_FILE"] = str(secret_path)
    env.update({f"TANDEM_ROUTER_{name}": value for name, value in settings.items()})
    log_path = log_dir / "router.log"
    started_s = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.router"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = _wait_for_ready_line(proc, log_path)
        yield RouterProcess(
            proc, f"127.0.0.1:{grpc_port}", key_prefix, metrics_port, log_path, time.monotonic() - started_s, ready
        )
    finally:
        _stop(proc, log_path)
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(f"{key_prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def _wait_for_ready_line(proc: subprocess.Popen[bytes], log_path: Path) -> dict[str, object]:
    deadline_s = time.monotonic() + ROUTER_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline_s:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"router ready"' in line:
                ready: dict[str, object] = json.loads(line)
                return ready
        if proc.poll() is not None:
            pytest.fail(f"router exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.25)
    pytest.fail(f"router not ready after {ROUTER_STARTUP_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=ROUTER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail(f"router ignored SIGTERM for {ROUTER_STOP_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-4000:]}")
