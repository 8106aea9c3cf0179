"""The gateway's calls to the workers over mutual TLS (docs/security.md).

With the cluster's certificates a call goes through and the worker sees who
called; a gateway without a certificate, with one the cluster's CA did not
sign, or one that does not trust the worker's certificate reaches nothing:
the call fails with UNAVAILABLE (a retryable WorkerUnavailableError) before
any request arrives at the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography import x509
from pydantic import ValidationError

from tandem.common.errors import WorkerUnavailableError
from tandem.common.tls import CHECK_INTERVAL_S, TLSSettings
from tandem.gateway.app import build_app
from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.settings import GatewaySettings
from tandem.gateway.workers import WorkerChannels, map_worker_error
from tandem.local import pki as local_pki
from tandem.v1 import worker_pb2
from tests.kit.gateway import MODEL, FakeReadiness, FakeRouter, FakeWorker, placement

from ..certs import make_pki
from .conftest import gateway_settings

pytestmark = [pytest.mark.timeout(60)]


@dataclass(frozen=True)
class Pki:
    """The cluster's certificates, and the ways a caller can be wrong about them."""

    trusted: TLSSettings
    #: A certificate signed by another CA (it trusts the cluster's CA itself).
    stranger: TLSSettings
    #: The cluster's certificate, but trusting only the other CA (so not the worker).
    distrustful: TLSSettings


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    trusted, stranger = make_pki(tmp_path)
    distrustful = trusted.model_copy(update={"ca_file": tmp_path / "stranger-ca.pem"})
    return Pki(trusted, stranger, distrustful)


@dataclass
class IdentifyingWorker(FakeWorker):
    """A FakeWorker that records the common name of each caller's certificate."""

    callers: list[str] = field(default_factory=list)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: Any) -> worker_pb2.PrefillResponse:
        names = context.auth_context().get("x509_common_name", [b""])
        self.callers.append(names[0].decode())
        return await super().Prefill(request, context)


@pytest.fixture
def start_tls_worker(start_worker: Callable[..., Any]) -> Callable[..., Any]:
    """``await start_tls_worker("prefill-0", tls)`` → an IdentifyingWorker serving over (m)TLS on 127.0.0.1."""

    async def start(worker_id: str, tls: TLSSettings) -> IdentifyingWorker:
        worker = await start_worker(worker_id, tls=tls, worker_cls=IdentifyingWorker)
        assert isinstance(worker, IdentifyingWorker)
        return worker

    return start


def _prefill(request_id: str) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=[5, 6, 7])


async def test_the_cluster_certificate_reaches_the_worker_and_names_the_gateway(
    pki: Pki, start_tls_worker: Callable[..., Any]
) -> None:
    worker = await start_tls_worker("prefill-0", pki.trusted)
    channels = WorkerChannels(pki.trusted)
    try:
        reply = await channels.stub(worker.address).Prefill(_prefill("req-1"), timeout=10)
    finally:
        await channels.aclose()
    assert reply.request_id == "req-1" and reply.first_text == "Hello"
    assert worker.callers == ["trusted-component"]


@pytest.mark.parametrize("caller", ["plaintext", "stranger", "distrustful"])
async def test_callers_without_the_right_certificates_reach_nothing(
    caller: str, pki: Pki, start_tls_worker: Callable[..., Any]
) -> None:
    worker = await start_tls_worker("prefill-0", pki.trusted)
    tls = TLSSettings() if caller == "plaintext" else getattr(pki, caller)
    channels = WorkerChannels(tls)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await channels.stub(worker.address).Prefill(_prefill("req-1"), timeout=10)
    finally:
        await channels.aclose()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert isinstance(map_worker_error(failed.value, role="prefill", address=worker.address), WorkerUnavailableError)
    assert worker.prefill_requests == [] and worker.callers == []


@pytest.mark.parametrize(("gateway_tls", "status"), [("trusted", 200), ("plaintext", 503)])
async def test_the_app_dials_the_workers_with_its_tls_settings(
    gateway_tls: str,
    status: int,
    pki: Pki,
    start_tls_worker: Callable[..., Any],
    prompt_tokenizer: HfPromptTokenizer,
) -> None:
    prefill = await start_tls_worker("prefill-0", pki.trusted)
    decode = await start_tls_worker("decode-0", pki.trusted)
    scheduler = FakeRouter(placements=[placement(prefill, decode)])
    tls = pki.trusted if gateway_tls == "trusted" else TLSSettings()
    app = build_app(
        gateway_settings(tls=tls), router=scheduler, tokenizer=prompt_tokenizer, readiness=FakeReadiness()
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        async with app.router.lifespan_context(app):
            response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    if status == 200:
        assert response.json()["choices"][0]["message"]["content"] == "Hello world!"
        assert prefill.callers == ["trusted-component"]
        assert [r.request_id for r in decode.decode_requests] == [response.json()["id"]]
    else:
        assert response.json()["error"]["type"] == "server_error"
        assert prefill.prefill_requests == [] and decode.decode_requests == []


@dataclass
class SerialRecordingWorker(FakeWorker):
    """A FakeWorker that records the serial number of each caller's certificate."""

    serials: list[int] = field(default_factory=list)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: Any) -> worker_pb2.PrefillResponse:
        (pem,) = context.auth_context()["x509_pem_cert"]
        self.serials.append(x509.load_pem_x509_certificate(pem).serial_number)
        return await super().Prefill(request, context)


async def test_after_a_rotation_the_gateway_dials_with_its_new_certificate(
    tmp_path: Path, start_worker: Callable[..., Any]
) -> None:
    """The local CA's tool rotates the files under a running gateway's WorkerChannels: the next call
    (after the client's once-a-second look at its files) presents the new certificate, no restart."""
    roles = local_pki.ensure_pki(tmp_path / "pki")
    worker = await start_worker("prefill-0", tls=roles["prefill"], worker_cls=SerialRecordingWorker)
    assert isinstance(worker, SerialRecordingWorker)
    channels = WorkerChannels(roles["gateway"])
    try:
        await channels.stub(worker.address).Prefill(_prefill("req-1"), timeout=10)
        local_pki.rotate(tmp_path / "pki")
        await asyncio.sleep(CHECK_INTERVAL_S + 0.2)
        await channels.stub(worker.address).Prefill(_prefill("req-2"), timeout=10)
    finally:
        await channels.aclose()
    first, second = worker.serials
    assert first != second
    assert second == x509.load_pem_x509_certificate(roles["gateway"].cert_file.read_bytes()).serial_number  # type: ignore[union-attr]


def test_tls_settings_come_from_the_environment(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    assert GatewaySettings().tls.enabled is False  # plaintext unless asked for
    monkeypatch.setenv("TANDEM_GATEWAY_TLS__ENABLED", "true")
    with pytest.raises(ValidationError, match="cert_file, key_file, ca_file"):
        GatewaySettings()
    for name in ("cert_file", "key_file", "ca_file"):
        monkeypatch.setenv(f"TANDEM_GATEWAY_TLS__{name.upper()}", str(getattr(pki.trusted, name)))
    monkeypatch.setenv("TANDEM_GATEWAY_TLS__SERVER_NAME_OVERRIDE", "tandem-workers")
    tls = GatewaySettings().tls
    assert tls == pki.trusted.model_copy(update={"server_name_override": "tandem-workers"})
