"""A Redis that refuses writes (full at maxmemory with noeviction) turns a request away with 503
before any token, for limited and unlimited tenants alike: served requests must be billable."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.quota.redis_quota import RedisQuota
from tandem.gateway.redis_client import connect
from tandem.gateway.tenancy.models import TenantPolicy
from tandem.gateway.usage import UsageRecord, UsageStore
from tests.kit.redis import start_redis


@pytest_asyncio.fixture
async def full_redis(unused_tcp_port: int) -> AsyncIterator[str]:
    proc = start_redis(unused_tcp_port, "--appendonly", "no", "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    url = f"redis://127.0.0.1:{unused_tcp_port}/0"
    client = connect(url, timeout_s=2.0)
    try:
        with pytest.raises(Exception, match="maxmemory"):  # fill it to the brim
            for i in range(10_000):
                await client.set(f"filler:{i}", "x" * 4096)
        await client.config_set("maxmemory", "1mb")  # and keep it over the brim, whatever was freed since
        yield url
    finally:
        await client.aclose()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "policy",
    [TenantPolicy(), TenantPolicy(output_tokens_per_minute=1000, max_concurrent_streams=4)],
    ids=["unlimited", "limited"],
)
async def test_a_full_redis_turns_the_request_away_before_any_token(full_redis: str, policy: TenantPolicy) -> None:
    """What the route handler does before generating: admit (limited tenants are charged there), then
    open the usage record (every tenant). One of the two must refuse."""
    client = connect(full_redis, timeout_s=2.0)
    try:
        quota = RedisQuota(client, key_prefix="t", lease_s=60)
        usage = UsageStore(client, key_prefix="t", replica_id="gw-1")
        with pytest.raises(BackendUnavailableError, match="refuses writes"):
            admission = await quota.admit("acme", policy, "req-1", 10, 10)
            assert not admission.charged  # only the unlimited tenant gets this far
            await usage.open(UsageRecord("acme", "m", 10, 0, 0, aborted=False, request_id="req-1"))
    finally:
        await client.aclose()


async def test_a_usage_write_refused_is_an_outage_not_a_crash(full_redis: str) -> None:
    client = connect(full_redis, timeout_s=2.0)
    try:
        store = UsageStore(client, key_prefix="t", retry_for_s=0.5)
        await store.record(
            UsageRecord("acme", "m", 1, 1, 0, aborted=False, request_id="r")
        )  # logged, retried, given up
    finally:
        await client.aclose()
