"""Streaming on real networks: heartbeats while queued, the opt-in stage
breakdown, a slow reader cut off with its generation cancelled, Redis down
(503) and back (recovers by itself), and SIGTERM draining a real gateway process."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.gateway.app import build_app
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.sse import HEARTBEAT as HEARTBEAT_BYTES
from tests.kit.gateway import DecodeStep, FakeReadiness, placement
from tests.kit.net import free_port, start_stream_then_stop_reading
from tests.kit.redis import start_redis

from .conftest import gateway_settings
from .test_quota import start_gateway_process

pytestmark = [pytest.mark.timeout(90)]

MODEL = "SmolLM2-135M-Instruct"
HEARTBEAT = HEARTBEAT_BYTES.decode()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 8, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class SlowRouter:
    """Wraps a scheduler and delays Schedule, like a router admission queue under load."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    async def schedule(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(self.delay_s)
        return await self.inner.schedule(*args, **kwargs)

    async def release(self, request_id: str) -> None:
        await self.inner.release(request_id)


async def test_heartbeats_while_queued_and_timings_only_when_asked(edge: Any) -> None:
    key = await edge.tenant("acme")
    edge.app.state.services.orchestrator._placer._router = SlowRouter(edge.router, 1.0)
    response = await edge.client.post(
        "/v1/chat/completions", json=chat(stream=True), headers={**bearer(key), "X-Tandem-Timings": "1"}
    )
    assert response.status_code == 200
    body = response.text
    assert body.startswith(HEARTBEAT)  # the heartbeat interval is 0.3 s here, the queue 1 s
    assert body.lstrip("\n").startswith("data: ")  # heartbeats are blank lines only
    blocks = [b for b in body.split("\n\n") if b]
    (timings_block,) = [b for b in blocks if b.startswith("event: tandem.timings")]
    timings = json.loads(timings_block.split("data: ", 1)[1])
    assert blocks[-2:] == ["data: [DONE]", timings_block]  # after [DONE], where SDKs have stopped reading
    assert {"auth", "tokenize", "quota", "schedule", "prefill", "first_byte_write", "decode"} <= set(
        timings["stages_ms"]
    )
    assert timings["stages_ms"]["schedule"] >= 900
    assert timings["worker"]["num_cached_tokens"] == 2

    plain = await edge.client.post("/v1/chat/completions", json=chat(stream=True), headers=bearer(key))
    assert "tandem" not in plain.text and plain.text.startswith(HEARTBEAT)
    unary = await edge.client.post(
        "/v1/chat/completions", json=chat(), headers={**bearer(key), "X-Tandem-Timings": "1"}
    )
    assert "prefill" in unary.json()["tandem_timings"]["stages_ms"]
    edge.app.state.services.orchestrator._placer._router = edge.router
    assert (
        "tandem_timings"
        not in (await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).json()
    )
    metrics = (await edge.client.get("/metrics")).text
    assert 'tandem_gateway_stage_seconds_count{stage="auth"}' in metrics


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    return {"stream": {"max_buffered_bytes": 4096, "slow_reader_timeout_s": 0.5}}


async def test_slow_reader_is_cut_off_and_its_generation_cancelled(edge: Any, edge_url: str, wait: Any) -> None:
    key = await edge.tenant("acme")
    edge.decode.decode_steps = [DecodeStep("x" * 65536, [5]) for _ in range(500)]  # ~32 MB if all were sent
    host, port = edge_url.removeprefix("http://").split(":")
    body = json.dumps(chat(stream=True, max_tokens=40)).encode()
    sock = await start_stream_then_stop_reading(
        host, int(port), "/v1/chat/completions", body, {"Authorization": f"Bearer {key}"}
    )
    # ... and never read again.
    # The generation is cancelled: the decode call is dropped and both workers get Abort (KV freed).
    await wait(edge.decode.aborted_event, 20)
    await wait(edge.prefill.aborted_event, 5)
    assert edge.metrics.registry.get_sample_value("tandem_gateway_slow_reader_disconnects_total") == 1
    sock.close()


# --- Redis down and back -----------------------------------------------------------------------------------


