"""KubeClient against a recording HTTP server: pools are created with POST and then kept with
server-side apply (so a key the operator stops setting is removed, not left behind by a merge
patch); replicas alone go by merge patch."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from tandem_operator.kube import FIELD_MANAGER, KubeClient

pytestmark = pytest.mark.asyncio

DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "chat-decode", "namespace": "ns", "labels": {"a": "1"}},
    "spec": {"replicas": 2, "template": {"spec": {"imagePullSecrets": [{"name": "cred"}]}}},
}


class Recorder:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str, dict[str, str], Any]] = []
        self.exists = False

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text()
        self.requests.append(
            (request.method, request.path, request.headers.get("Content-Type", ""), dict(request.query),
             json.loads(body) if body else None)
        )
        if request.method == "GET":
            return web.json_response(DEPLOYMENT) if self.exists else web.json_response({}, status=404)
        self.exists = True
        return web.json_response(json.loads(body) if body else {})


@pytest.fixture
async def server() -> AsyncIterator[tuple[Recorder, KubeClient]]:
    recorder = Recorder()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = KubeClient(f"http://127.0.0.1:{port}", insecure=True)
    yield recorder, client
    await client.close()
    await runner.cleanup()


async def test_create_then_server_side_apply(server: tuple[Recorder, KubeClient]) -> None:
    recorder, client = server
    await client.apply(DEPLOYMENT)
    method, path, _, _, body = recorder.requests[-1]
    assert (method, path, body) == ("POST", "/apis/apps/v1/namespaces/ns/deployments", DEPLOYMENT)

    without_secret = json.loads(json.dumps(DEPLOYMENT))
    del without_secret["spec"]["template"]["spec"]["imagePullSecrets"]
    await client.apply(without_secret)
    method, path, content_type, query, body = recorder.requests[-1]
    assert (method, path) == ("PATCH", "/apis/apps/v1/namespaces/ns/deployments/chat-decode")
    assert content_type == "application/apply-patch+yaml"
    assert query == {"fieldManager": FIELD_MANAGER, "force": "true"}
    # The whole object, as the operator wants it now: the API server drops what this manager no longer sets.
    assert body == without_secret


async def test_replicas_alone_go_by_merge_patch(server: tuple[Recorder, KubeClient]) -> None:
    recorder, client = server
    recorder.exists = True
    await client.patch("apps/v1", "Deployment", "ns", "chat-decode", {"spec": {"replicas": 3}})
    method, _, content_type, _, body = recorder.requests[-1]
    assert (method, content_type, body) == ("PATCH", "application/merge-patch+json", {"spec": {"replicas": 3}})
