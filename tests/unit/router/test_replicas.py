"""Active-active replicas: two Schedulers sharing budgets through the real Redis
(127.0.0.1:6379, a private key prefix), and what happens when one dies."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from tandem.common.errors import NoCapacityError
from tandem.router.budget import BudgetConfig
from tandem.router.policy import ScheduleRequest, create_policy
from tandem.router.replica_sync import ReplicaSync
from tandem.router.reservations import ReservationTable
from tandem.router.scheduler import QueueConfig, Scheduler
from tests.kit.redis import delete_prefix
from tests.kit.workers import StaticView

REDIS_URL = "redis://127.0.0.1:6379/0"
INTERVAL_S = 0.05


def req(request_id: str, tokens: int = 60) -> ScheduleRequest:
    return ScheduleRequest(request_id=request_id, model="m", num_prompt_tokens=tokens, max_tokens=4)


@pytest_asyncio.fixture
async def prefix() -> AsyncIterator[str]:
    key_prefix = f"tandem-test-replicas-{uuid.uuid4().hex[:8]}"
    yield key_prefix
    client = aioredis.Redis.from_url(REDIS_URL)
    await delete_prefix(client, key_prefix)
    await client.aclose()


def replica(prefix: str, name: str) -> tuple[Scheduler, ReplicaSync]:
    sync = ReplicaSync(REDIS_URL, key_prefix=prefix, replica_id=name, interval_s=INTERVAL_S, lease_s=60)
    scheduler = Scheduler(
        StaticView(),
        create_policy("cache_aware"),
        ReservationTable(lease_s=60, young_s=5.0),
        budget=BudgetConfig(prefill_tokens_in_flight=100),
        replica_sync=sync,
        queue=QueueConfig(timeout_s=0.2, poll_interval_s=0.02),
    )
    return scheduler, sync


async def test_replicas_share_budgets_and_a_dead_ones_budget_expires(prefix: str) -> None:
    a, sync_a = replica(prefix, "a")
    b, sync_b = replica(prefix, "b")
    await a.schedule(req("r1", 60))
    await a.sync_replicas()
    await b.sync_replicas()
    assert sync_b.others_tokens("p0") == 60 and sync_b.num_live_replicas == 2
    # 60 held by A + 60 would exceed the 100-token budget: B queues, then gives up.
    # (The worker reports nothing in flight yet: A's reservation is too recent to be capped by it.)
    with pytest.raises(NoCapacityError):
        await b.schedule(req("r2", 60))
    # A dies without a word: its key expires after a few intervals, then B has the budget again
    await asyncio.sleep(1.2)  # the key TTL: 8 intervals, at least 1 s
    await b.sync_replicas()
    assert sync_b.others_tokens("p0") == 0 and sync_b.num_live_replicas == 1
    placement = await b.schedule(req("r2", 60))
    assert placement.prefill.worker_id == "p0"
    await sync_a.aclose()
    await sync_b.aclose()


async def test_release_reaching_another_replica_is_forwarded_to_the_owner(prefix: str) -> None:
    a, sync_a = replica(prefix, "a")
    b, sync_b = replica(prefix, "b")
    await a.schedule(req("r1", 60))
    await a.sync_replicas()  # writes r1's owner
    assert await b.release_anywhere("r1") is True  # B does not hold it: forwarded
    assert a.reservations.num_in_flight("p0") == 1
    await a.sync_replicas()  # A takes the forwarded release
    assert a.reservations.num_in_flight("p0") == 0
    assert await b.release_anywhere("never-scheduled") is False
    await sync_a.aclose()
    await sync_b.aclose()


async def test_a_retry_on_the_surviving_replica_is_placed(prefix: str) -> None:
    """The gateway retries a Schedule whose replica died; the survivor places it afresh."""
    a, sync_a = replica(prefix, "a")
    b, sync_b = replica(prefix, "b")
    await a.schedule(req("r1", 30))
    await a.sync_replicas()
    await sync_a.aclose()  # A is gone (its key lingers until it expires)
    await b.sync_replicas()
    placement = await b.schedule(req("r1", 30))  # same request id, placed again by B
    assert placement.request_id == "r1" and b.reservations.num_in_flight("p0") == 1
    await sync_b.aclose()
