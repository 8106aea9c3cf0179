"""The gateway through the router team's real ``RouterClient`` (via the adapter)
against an in-process fake ``tandem.v1.Router`` gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio

from tandem.gateway.app import build_app
from tandem.gateway.scheduler import connect_scheduler
from tandem.gateway.settings import GatewaySettings
from tandem.v1 import router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class FakeRouter(router_pb2_grpc.RouterServicer):
    placement: router_pb2.Placement
    exhausted: bool = False
    scheduled: list[router_pb2.ScheduleRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)

    async def Schedule(self, request: router_pb2.ScheduleRequest, context: Any) -> router_pb2.Placement:
        self.scheduled.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        if self.exhausted:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "all workers busy")
        placement = router_pb2.Placement()
        placement.CopyFrom(self.placement)
        placement.request_id = request.request_id
        return placement

    async def Release(self, request: router_pb2.RouterReleaseRequest, context: Any) -> router_pb2.RouterReleaseResponse:
        self.released.append(request.request_id)
        return router_pb2.RouterReleaseResponse(found=True)


@pytest_asyncio.fixture
async def routed(start_worker: Any, make_placement: Any, prompt_tokenizer: Any) -> AsyncIterator[Any]:
    prefill = await start_worker("prefill-0")
    decode = await start_worker("decode-0")
    router = FakeRouter(placement=make_placement(prefill, decode))
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    scheduler = connect_scheduler(f"127.0.0.1:{port}", timeout_s=2.0)
    settings = GatewaySettings(
        served_model_name=MODEL, max_model_len=64, cleanup_timeout_s=1.0, auth={"mode": "disabled"}
    )

    class Ready:
        async def check(self) -> Any:
            raise AssertionError("not used")

    app = build_app(settings, scheduler=scheduler, tokenizer=prompt_tokenizer, readiness=Ready())
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
        app.router.lifespan_context(app),
    ):
        yield client, router, prefill, decode
    await scheduler.aclose()
    await server.stop(grace=None)


async def test_request_through_real_router_client(routed: Any) -> None:
    client, router, prefill, _ = routed
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello world!"
    (scheduled,) = router.scheduled
    assert scheduled.request_id == response.json()["id"]
    assert scheduled.model == MODEL and scheduled.max_tokens == 5
    assert list(scheduled.prompt_token_ids) == list(prefill.prefill_requests[0].prompt_token_ids)
    assert scheduled.num_prompt_tokens == len(scheduled.prompt_token_ids)
    assert "application" in router.metadata[0]  # Ray Serve's proxy routes by it
    for _ in range(200):
        if router.released:
            break
        await asyncio.sleep(0.01)
    assert router.released == [scheduled.request_id]


async def test_router_saturation_is_503(routed: Any) -> None:
    client, router, prefill, _ = routed
    router.exhausted = True
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 503
    assert "retry-after" in response.headers
    assert response.json()["error"]["code"] == "no_capacity"
    assert prefill.prefill_requests == []
