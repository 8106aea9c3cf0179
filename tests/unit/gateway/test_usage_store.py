"""UsageStore against the real Redis: a retried record counts once, and a
record made while Redis is unreachable lands once Redis answers again."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tandem.gateway.redis_client import connect
from tandem.gateway.usage import UsageRecord, UsageStore
from tests.kit.redis import delete_prefix


def _record(request_id: str = "") -> UsageRecord:
    return UsageRecord("acme", "m", 10, 5, 2, aborted=False, request_id=request_id)


async def test_a_retried_record_counts_once() -> None:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        store = UsageStore(client, key_prefix=prefix)
        await store.record(_record("req-1"))
        await store.record(_record("req-1"))  # the retry of a write whose reply was lost
        await store.record(_record("req-2"))
        await store.record(_record())  # no id: no marker, counted every time
        total = (await store.tenant_usage("acme"))["total"]
        assert total == {
            "requests": 3,
            "aborted_requests": 0,
            "prompt_tokens": 30,
            "completion_tokens": 15,
            "cached_tokens": 6,
        }
        assert await store.tenants() == ["acme"]
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()


async def test_a_record_waits_out_a_redis_outage(unused_tcp_port: int) -> None:
    """Redis is down when the request ends and comes up two seconds later: the record is not lost."""
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect(f"redis://127.0.0.1:{unused_tcp_port}/0", timeout_s=0.5)
    store = UsageStore(client, key_prefix=prefix, retry_for_s=30)
    task = asyncio.create_task(store.record(_record("req-1")))
    await asyncio.sleep(2)
    assert not task.done()
    server = await asyncio.create_subprocess_exec(
        "redis-server",
        "--port",
        str(unused_tcp_port),
        "--save",
        "",
        "--appendonly",
        "no",
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        await asyncio.wait_for(task, 20)
        assert (await store.tenant_usage("acme"))["total"]["requests"] == 1
    finally:
        server.terminate()
        await server.wait()
        await client.aclose()


@pytest.fixture
def unused_tcp_port() -> int:
    from tests.kit.net import free_port

    return free_port()


@pytest.mark.parametrize("tenant_id", ["tenants", "recorded", "_tenants"])
async def test_no_tenant_id_reaches_the_stores_own_keys(tenant_id: str) -> None:
    """A tenant named after one of the store's own keys once made every usage write fail with
    WRONGTYPE. Tenant ids cannot start with "_" and the store's keys do; the one that does is refused."""
    from tandem.gateway.tenancy.models import valid_tenant_id

    if not valid_tenant_id(tenant_id):
        assert tenant_id.startswith("_")
        return
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        store = UsageStore(client, key_prefix=prefix)
        await store.record(UsageRecord(tenant_id, "m", 10, 5, 0, aborted=False, request_id="r-1"))
        await store.record(UsageRecord("acme", "m", 7, 1, 0, aborted=False, request_id="r-2"))
        assert (await store.tenant_usage(tenant_id))["total"]["prompt_tokens"] == 10
        assert (await store.tenant_usage("acme"))["total"]["prompt_tokens"] == 7
        assert await store.tenants() == sorted(["acme", tenant_id])
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()
