"""The router's Redis path under its own ACL user (tandem.common.redis_acl), on the real Redis.

Two replicas share a reservation through the ledger (snapshot rounds, the pub/sub channel, a repair
from the other's snapshot), read the worker registry, and leave: all granted, no denial logged. Only
the router may publish on the ledger's channel: before the users, anything that reached Redis could
forge a placement there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from tandem.common.registry import ROLE_DECODE, WorkerRecord, WorkerRegistry
from tandem.router.budget import BudgetConfig
from tandem.router.ledger import Ledger
from tandem.router.policy import ScheduleRequest, create_policy
from tandem.router.reservations import ReservationTable
from tandem.router.scheduler import Scheduler
from tandem.router.settings import QueueSettings
from tests.kit.redis import acl_denials, acl_users
from tests.kit.router import LEDGER_SECRET
from tests.kit.workers import StaticView

REDIS_URL = "redis://127.0.0.1:6379/0"


async def until(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


async def test_router_replicas_share_reservations_and_read_the_registry_under_their_own_user() -> None:
    async with acl_users(REDIS_URL) as users:
        url = users.url("router")
        ledgers: list[Ledger] = []
        schedulers: list[Scheduler] = []
        for name in ("a", "b"):
            ledger = Ledger(
                url, key_prefix=users.key_prefix, replica_id=name, secret=LEDGER_SECRET, lease_s=60, young_s=5.0,
                snapshot_interval_s=0.05, ttl_s=1.0,
            )  # fmt: skip
            schedulers.append(
                Scheduler(
                    StaticView(None),
                    create_policy("cache_aware"),
                    ReservationTable(lease_s=60, young_s=5.0),
                    budget=BudgetConfig(prefill_tokens_in_flight=100),
                    ledger=ledger,
                    queue=QueueSettings(timeout_s=0.3, poll_interval_s=0.02),
                )
            )
            ledger.start()
            ledgers.append(ledger)
        worker = WorkerRegistry(users.url("worker"), key_prefix=users.key_prefix)
        reader = WorkerRegistry(url, key_prefix=users.key_prefix)
        root = aioredis.Redis.from_url(REDIS_URL)
        try:
            ledger_a, ledger_b = ledgers
            await until(lambda: ledger_a.num_live_replicas == 2 and ledger_b.num_live_replicas == 2)
            request = ScheduleRequest(request_id="r1", model="m", num_prompt_tokens=60, max_tokens=4, tenant="t")
            await schedulers[0].schedule(request)
            await until(lambda: ledger_b.others_tokens("p0") == 60)  # over the channel
            schedulers[0].end_reservation("r1")
            await until(lambda: ledger_b.others_tokens("p0") == 0)

            await worker.heartbeat(WorkerRecord(worker_id="d0", role=ROLE_DECODE, model="m", address="127.0.0.1:1"))
            assert [r.worker_id for r in await reader.list_workers()] == ["d0"]

            await ledger_a.leave()
            assert ledger_a.stats.num_publish_errors == 0 and ledger_b.stats.num_publish_errors == 0
            assert await acl_denials(root, users.key_prefix) == []

            # Anyone else on the channel is refused: a gateway cannot forge a placement.
            gateway = aioredis.Redis.from_url(users.url("gateway"))
            try:
                with pytest.raises(NoPermissionError):
                    await gateway.publish(f"{users.key_prefix}:router:ledger", b"forged")
                with pytest.raises(NoPermissionError):
                    await gateway.execute_command("SUBSCRIBE", f"{users.key_prefix}:router:ledger")
            finally:
                await gateway.aclose()
        finally:
            for ledger in ledgers:
                await ledger.aclose()
            await worker.aclose()
            await reader.aclose()
            await root.aclose()