def _start_redis(port: int, data_dir: Path) -> subprocess.Popen[bytes]:
    return start_redis(port, "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data_dir))


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
async def test_redis_down_is_503_and_the_gateway_recovers_by_itself(
    start_worker: Any, fake_router: Any, prompt_tokenizer: Any, tmp_path: Path
) -> None:
    from tandem.gateway.redis_client import connect
    from tandem.gateway.tenancy.models import Tenant
    from tandem.gateway.tenancy.store import TenantStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    redis_proc = _start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    prefill, decode = await start_worker("prefill-0"), await start_worker("decode-0")
    fake_router.placements.append(placement(prefill, decode))
    settings = gateway_settings(
        redis={"url": url}, auth={"mode": "api_key", "cache_s": 0}, tenancy={"redis_timeout_s": 0.3}
    )
    app = build_app(
        settings,
        router=fake_router,
        tokenizer=prompt_tokenizer,
        readiness=FakeReadiness(),
        metrics=GatewayMetrics(),
    )
    admin_client = connect(url, timeout_s=2)
    await TenantStore(admin_client, key_prefix="tandem").put_tenant(Tenant(id="acme", output_tokens_per_minute=1000))
    _, key = await TenantStore(admin_client, key_prefix="tandem").create_key("acme")
    await admin_client.aclose()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", headers=bearer(key), timeout=10
        ) as client:
            assert (await client.post("/v1/chat/completions", json=chat())).status_code == 200
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
            down = await client.post("/v1/chat/completions", json=chat())
            assert down.status_code == 503
            assert down.json()["error"]["code"] == "backend_unavailable"
            assert int(down.headers["retry-after"]) >= 1
            assert len(fake_router.schedule_calls) == 1  # fail closed: nothing ran
            redis_proc = _start_redis(port, tmp_path)
            deadline = time.monotonic() + 10
            status = 0
            while time.monotonic() < deadline and status != 200:
                status = (await client.post("/v1/chat/completions", json=chat())).status_code
                await asyncio.sleep(0.1)
            assert status == 200
    finally:
        redis_proc.kill()
        redis_proc.wait(timeout=10)


# --- SIGTERM drain of a real gateway process ----------------------------------------------------------------


@pytest.mark.slow
async def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(
    tokenizer_dir: Path, start_worker: Any, start_router: Any, tmp_path: Path
) -> None:
    import uuid

    from tandem.common.registry import WorkerRecord, WorkerRegistry

    prefill = await start_worker("prefill-0")
    decode = await start_worker(
        "decode-0",
        decode_steps=[DecodeStep(" x", [5]) for _ in range(7)] + [DecodeStep("!", [6], "stop")],
        decode_step_delay_s=0.25,
    )
    _, router_address = await start_router(placement(prefill, decode))
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    registry = WorkerRegistry("redis://127.0.0.1:6379/0", key_prefix=prefix, ttl_s=120)
    for worker, role in ((prefill, "prefill"), (decode, "decode")):
        await registry.heartbeat(
            WorkerRecord(worker_id=worker.worker_id, role=role, model=MODEL, address=worker.address)
        )
    # /metrics on a port of its own (as in Kubernetes, where only Prometheus may reach that port): two
    # servers in one process, and the SIGTERM still drains the API's.
    metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
    proc, url = await start_gateway_process(
        tokenizer_dir,
        router_address,
        prefix,
        tmp_path / "gw.log",
        TANDEM_GATEWAY_AUTH__MODE="disabled",
        TANDEM_GATEWAY_STREAM__DRAIN_GRACE_S="20",
        TANDEM_GATEWAY_METRICS_PORT=metrics_url.split(":")[2].split("/")[0],
    )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/readyz")).status_code == 200
            assert (await client.get("/metrics")).status_code == 404  # not beside the API
            assert "tandem_gateway_draining 0.0" in (await client.get(metrics_url)).text

            async def stream() -> str:
                async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                    assert r.status_code == 200
                    return "".join([chunk async for chunk in r.aiter_text()])

            streams = [asyncio.create_task(stream()) for _ in range(2)]
            await asyncio.sleep(0.5)  # both streaming now (2 s each)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            ready = await client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            refused = await client.post("/v1/chat/completions", json=chat())
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            # While it drains, the scrape port answers: the draining gauge and the two streams' first tokens.
            scraped = (await client.get(metrics_url)).text
            bodies = await asyncio.gather(*streams)
        assert "tandem_gateway_draining 1.0" in scraped, scraped[:2000]
        assert any(
            line.startswith("tandem_gateway_time_to_first_token_seconds_count") and float(line.split()[-1]) >= 2
            for line in scraped.splitlines()
        ), scraped[:2000]
        for body in bodies:
            assert body.rstrip().endswith("data: [DONE]") and '"finish_reason":"stop"' in body
        assert proc.wait(timeout=20) == 0
        with pytest.raises(httpx.ConnectError):  # the scrape port closed with the process
            httpx.get(metrics_url, timeout=2)
        log = (tmp_path / "gw.log").read_text()
        assert '"msg": "draining"' in log and '"msg": "drained"' in log
    finally:
        if proc.poll() is None:
            proc.kill()
        from tests.kit.redis import delete_prefix

        await delete_prefix(registry._redis, prefix) if hasattr(registry, "_redis") else None
        await registry.aclose()
