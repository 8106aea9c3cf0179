"""RedisQuota's scripts repeated, as the Redis client repeats a command whose
connection broke: an admission is charged once and a settlement refunds once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest_asyncio

from tandem.gateway.quota.redis_quota import RedisQuota
from tandem.gateway.redis_client import connect
from tandem.gateway.tenancy.models import TenantPolicy
from tests.kit.redis import delete_prefix

POLICY = TenantPolicy(input_tokens_per_minute=1000, output_tokens_per_minute=500, max_concurrent_streams=4)


@pytest_asyncio.fixture
async def quota() -> AsyncIterator[RedisQuota]:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    yield RedisQuota(client, key_prefix=prefix, lease_s=60)
    await delete_prefix(client, prefix)
    await client.aclose()


def left(headers: dict[str, str]) -> tuple[int, int, int]:
    return (
        int(headers["x-ratelimit-remaining-input-tokens"]),
        int(headers["x-ratelimit-remaining-output-tokens"]),
        int(headers["x-ratelimit-remaining-streams"]),
    )


async def test_an_admission_sent_twice_is_charged_once(quota: RedisQuota) -> None:
    first = await quota.admit("acme", POLICY, "req-1", 100, 50)
    again = await quota.admit("acme", POLICY, "req-1", 100, 50)
    assert left(first.headers) == (900, 450, 3)
    in_left, out_left, slots_left = left(again.headers)
    assert 900 <= in_left < 905 and 450 <= out_left < 455 and slots_left == 3  # refilled a little, not charged
    other = await quota.admit("acme", POLICY, "req-2", 100, 50)
    assert left(other.headers)[2] == 2  # another request is charged as before
    assert left(other.headers)[0] < 805


async def test_a_settlement_sent_twice_refunds_once(quota: RedisQuota) -> None:
    admission = await quota.admit("acme", POLICY, "req-1", 100, 400)  # reserves 400 output tokens
    await quota.settle(admission, 0)  # nothing generated: the 400 come back
    await quota.settle(admission, 0)  # the repeat gives back nothing more
    probe = await quota.admit("acme", POLICY, "req-2", 1, 1)
    _, out_left, slots_left = left(probe.headers)
    assert 499 - 1 <= out_left < 505 - 1 and slots_left == 3
    # Admitted again after its settlement, the same id is a new admission (charged again).
    readmitted = await quota.admit("acme", POLICY, "req-1", 100, 400)
    assert left(readmitted.headers)[1] < 110


async def test_a_request_that_failed_before_its_first_token_costs_nothing(quota: RedisQuota) -> None:
    served = await quota.admit("acme", POLICY, "req-served", 300, 40)
    await quota.settle(served, 40)  # answered: the prompt stays charged
    refused = await quota.admit("acme", POLICY, "req-refused", 300, 40)
    await quota.settle(refused, 0, served=False)  # e.g. 503 no capacity: the prompt comes back
    await quota.settle(refused, 0, served=False)  # once
    in_left, out_left, _ = left((await quota.admit("acme", POLICY, "probe", 1, 1)).headers)
    assert 699 - 1 <= in_left < 705 - 1  # 1000 - 300 (served) - the probe's 1
    assert 460 - 1 <= out_left < 465 - 1  # 500 - 40 (served) - the probe's 1
