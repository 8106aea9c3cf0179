"""Open usage records against the real Redis: a request whose gateway replica died mid-answer is billed
with the tokens its record last held, once, by another replica (or its successor); a live replica's
records are left alone; a request that died before its first token costs nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tandem.gateway.errors import RateLimitedError
from tandem.gateway.quota.redis_quota import RedisQuota
from tandem.gateway.redis_client import connect
from tandem.gateway.tenancy.models import TenantPolicy
from tandem.gateway.usage import UsageRecord, UsageStore
from tandem.gateway.usage_sweeper import UsageSweeper
from tests.kit.redis import delete_prefix


@pytest_asyncio.fixture
async def prefix() -> AsyncIterator[str]:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        yield prefix
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()


def _opened(request_id: str, tenant: str = "acme") -> UsageRecord:
    return UsageRecord(tenant, "m", 12, 0, 0, aborted=False, request_id=request_id)


async def _sweep_once(sweeper: UsageSweeper) -> None:
    """Run ``sweeper`` until it settled something (its first turn sweeps at once), then stop it."""
    sweeper.start()
    try:
        for _ in range(50):
            if sweeper.num_settled:
                break
            await asyncio.sleep(0.05)
    finally:
        await sweeper.stop()


async def _keys(client: object, prefix: str) -> list[str]:
    return sorted([k async for k in client.scan_iter(match=f"{prefix}:gw:usage:_*")])  # type: ignore[attr-defined]


async def test_a_finished_request_closes_its_open_record_and_counts_once(prefix: str) -> None:
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        store = UsageStore(client, key_prefix=prefix, replica_id="gw-a")
        assert await store.open(_opened("r-1"))
        await store.progress("r-1", 3)
        await store.progress("r-1", 2)  # never back
        assert (await client.hgetall(f"{prefix}:gw:usage:_open:r-1"))["completion"] == "3"
        await store.record(UsageRecord("acme", "m", 12, 5, 4, aborted=False, request_id="r-1"))
        await store.progress("r-1", 9)  # after the record: does not bring it back
        assert await _keys(client, prefix) == [
            f"{prefix}:gw:usage:_recorded:r-1",
            f"{prefix}:gw:usage:_replicas",
            f"{prefix}:gw:usage:_tenants",
        ]
        # gw-a is dead now (it never renewed): a sweep finds nothing left to bill.
        assert await UsageStore(client, key_prefix=prefix, replica_id="gw-b").settle_orphans() == []
        total = (await store.tenant_usage("acme"))["total"]
        assert total == {
            "requests": 1,
            "aborted_requests": 0,
            "prompt_tokens": 12,
            "completion_tokens": 5,
            "cached_tokens": 4,
        }
    finally:
        await client.aclose()


async def test_a_dead_replicas_requests_are_billed_once_by_another(prefix: str) -> None:
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        dead = UsageStore(client, key_prefix=prefix, replica_id="gw-dead")
        live = UsageStore(client, key_prefix=prefix, replica_id="gw-live")
        await dead.renew_liveness(0.3)
        await live.renew_liveness(60)
        assert await dead.open(_opened("r-streamed"))
        await dead.progress("r-streamed", 7)
        assert await dead.open(_opened("r-queued", tenant="zeta"))  # died before its first token
        assert await live.open(_opened("r-live"))
        await live.progress("r-live", 2)

        assert await live.settle_orphans() == []  # gw-dead is still within its liveness
        await asyncio.sleep(0.5)
        # Two replicas sweep at once: each record is billed once.
        other = UsageStore(client, key_prefix=prefix, replica_id="gw-other")
        settled = await asyncio.gather(live.settle_orphans(), other.settle_orphans())
        # Both may find the orphans (the marker counts r-streamed once); together they find both.
        assert {o.request_id for o in (*settled[0], *settled[1])} == {"r-streamed", "r-queued"}
        assert {(o.request_id, o.tenant_id) for o in (*settled[0], *settled[1])} == {
            ("r-streamed", "acme"),
            ("r-queued", "zeta"),
        }
        assert (await live.tenant_usage("acme"))["total"] == {
            "requests": 1,
            "aborted_requests": 1,
            "prompt_tokens": 12,
            "completion_tokens": 7,
            "cached_tokens": 0,
        }
        assert (await live.tenant_usage("zeta"))["total"]["requests"] == 0
        # The live replica's record is untouched; the dead one's are gone, and so is the replica.
        assert await client.hgetall(f"{prefix}:gw:usage:_open:r-live")
        assert not await client.exists(f"{prefix}:gw:usage:_open:r-streamed", f"{prefix}:gw:usage:_open:r-queued")
        assert await client.smembers(f"{prefix}:gw:usage:_replicas") == {"gw-live"}
    finally:
        await client.aclose()


async def test_a_restarted_gateway_settles_its_predecessor_at_start(prefix: str) -> None:
    """The sweeper sweeps on its first turn: a gateway restarted after a SIGKILL bills what the killed
    process served, as soon as the old liveness key has expired."""
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        killed = UsageStore(client, key_prefix=prefix, replica_id="gw-1")
        assert await killed.open(_opened("r-1"))
        await killed.progress("r-1", 11)
        successor = UsageStore(client, key_prefix=prefix, replica_id="gw-2")
        released: list[str] = []

        async def release(request_id: str) -> bool:
            released.append(request_id)
            return True

        sweeper = UsageSweeper(successor, liveness_s=5, sweep_interval_s=60, end_reservation=release)
        await _sweep_once(sweeper)
        assert sweeper.num_settled == 1
        assert released == ["r-1"]  # its router reservation too, not held until its lease ends
        assert (await successor.tenant_usage("acme"))["total"]["completion_tokens"] == 11
        assert not await client.exists(successor.alive_key("gw-2"))  # stopped: no longer claims to be alive
    finally:
        await client.aclose()


async def test_a_dead_replicas_quota_slots_are_freed_by_the_sweeper(prefix: str) -> None:
    """Issue 38: a killed gateway held its tenant's concurrency slot until the quota lease ran out (~630 s
    with the defaults); a live replica's sweeper frees it once the dead one's liveness key expires. A
    settle arriving after that (the same request settled twice) refunds nothing more."""
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        quota = RedisQuota(client, key_prefix=prefix, lease_s=630)
        policy = TenantPolicy(max_concurrent_streams=1, output_tokens_per_minute=1000)
        admission = await quota.admit("acme", policy, "r-1", 10, 100)
        killed = UsageStore(client, key_prefix=prefix, replica_id="gw-killed")
        assert await killed.open(_opened("r-1"))
        await killed.progress("r-1", 4)
        with pytest.raises(RateLimitedError):  # the one slot is taken
            await quota.admit("acme", policy, "r-2", 10, 100)

        successor = UsageStore(client, key_prefix=prefix, replica_id="gw-successor")
        sweeper = UsageSweeper(successor, liveness_s=5, sweep_interval_s=60, free_slot=quota.free_slot)
        await _sweep_once(sweeper)
        assert sweeper.num_settled == 1
        assert await client.zcard(f"{prefix}:gw:quota:acme:streams") == 0
        second = await quota.admit("acme", policy, "r-2", 10, 100)  # at once, not ~630 s later
        await quota.settle(admission, 4)  # the dead replica's request: nothing left to refund
        out_left = float(await client.hget(f"{prefix}:gw:quota:acme:out", "tokens"))
        # Both reservations still charged: a refund would add 96; refilling by time adds ~17 a second.
        assert out_left < 1000 - 100 - 100 + 50
        await quota.settle(second, 100)
    finally:
        await client.aclose()


async def test_a_request_refused_before_its_first_token_leaves_nothing_open(prefix: str) -> None:
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        store = UsageStore(client, key_prefix=prefix, replica_id="gw-a")
        assert await store.open(_opened("r-1"))
        await store.discard("r-1")
        assert not await client.exists(f"{prefix}:gw:usage:_open:r-1")
        assert not await client.smembers(f"{prefix}:gw:usage:_open_by:gw-a")
    finally:
        await client.aclose()


async def test_usage_and_turns_never_land_on_a_deleted_or_recreated_tenant(prefix: str) -> None:
    """A deleted tenant's key keeps working for ``auth.cache_s``; what it is served then must not bring
    the tenant's usage or conversations back, nor reach a new tenant created under the same id."""
    from tandem.gateway.conversations import ConversationStore
    from tandem.gateway.tenancy.models import Tenant
    from tandem.gateway.tenancy.store import TenantStore

    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        tenants = TenantStore(client, key_prefix=prefix)
        usage = UsageStore(client, key_prefix=prefix, replica_id="gw-a")
        conversations = ConversationStore(client, key_prefix=prefix, ttl_s=600, max_messages=10)
        await tenants.put_tenant(Tenant(id="acme"))
        old_salt = (await tenants.get_tenant("acme")).cache_salt  # type: ignore[union-attr]

        def served(request_id: str, salt: str) -> UsageRecord:
            return UsageRecord("acme", "m", 10, 3, 0, aborted=False, request_id=request_id, tenant_salt=salt)

        await usage.record(served("r-1", old_salt))
        assert (await usage.tenant_usage("acme"))["total"]["requests"] == 1
        await tenants.delete_tenant("acme")
        await usage.record(served("r-2", old_salt))  # served from a cached key after the deletion
        await conversations.append("acme", "c1", [{"role": "user", "content": "東京 🙂"}], tenant_salt=old_salt)
        assert [k async for k in client.scan_iter(match=f"{prefix}:gw:*acme*")] == []

        await tenants.put_tenant(Tenant(id="acme"))  # created again: a new salt
        new_salt = (await tenants.get_tenant("acme")).cache_salt  # type: ignore[union-attr]
        assert new_salt != old_salt
        await usage.record(served("r-3", old_salt))
        assert (await usage.tenant_usage("acme"))["total"]["requests"] == 0
        await usage.record(served("r-4", new_salt))
        assert (await usage.tenant_usage("acme"))["total"]["requests"] == 1
    finally:
        await client.aclose()
