"""RouterClient against an in-process fake of Serve's gRPC proxy (no Ray)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from tandem.common.errors import BackendUnavailableError, InvalidRequestError, NoCapacityError
from tandem.common.router_client import RouterClient
from tandem.common.router_wire import status_for_error
from tandem.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.asyncio


class FakeRouter(router_pb2_grpc.RouterServicer):
    """Answers like the deployment would; the model name selects the outcome."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def Schedule(
        self, request: router_pb2.ScheduleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.Placement:
        self.metadata.append({k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)})
        errors = {
            "full": NoCapacityError("no decode worker", retry_after_s=3),
            "nope": InvalidRequestError("model 'nope' is not served", code="model_not_found"),
        }
        if request.model in errors:
            code, trailers = status_for_error(errors[request.model])
            context.set_trailing_metadata(trailers)
            await context.abort(code, str(errors[request.model]))
        return router_pb2.Placement(
            request_id=request.request_id,
            prefill=router_pb2.WorkerRef(worker_id="p0", role="prefill", address="h:1"),
            decode=router_pb2.WorkerRef(worker_id="d0", role="decode", address="h:2"),
            lease_s=600,
            reason=",".join(request.exclude_worker_ids),
        )

    async def Release(
        self, request: router_pb2.RouterReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.RouterReleaseResponse:
        self.metadata.append({k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)})
        return router_pb2.RouterReleaseResponse(found=request.request_id == "known")


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[tuple[FakeRouter, str]]:
    server = grpc.aio.server()
    servicer = FakeRouter()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


async def test_schedule_returns_placement_and_sends_serve_metadata(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        placement = await client.schedule("req-1", "m", num_prompt_tokens=5, exclude_worker_ids=["p9"])
    assert (placement.prefill.worker_id, placement.decode.worker_id) == ("p0", "d0")
    assert placement.reason == "p9"
    assert servicer.metadata[0]["application"] == "tandem-router"
    assert servicer.metadata[0]["session_id"] == "req-1"


async def test_release_reports_found_and_sticks_to_the_same_session(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        assert await client.release("known") is True
        assert await client.release("unknown") is False
    assert servicer.metadata[0]["session_id"] == "known"


async def test_no_capacity_maps_to_no_capacity_error(fake: tuple[FakeRouter, str]) -> None:
    _, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        with pytest.raises(NoCapacityError, match="no decode worker") as info:
            await client.schedule("req-1", "full")
    assert info.value.retry_after_s == 3


async def test_unknown_model_maps_to_invalid_request(fake: tuple[FakeRouter, str]) -> None:
    _, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.schedule("req-1", "nope")
    assert info.value.code == "model_not_found"


async def test_unreachable_router_is_backend_unavailable() -> None:
    async with RouterClient(f"127.0.0.1:{closed_port()}", timeout_s=1) as client:
        with pytest.raises(BackendUnavailableError):
            await client.schedule("req-1", "m")


def closed_port() -> int:
    """A port nothing listens on (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port
