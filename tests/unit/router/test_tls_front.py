"""The router's TLS front (tandem.router.tls_front): the gateway → router hop over mutual TLS.

In front of an in-process stand-in of Serve's gRPC proxy (tests.kit.router), the
gateway's own client (RouterClient with the gateway's certificate from the local
CA) schedules and releases through it as it would through the proxy: the reply,
the metadata that picks the application and the replica, the deadline and the
error trailers pass unchanged. Any other role's certificate gets
PERMISSION_DENIED, and a plaintext client reaches nothing; neither reaches the
router behind it. The real router behind the front (Ray Serve) is measured by
benchmarks/bench_router_tls.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from tandem.common.errors import BackendUnavailableError, NoCapacityError
from tandem.common.identity import DENIED_MESSAGE, ROLES
from tandem.common.router_client import RouterClient
from tandem.common.router_wire import APPLICATION_NAME, METADATA_APPLICATION
from tandem.common.tls import TLSSettings, aio_channel
from tandem.local.pki import ensure_pki
from tandem.router.tls_front import TLSFrontSettings, start_front
from tandem.v1 import router_pb2, router_pb2_grpc
from tests.kit.net import free_port
from tests.kit.router import FakeRouterServicer, serving_router

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


@dataclass
class Front:
    address: str
    router: FakeRouterServicer
    pki: dict[str, TLSSettings]


@pytest_asyncio.fixture
async def front(tmp_path: Path) -> AsyncIterator[Front]:
    pki = ensure_pki(tmp_path / "pki")
    router = FakeRouterServicer(errors_by_model={"full": NoCapacityError("no decode worker", retry_after_s=3)})
    async with serving_router(router) as upstream:
        settings = TLSFrontSettings(
            grpc_port=int(upstream.rsplit(":", 1)[1]), tls_host="127.0.0.1", tls_port=free_port(), tls=pki["router"]
        )
        server, forwarder = await start_front(settings)
        try:
            yield Front(f"127.0.0.1:{settings.tls_port}", router, pki)
        finally:
            await server.stop(grace=None)
            await forwarder.aclose()


async def test_the_gateway_schedules_and_releases_through_the_front(front: Front) -> None:
    async with RouterClient(front.address, timeout_s=5, tls=front.pki["gateway"]) as client:
        placement = await client.schedule("req-1", "m", num_prompt_tokens=5, exclude_worker_ids=["p9"], priority=2)
        released = await client.release("req-1")
        with pytest.raises(NoCapacityError, match="no decode worker") as full:
            await client.schedule("req-2", "full", num_prompt_tokens=5)
    assert (placement.prefill.worker_id, placement.decode.worker_id, placement.reason) == ("p0", "d0", "p9")
    assert released is True and front.router.released == ["req-1"]
    assert full.value.retry_after_s == 3  # the tandem-error trailer came back through the front
    first = front.router.metadata[0]
    assert first[METADATA_APPLICATION] == APPLICATION_NAME and first["session_id"] == "req-1"
    assert first["tandem-priority"] == "2"
    assert [r.request_id for r in front.router.scheduled] == ["req-1", "req-2"]


@pytest.mark.parametrize("role", [r for r in ROLES if r != "gateway"])
async def test_no_other_role_gets_through(role: str, front: Front) -> None:
    async with aio_channel(front.address, front.pki[role]) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for call in (
            stub.Schedule(router_pb2.ScheduleRequest(request_id="r", model="m"), timeout=5),
            stub.Release(router_pb2.RouterReleaseRequest(request_id="r"), timeout=5),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert refused.value.details() == DENIED_MESSAGE
    assert front.router.scheduled == [] and front.router.released == []


async def test_a_plaintext_client_reaches_nothing(front: Front) -> None:
    async with RouterClient(front.address, timeout_s=2) as client:
        with pytest.raises(BackendUnavailableError):
            await client.schedule("req-1", "m", num_prompt_tokens=5)
    assert front.router.scheduled == []
