"""Certificates rotate without a restart (tandem.common.tls, docs/security.md).

The local CA's own tool rotates every role's key and certificate on disk
(``python -m tandem.local.pki --rotate``, :func:`tandem.local.pki.main`); a
server that kept running presents the new certificate on its next handshake,
and a client that kept running (the gateway's router client) dials with its
new certificate on its next call. A rotation caught halfway (a new key beside
the old certificate) is not loaded: the server keeps answering with the old
pair until the pair matches again.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from cryptography import x509

from tandem.common.router_client import RouterClient
from tandem.common.tls import CHECK_INTERVAL_S, TLSSettings, add_port
from tandem.local import pki as local_pki
from tandem.v1 import router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


@dataclass
class CallerRecorder(router_pb2_grpc.RouterServicer):
    """Records the serial number of each caller's client certificate."""

    caller_serials: list[int] = field(default_factory=list)

    async def Release(self, request: router_pb2.RouterReleaseRequest, context: Any) -> router_pb2.RouterReleaseResponse:
        (pem,) = context.auth_context()["x509_pem_cert"]
        self.caller_serials.append(x509.load_pem_x509_certificate(pem).serial_number)
        return router_pb2.RouterReleaseResponse(found=False)


@dataclass
class Served:
    address: str
    port: int
    recorder: CallerRecorder
    pki_dir: Path
    roles: dict[str, TLSSettings]


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    pki_dir = tmp_path / "pki"
    roles = local_pki.ensure_pki(pki_dir)
    recorder = CallerRecorder()
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(recorder, server)
    port = add_port(server, "127.0.0.1:0", roles["router"])
    await server.start()
    try:
        yield Served(f"127.0.0.1:{port}", port, recorder, pki_dir, roles)
    finally:
        await server.stop(grace=None)


def _serial_on_disk(path: Path | None) -> int:
    assert path is not None
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def _presented_serial(port: int, client: TLSSettings) -> int:
    """A new TLS connection to the server, as ``client``: the serial of the certificate it presents."""
    context = ssl.create_default_context(cafile=str(client.ca_file))
    context.load_cert_chain(str(client.cert_file), str(client.key_file))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="tandem-internal") as tls_socket:
            der = tls_socket.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_a_running_server_presents_the_rotated_certificate_on_its_next_handshake(served: Served) -> None:
    gateway = served.roles["gateway"]
    before = await asyncio.to_thread(_presented_serial, served.port, gateway)
    assert before == _serial_on_disk(served.roles["router"].cert_file)

    assert local_pki.main(["--dir", str(served.pki_dir), "--rotate"]) == 0

    after = await asyncio.to_thread(_presented_serial, served.port, gateway)
    assert after != before
    assert after == _serial_on_disk(served.roles["router"].cert_file)


async def test_a_running_client_dials_with_its_rotated_certificate(served: Served) -> None:
    async with RouterClient(served.address, timeout_s=5, tls=served.roles["gateway"]) as client:
        await client.release("before")
        first = _serial_on_disk(served.roles["gateway"].cert_file)
        local_pki.rotate(served.pki_dir)
        await asyncio.sleep(CHECK_INTERVAL_S + 0.2)  # the client looks at its files at most this often
        await client.release("after")
    second = _serial_on_disk(served.roles["gateway"].cert_file)
    assert second != first
    assert served.recorder.caller_serials == [first, second]


async def test_a_half_done_rotation_is_not_loaded(served: Served) -> None:
    """A new key beside the old certificate: the server keeps its old pair (handshakes go on) until the
    certificate that matches the key arrives."""
    router = served.roles["router"]
    assert router.key_file is not None
    gateway = served.roles["gateway"]
    before = await asyncio.to_thread(_presented_serial, served.port, gateway)
    stray = local_pki.issue(served.pki_dir / "elsewhere", "router")
    assert stray.key_file is not None
    router.key_file.write_bytes(stray.key_file.read_bytes())  # the key is new, the certificate is not

    assert await asyncio.to_thread(_presented_serial, served.port, gateway) == before

    local_pki.rotate(served.pki_dir, roles=("router",))
    assert await asyncio.to_thread(_presented_serial, served.port, gateway) == _serial_on_disk(router.cert_file)
