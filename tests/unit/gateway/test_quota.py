"""Token quotas and concurrency caps: 429 before any SSE byte, with Retry-After
and x-ratelimit-* headers; reconciliation after a disconnect; and no overspend
when two gateway processes race for one tenant's tokens through one Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kit.gateway import DecodeStep, placement
from tests.kit.net import free_port
from tests.kit.redis import delete_prefix

pytestmark = [pytest.mark.timeout(90)]

MODEL = "SmolLM2-135M-Instruct"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_over_quota_stream_gets_429_with_headers_before_any_sse_byte(edge: Any) -> None:
    key = await edge.tenant("acme", output_tokens_per_minute=6, input_tokens_per_minute=1000)
    first = await edge.client.post("/v1/chat/completions", json=chat(stream=True), headers=bearer(key))
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-output-tokens"] == "6"
    assert int(first.headers["x-ratelimit-remaining-output-tokens"]) <= 2
    assert "x-ratelimit-reset-tokens" in first.headers
    second = await edge.client.post("/v1/chat/completions", json=chat(stream=True), headers=bearer(key))
    assert second.status_code == 429
    assert second.headers["content-type"].startswith("application/json")
    assert int(second.headers["retry-after"]) >= 1
    assert second.headers["x-ratelimit-limit-tokens"] == "1006"
    error = second.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens"
    too_big = await edge.client.post("/v1/chat/completions", json=chat(max_tokens=7), headers=bearer(key))
    assert too_big.status_code == 429 and "Request too large" in too_big.json()["error"]["message"]
    assert len(edge.router.schedule_calls) == 1


async def test_concurrency_cap(edge: Any, edge_url: str) -> None:
    key = await edge.tenant("acme", max_concurrent_streams=1)
    edge.decode.decode_hang_after = 1
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers=bearer(key)) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.status_code == 200
            blocked = await client.post("/v1/chat/completions", json=chat())
            assert blocked.status_code == 429
            assert blocked.json()["error"]["type"] == "requests"
            assert blocked.headers["x-ratelimit-remaining-streams"] == "0"
            # OpenAI's *-requests headers mean requests per minute, which Tandem does not limit: not sent.
            assert "x-ratelimit-remaining-requests" not in blocked.headers
            # A slot frees when any stream ends, not when a lease runs out: retry soon.
            assert blocked.headers["retry-after"] == "1"
    # The hung stream ends once a heartbeat meets the closed connection: allow a loaded CI host time.
    await edge.settled(timeout_s=20.0)
    edge.decode.decode_hang_after = None
    assert (await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200


async def test_disconnect_reconciles_quota_and_records_usage(edge: Any, edge_url: str, wait: Any) -> None:
    key = await edge.tenant("acme", output_tokens_per_minute=100)
    edge.decode.decode_hang_after = 1  # the prefill's token and " world", then a stall until cancelled
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers=bearer(key)) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=50)) as r:
            assert r.status_code == 200
            num_deltas = 0
            async for line in r.aiter_lines():
                num_deltas += line.startswith("data: ")
                if num_deltas >= 3:  # role, "Hello", " world"
                    break
    await wait(edge.decode.decode_cancelled, 3)
    await edge.settled()
    # 50 were reserved, 2 generated: 48 came back (a little refill may have come in too).
    bucket = await edge.redis.hgetall(f"{edge.key_prefix}:gw:quota:acme:out")
    assert 98 <= float(bucket["tokens"]) <= 100
    assert await edge.redis.zcard(f"{edge.key_prefix}:gw:quota:acme:streams") == 0
    usage = (await edge.client.get("/v1/usage", headers=bearer(key))).json()["total"]
    assert usage["requests"] == 1 and usage["aborted_requests"] == 1
    assert usage["completion_tokens"] == 2 and usage["prompt_tokens"] > 0


# --- two gateway processes, one Redis -----------------------------------------------------------------------


async def start_gateway_process(
    tokenizer_dir: Path, router_address: str, key_prefix: str, log_path: Path, **env: str
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    child_env.update(
        {
            "TANDEM_GATEWAY_HOST": "127.0.0.1",
            "TANDEM_GATEWAY_PORT": str(port),
            "TANDEM_GATEWAY_MODEL_DIR": str(tokenizer_dir),
            "TANDEM_GATEWAY_SERVED_MODEL_NAME": MODEL,
            "TANDEM_GATEWAY_MAX_MODEL_LEN": "64",
            "TANDEM_GATEWAY_ROUTER_ADDRESS": router_address,
            "TANDEM_GATEWAY_TENANCY__KEY_PREFIX": key_prefix,
            "TANDEM_GATEWAY_REGISTRY__KEY_PREFIX": key_prefix,
            **env,
        }
    )
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.gateway"], env=child_env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if (await client.get(f"{url}/healthz", timeout=1)).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    proc.kill()
    raise AssertionError("gateway did not start:\n" + log_path.read_text()[-3000:])


@pytest.fixture
async def gateway_processes(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    procs: list[subprocess.Popen[bytes]] = []

    async def start(*args: Any, **kwargs: Any) -> tuple[subprocess.Popen[bytes], str]:
        proc, url = await start_gateway_process(*args, **kwargs)
        procs.append(proc)
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.slow
async def test_two_gateway_processes_never_overspend(
    tokenizer_dir: Path, start_worker: Any, start_router: Any, gateway_processes: Any, tmp_path: Path
) -> None:
    import uuid

    from tandem.gateway.redis_client import connect
    from tandem.gateway.tenancy.models import Tenant
    from tandem.gateway.tenancy.store import TenantStore

    max_tokens, capacity = 10, 40
    prefill = await start_worker("prefill-0")
    decode = await start_worker(
        "decode-0",
        decode_steps=[DecodeStep("x", [5]) for _ in range(max_tokens - 2)] + [DecodeStep("y", [6], "length")],
        decode_step_delay_s=0.02,
    )
    router, router_address = await start_router(placement(prefill, decode))
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    redis_client = connect("redis://127.0.0.1:6379/0", timeout_s=2)
    store = TenantStore(redis_client, key_prefix=prefix)
    try:
        await store.put_tenant(Tenant(id="racer", output_tokens_per_minute=capacity))
        _, key = await store.create_key("racer")
        (_, url_a), (_, url_b) = await asyncio.gather(
            # A generous Redis deadline: on a loaded CI box a 0.5 s one turns into (correct) fail-closed 503s.
            gateway_processes(
                tokenizer_dir, router_address, prefix, tmp_path / "a.log", TANDEM_GATEWAY_TENANCY__REDIS_TIMEOUT_S="5"
            ),
            gateway_processes(
                tokenizer_dir, router_address, prefix, tmp_path / "b.log", TANDEM_GATEWAY_TENANCY__REDIS_TIMEOUT_S="5"
            ),
        )
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=30, headers=bearer(key)) as client:
            responses = await asyncio.gather(
                *[
                    client.post(f"{url}/v1/chat/completions", json=chat(max_tokens=max_tokens))
                    for _ in range(12)
                    for url in (url_a, url_b)
                ]
            )
        elapsed_s = time.monotonic() - started
        ok = [r for r in responses if r.status_code == 200]
        limited = [r for r in responses if r.status_code == 429]
        assert len(ok) + len(limited) == len(responses), {r.status_code for r in responses}
        assert all(int(r.headers["retry-after"]) >= 1 for r in limited)
        produced = sum(r.json()["usage"]["completion_tokens"] for r in ok)
        refill = capacity * elapsed_s / 60
        assert produced <= capacity + refill + max_tokens, (produced, elapsed_s)
        assert len(ok) >= capacity // max_tokens  # the bucket was actually used
        assert len(router.scheduled) == len(ok)  # a refused request never reached the router
    finally:
        await delete_prefix(redis_client, prefix)
        await redis_client.aclose()


async def test_a_tenant_whose_output_quota_is_below_the_default_answer_length_is_served(edge: Any) -> None:
    """Without max_tokens the gateway reserves its default answer length; a tenant allowed fewer output
    tokens per minute would be refused forever. The default is capped at the tenant's quota instead."""
    key = await edge.tenant("small", output_tokens_per_minute=20)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens
    response = await edge.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    (call,) = edge.router.schedule_calls
    assert call["max_tokens"] <= 20
