"""A ``tandem.v1.Router`` gRPC servicer and the server around it: stands in for
the router deployment in tests of its clients (``RouterClient``, the gateway)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.common.errors import TandemError
from tandem.common.router_wire import status_for_error
from tandem.v1 import router_pb2, router_pb2_grpc

#: What the servicer hands out unless told otherwise.
DEFAULT_PLACEMENT = router_pb2.Placement(
    prefill=router_pb2.WorkerRef(worker_id="p0", role="prefill", address="h:1"),
    decode=router_pb2.WorkerRef(worker_id="d0", role="decode", address="h:2"),
    lease_s=600,
)


@dataclass
class FakeRouterServicer(router_pb2_grpc.RouterServicer):
    """Answers like the deployment: one placement (its ``reason`` lists the excluded
    workers), or the error scripted for the request's model, or for every request;
    records what it was sent and the metadata that came with it."""

    placement: router_pb2.Placement = field(default_factory=lambda: DEFAULT_PLACEMENT)
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
        reply.CopyFrom(self.placement)
        reply.request_id = request.request_id
        reply.reason = ",".join(request.exclude_worker_ids)
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
