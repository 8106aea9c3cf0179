"""Quotas per model and adapter (issue 40 part 4), RedisQuota against the real Redis: a tenant's
``model_quotas`` give one model or adapter (as requests name it) buckets and stream slots of its own
beside the tenant's; a request refused there leaves nothing charged on the tenant's; other models
see only the tenant's limits; settling refunds both; a dead replica's model slot is freed by the
sweeper's ``free_slot``; the admin CLI sets them. (Through the gateway: test_tenant_models_http.py.)"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from tandem.gateway import admin
from tandem.gateway.errors import RateLimitedError
from tandem.gateway.quota.redis_quota import RedisQuota, model_scope
from tandem.gateway.redis_client import connect
from tandem.gateway.tenancy.models import ModelQuota, Tenant
from tests.kit.redis import delete_prefix

MODEL = "SmolLM2-135M-Instruct"
ADAPTER = "tandem-test-a"
#: The tenant: 1000 in / 500 out per minute, 4 streams; the adapter alone: 100 out per minute, 1 stream.
TENANT = Tenant(
    id="acme",
    input_tokens_per_minute=1000,
    output_tokens_per_minute=500,
    max_concurrent_streams=4,
    model_quotas={ADAPTER: ModelQuota(output_tokens_per_minute=100, max_concurrent_streams=1)},
)


@pytest_asyncio.fixture
async def redis_prefix() -> AsyncIterator[tuple[aioredis.Redis, str]]:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    yield client, prefix
    await delete_prefix(client, prefix)
    await client.aclose()


def left(headers: dict[str, str]) -> tuple[int, int, int]:
    return (
        int(headers["x-ratelimit-remaining-input-tokens"]),
        int(headers["x-ratelimit-remaining-output-tokens"]),
        int(headers["x-ratelimit-remaining-streams"]),
    )


def model_left(headers: dict[str, str]) -> tuple[int, int]:
    """The adapter's own output tokens and free stream slots (it has no input limit: no such header)."""
    assert "x-ratelimit-remaining-input-tokens" not in headers
    return int(headers["x-ratelimit-remaining-output-tokens"]), int(headers["x-ratelimit-remaining-streams"])


async def tenant_left(quota: RedisQuota, request_id: str) -> tuple[int, int, int]:
    """The tenant's buckets and free slots, read by a 1-token probe on a model without limits (settled)."""
    probe = await quota.admit("acme", TENANT, request_id, 1, 1, model=MODEL)
    assert probe.model_part is None
    await quota.settle(probe, 1)
    return left(probe.headers)


async def test_a_model_has_its_own_limits_beside_the_tenants(redis_prefix: tuple[aioredis.Redis, str]) -> None:
    client, prefix = redis_prefix
    quota = RedisQuota(client, key_prefix=prefix, lease_s=60)
    first = await quota.admit("acme", TENANT, "r1", 10, 80, model=ADAPTER)
    assert first.model_part is not None and model_left(first.model_part.headers) == (20, 0)
    before = await tenant_left(quota, "probe-1")
    # The adapter's one stream slot is taken: refused, and the tenant's charge is given back at once.
    with pytest.raises(RateLimitedError, match=f"^For the model `{ADAPTER}`: Concurrency limit reached: 1"):
        await quota.admit("acme", TENANT, "r2", 10, 10, model=ADAPTER)
    after = await tenant_left(quota, "probe-2")
    # Only the probe's own token went (buckets refill ~17 input and ~8 output tokens a second meanwhile);
    # the refused request's 10 and 10 did not stay charged.
    assert after[0] >= before[0] - 1 and after[1] >= before[1] - 1 and after[2] == before[2]
    # The base model is limited by the tenant's figures only: 300 output tokens fit (not the adapter's 100).
    base = await quota.admit("acme", TENANT, "r3", 10, 300, model=MODEL)
    assert base.model_part is None
    await quota.settle(base, 300)
    await quota.settle(first, 30)  # 50 of the 80 reserved come back to both buckets
    second = await quota.admit("acme", TENANT, "r4", 10, 60, model=ADAPTER)
    assert second.model_part is not None
    assert model_left(second.model_part.headers)[0] in (10, 11)  # 100 - 30 generated - 60 reserved, + refill
    await quota.settle(second, 60)  # all 60 generated: nothing back, its slot free
    with pytest.raises(RateLimitedError, match=f"^For the model `{ADAPTER}`: Rate limit reached for output tokens"):
        await quota.admit("acme", TENANT, "r5", 10, 50, model=ADAPTER)


async def test_a_dead_replicas_model_slot_is_freed(redis_prefix: tuple[aioredis.Redis, str]) -> None:
    client, prefix = redis_prefix
    quota = RedisQuota(client, key_prefix=prefix, lease_s=600)
    await quota.admit("acme", TENANT, "r-dead", 10, 10, model=ADAPTER)  # its gateway dies: never settled
    streams = f"{prefix}:gw:quota:{model_scope('acme', ADAPTER)}:streams"
    assert await client.zcard(streams) == 1
    await quota.free_slot("acme", "r-dead", ADAPTER)
    assert await client.zcard(streams) == 0 and await client.zcard(f"{prefix}:gw:quota:acme:streams") == 0
    again = await quota.admit("acme", TENANT, "r-next", 10, 10, model=ADAPTER)
    await quota.settle(again, 1)


def test_the_admin_cli_sets_model_quotas(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import redis

    prefix = f"tandem-cli-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TANDEM_GATEWAY_TENANCY__KEY_PREFIX", prefix)
    try:
        quotas = {ADAPTER: {"output_tokens_per_minute": 5000}, "模型-🦄": {"max_concurrent_streams": 2}}
        assert admin.main(["tenant", "create", "acme", "--model-quotas", json.dumps(quotas)]) == 0
        (tenant,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert tenant["model_quotas"][ADAPTER]["output_tokens_per_minute"] == 5000
        assert tenant["model_quotas"]["模型-🦄"]["max_concurrent_streams"] == 2
        for bad in ('{"x": {"output_tokens_per_minute": 0}}', "[1]", "{not json"):
            with pytest.raises(SystemExit) if bad in ("[1]", "{not json") else contextlib.nullcontext():
                assert admin.main(["tenant", "update", "acme", "--model-quotas", bad]) == 2
            capsys.readouterr()
        assert admin.main(["tenant", "update", "acme", "--model-quotas", "{}"]) == 0
        (tenant,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert tenant["model_quotas"] == {}
    finally:
        sync = redis.Redis()
        for k in sync.scan_iter(match=f"{prefix}:*"):
            sync.delete(k)
