"""The gateway's Redis client against a real redis-server that restarts: the
pooled connections it left dead cost no request, and a Redis that is down is
still a quick BackendUnavailableError."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.redis_client import connect, redis_errors
from tests.kit.redis import start_redis

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


async def lookups(client: object, n: int) -> list[str]:
    """``n`` concurrent key lookups, as ``n`` concurrent requests make them (one pooled connection each)."""

    async def one(i: int) -> str:
        try:
            with redis_errors("key lookup"):
                await client.hgetall(f"tandem-unit:key:{i}")  # type: ignore[attr-defined]
        except BackendUnavailableError as exc:
            return str(exc)
        return "ok"

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_connections_left_dead_by_a_redis_restart_fail_no_request(unused_tcp_port: int) -> None:
    server = start_redis(unused_tcp_port, "--appendonly", "no")
    client = connect(f"redis://127.0.0.1:{unused_tcp_port}/0", timeout_s=2.0)
    try:
        assert await lookups(client, 4) == ["ok"] * 4  # four connections now idle in the pool
        server.kill()  # SIGKILL: the pooled connections are dead without a goodbye
        server.wait()
        server = start_redis(unused_tcp_port, "--appendonly", "no")
        assert await lookups(client, 1) == ["ok"]
        assert await lookups(client, 4) == ["ok"] * 4
    finally:
        server.kill()
        server.wait()
        await client.aclose()


async def test_a_redis_that_is_down_is_a_quick_backend_unavailable(unused_tcp_port: int) -> None:
    client = connect(f"redis://127.0.0.1:{unused_tcp_port}/0", timeout_s=2.0)
    try:
        started = time.monotonic()
        (error,) = await lookups(client, 1)
        assert error.startswith("redis unavailable during key lookup: ConnectionError: "), error
        assert time.monotonic() - started < 1.0  # refused at once, retried once at once: no timeout waited
    finally:
        await client.aclose()


@pytest.fixture
def unused_tcp_port() -> int:
    from tests.kit.net import free_port

    return free_port()
