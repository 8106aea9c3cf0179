"""Each call to a worker is checked for its caller's role (docs/security.md, tandem.common.identity).

A real WorkerService (over the scripted engine) on the server ``python -m tandem.worker`` builds
(``build_server``), with certificates from the local CA the stack uses (tandem.local.pki): only the
gateway's certificate gets a Decode through; every other role's certificate gets PERMISSION_DENIED
before the engine sees anything, with a message that names nothing inside; a plaintext client
reaches nothing (UNAVAILABLE). Health and load answer any component of the cluster.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.common.identity import DENIED_MESSAGE, ROLES
from tandem.common.tls import TLSSettings, aio_channel
from tandem.local.pki import ensure_pki
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.worker.__main__ import build_server
from tandem.worker.kv_connector.params import KV_LOAD, LoadRecord
from tandem.worker.service import WorkerService
from tandem.worker.settings import WorkerSettings
from tests.unit.worker.fake_engine import ScriptedEngine, decode_outputs, decode_request, handle

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TLSSettings]:
    return ensure_pki(Path(tmp_path_factory.mktemp("pki")))


class Served:
    def __init__(self, address: str, engine: ScriptedEngine) -> None:
        self.address, self.engine = address, engine


@pytest_asyncio.fixture
async def decode_worker(pki: dict[str, TLSSettings]) -> AsyncIterator[Served]:
    record = LoadRecord(num_kv_tokens_loaded=5, num_blocks_loaded=2, num_bytes=5_898_240, seconds=0.25)
    engine = ScriptedEngine(outputs=decode_outputs({KV_LOAD: record.to_dict()}, num_cached_tokens=5))
    settings = WorkerSettings(role="decode", port=0, kv={"host": "127.0.0.1", "port": 1}, tls=pki["decode"])
    service = WorkerService(settings, engine, worker_id="decode-0")
    await service.start()
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server, address = build_server(settings, service, health_servicer)
    await server.start()
    try:
        yield Served(address, engine)
    finally:
        await server.stop(grace=None)


async def _decode(address: str, tls: TLSSettings) -> list[worker_pb2.DecodeChunk]:
    async with aio_channel(address, tls) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return [c async for c in stub.Decode(decode_request(kv_handle=handle(num_tokens=5)), timeout=10)]


async def test_the_gateways_certificate_gets_a_decode_through(
    decode_worker: Served, pki: dict[str, TLSSettings]
) -> None:
    chunks = await _decode(decode_worker.address, pki["gateway"])
    assert "".join(c.text for c in chunks) == " there!"
    assert len(decode_worker.engine.prompts) == 1


@pytest.mark.parametrize("role", [r for r in ROLES if r != "gateway"])
async def test_any_other_roles_certificate_is_refused_before_the_engine(
    role: str, decode_worker: Served, pki: dict[str, TLSSettings]
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _decode(decode_worker.address, pki[role])
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == DENIED_MESSAGE  # no method, role or rule named
    async with aio_channel(decode_worker.address, pki[role]) as channel:
        for call in (
            worker_pb2_grpc.WorkerStub(channel).Abort(worker_pb2.AbortRequest(request_id="r1"), timeout=5),
            worker_pb2_grpc.WorkerStub(channel).PrefetchKV(worker_pb2.PrefetchKVRequest(request_id="r1"), timeout=5),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as also_refused:
                await call
            assert also_refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert decode_worker.engine.prompts == []


async def test_health_and_load_answer_any_component(decode_worker: Served, pki: dict[str, TLSSettings]) -> None:
    for role in ROLES:
        async with aio_channel(decode_worker.address, pki[role]) as channel:
            checked = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            await worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.LoadRequest(), timeout=5)


async def test_a_plaintext_client_reaches_nothing(decode_worker: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _decode(decode_worker.address, TLSSettings())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert decode_worker.engine.prompts == []


async def test_a_certificate_from_another_ca_with_the_gateway_role_reaches_nothing(
    decode_worker: Served, pki: dict[str, TLSSettings], tmp_path: Path
) -> None:
    """The role is read only from a certificate the cluster's CA signed."""
    forged = ensure_pki(tmp_path / "other-ca")["gateway"].model_copy(update={"ca_file": pki["gateway"].ca_file})
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _decode(decode_worker.address, forged)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert decode_worker.engine.prompts == []
