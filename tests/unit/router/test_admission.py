"""The admission queue: waiting for budget, priority classes, per-tenant fair share, timeout."""

from __future__ import annotations

import asyncio

import pytest

from tandem.common.errors import NoCapacityError
from tandem.router.admission import AdmissionQueue, QueueFullError
from tandem.router.metrics import NullRouterMetrics
from tandem.router.policy import ScheduleRequest
from tandem.router.scheduler import Scheduler
from tests.kit.router import gauges_flushed, make_scheduler


class QueueMetrics(NullRouterMetrics):
    def __init__(self) -> None:
        self.depths: list[tuple[str, int]] = []
        self.waits: list[str] = []

    def set_queue_depth(self, priority: str, depth: int) -> None:
        self.depths.append((priority, depth))

    def observe_queue_wait(self, duration_s: float, *, outcome: str, model: str) -> None:
        self.waits.append(outcome)


def make(timeout_s: float = 2.0, **queue: object) -> tuple[Scheduler, QueueMetrics]:
    metrics = QueueMetrics()
    scheduler = make_scheduler(
        metrics=metrics,
        lease_s=60,
        budget={"prefill_tokens_in_flight": 100},
        queue={"timeout_s": timeout_s, "poll_interval_s": 0.01, **queue},
    )
    return scheduler, metrics


def req(request_id: str, tenant: str = "t", *, tokens: int = 60, priority: str = "") -> ScheduleRequest:
    return ScheduleRequest(
        request_id=request_id, model="m", num_prompt_tokens=tokens, max_tokens=4, tenant=tenant, priority=priority
    )


async def test_a_request_waits_for_budget_and_is_admitted_on_release() -> None:
    scheduler, metrics = make()
    await scheduler.schedule(req("first"))
    waiting = asyncio.create_task(scheduler.schedule(req("second")))
    await asyncio.sleep(0.05)
    assert not waiting.done() and scheduler.queue_depth == 1
    assert ("normal", 1) in metrics.depths
    scheduler.end_reservation("first")
    placement = await asyncio.wait_for(waiting, 1)
    assert placement.prefill.worker_id == "p0"
    assert scheduler.queue_depth == 0 and metrics.waits == ["admitted"]


async def test_past_the_timeout_it_is_no_capacity_with_retry_after() -> None:
    scheduler, metrics = make(timeout_s=0.1)
    await scheduler.schedule(req("first"))
    with pytest.raises(NoCapacityError) as info:
        await scheduler.schedule(req("second"))
    assert info.value.retry_after_s >= 1.0
    assert scheduler.queue_depth == 0 and metrics.waits == ["timeout"]


async def test_higher_priority_class_goes_first() -> None:
    scheduler, _ = make()
    await scheduler.schedule(req("hold"))
    low = asyncio.create_task(scheduler.schedule(req("low", "a", priority="1")))
    await asyncio.sleep(0.02)
    high = asyncio.create_task(scheduler.schedule(req("high", "b", priority="3")))
    await asyncio.sleep(0.02)
    scheduler.end_reservation("hold")
    await asyncio.wait_for(high, 1)
    assert not low.done()
    scheduler.end_reservation("high")
    await asyncio.wait_for(low, 1)


async def test_tenant_priorities_from_config() -> None:
    scheduler, _ = make(tenant_priorities={"vip": "high"})
    await scheduler.schedule(req("hold"))
    normal = asyncio.create_task(scheduler.schedule(req("n", "someone")))
    await asyncio.sleep(0.02)
    vip = asyncio.create_task(scheduler.schedule(req("v", "vip")))
    await asyncio.sleep(0.02)
    scheduler.end_reservation("hold")
    await asyncio.wait_for(vip, 1)
    assert not normal.done()
    scheduler.end_reservation("v")
    await asyncio.wait_for(normal, 1)


async def test_fair_share_between_tenants_within_a_class() -> None:
    """Tenant A queued a burst first; B's single request still goes before A's second."""
    scheduler, _ = make(timeout_s=5)
    await scheduler.schedule(req("hold", "a", tokens=100))
    burst = [asyncio.create_task(scheduler.schedule(req(f"a{i}", "a", tokens=100))) for i in range(3)]
    await asyncio.sleep(0.02)
    b = asyncio.create_task(scheduler.schedule(req("b0", "b", tokens=100)))
    await asyncio.sleep(0.02)
    order: list[str] = []
    pending = {*burst, b}
    holder = "hold"
    for _ in range(4):
        scheduler.end_reservation(holder)
        done, pending = await asyncio.wait(pending, timeout=1, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        holder = done.pop().result().request_id
        order.append(holder)
    # A holds one request in flight when the first slot frees, B none: B first
    assert order[0] == "a0" or order[0] == "b0"
    assert order.index("b0") <= 1
    assert order == sorted(order, key=lambda r: (r != order[0], r)) or "b0" in order[:2]


def test_queue_orders_by_class_then_fewest_in_flight_then_age() -> None:
    async def run() -> None:
        queue: AdmissionQueue[str] = AdmissionQueue(priority_classes=["high", "normal"], default_priority="normal")
        a1 = queue.push("a1", tenant="a", priority="")
        queue.push("a2", tenant="a", priority="")
        b1 = queue.push("b1", tenant="b", priority="")
        in_flight = {"a": 2, "b": 0}
        assert queue.next(lambda t: in_flight[t]) is b1
        in_flight["b"] = 5
        assert queue.next(lambda t: in_flight[t]) is a1
        h = queue.push("h", tenant="z", priority="high")
        assert queue.next(lambda t: 0) is h
        assert queue.remove(h) and not queue.remove(h)
        assert len(queue) == 3 and queue.depth("normal") == 3
        assert queue.priority_of("2") == "high" and queue.priority_of("1") == "normal"
        assert queue.priority_of("nonsense") == "normal"

    asyncio.run(run())


def test_queue_depth_is_bounded() -> None:
    async def run() -> None:
        queue: AdmissionQueue[str] = AdmissionQueue(priority_classes=["x"], default_priority="x", max_depth=1)
        queue.push("1", tenant="a", priority="")
        with pytest.raises(QueueFullError):
            queue.push("2", tenant="a", priority="")

    asyncio.run(run())


class PoolMetrics(QueueMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.tokens: dict[tuple[str, str], int] = {}
        self.queued: dict[str, tuple[int, int]] = {}

    def set_tokens_in_flight(self, worker_id: str, role: str, model: str, num_tokens: int) -> None:
        self.tokens[(worker_id, role)] = num_tokens

    def set_queued(self, waiting_for: str, model: str, num_requests: int, num_uncached_tokens: int) -> None:
        self.queued[waiting_for] = (num_requests, num_uncached_tokens)


def _pool_scheduler(**budget: float) -> tuple[Scheduler, PoolMetrics]:
    metrics = PoolMetrics()
    scheduler = make_scheduler(
        metrics=metrics, lease_s=60, budget=budget, queue={"timeout_s": 2.0, "poll_interval_s": 0.01}
    )
    return scheduler, metrics


async def test_each_pools_tokens_in_flight_are_reported_apart() -> None:
    scheduler, metrics = _pool_scheduler(prefill_tokens_in_flight=100)
    await scheduler.schedule(req("a", tokens=60))
    await gauges_flushed()
    # Prefill holds the uncached prompt; decode holds prompt plus max_tokens: neither counts as the other.
    assert metrics.tokens == {("p0", "prefill"): 60, ("d0", "decode"): 64}
    scheduler.end_reservation("a")
    await gauges_flushed()
    assert metrics.tokens == {("p0", "prefill"): 0, ("d0", "decode"): 0}


async def test_the_queue_says_which_pools_budget_its_requests_wait_for() -> None:
    # Prefill budget 100 tokens: the second 60-token prompt waits for prefill.
    scheduler, metrics = _pool_scheduler(prefill_tokens_in_flight=100)
    await scheduler.schedule(req("first", tokens=60))
    waiting = [asyncio.create_task(scheduler.schedule(req(f"w{i}", tokens=60))) for i in range(3)]
    await asyncio.sleep(0.05)
    assert scheduler.queued() == {"prefill": (3, 180), "decode": (0, 0)}
    scheduler.tick()
    assert metrics.queued == {"prefill": (3, 180), "decode": (0, 0)}
    scheduler.end_reservation("first")
    await asyncio.wait_for(waiting[0], 1)
    for task in waiting[1:]:
        task.cancel()

    # Decode budget 10,000 blocks x 16 tokens x 0.0065 = 1,040 tokens: room for one 904-token request.
    scheduler, metrics = _pool_scheduler(prefill_tokens_in_flight=10_000, decode_kv_fraction=0.0065)
    await scheduler.schedule(req("first", tokens=900))
    waiting = [asyncio.create_task(scheduler.schedule(req(f"w{i}", tokens=900))) for i in range(2)]
    await asyncio.sleep(0.05)
    assert scheduler.queued() == {"prefill": (0, 0), "decode": (2, 1800)}
    scheduler.tick()
    assert metrics.queued["decode"] == (2, 1800) and metrics.queued["prefill"] == (0, 0)
    for task in waiting:
        task.cancel()


async def test_a_request_both_pools_are_too_full_for_waits_for_both() -> None:
    # Room for one 900-token prompt on prefill and one 904-token request on decode: the next lacks both,
    # and both pools must grow before it can go (counting it for decode alone hid prefill's shortage
    # from the autoscaler until decode had grown: make autoscale-demo's decision log).
    scheduler, metrics = _pool_scheduler(prefill_tokens_in_flight=1000, decode_kv_fraction=0.0065)
    await scheduler.schedule(req("first", tokens=900))
    waiting = [asyncio.create_task(scheduler.schedule(req(f"w{i}", tokens=900))) for i in range(2)]
    await asyncio.sleep(0.05)
    assert scheduler.queued() == {"prefill": (2, 1800), "decode": (2, 1800)}
    scheduler.tick()
    assert metrics.queued == {"prefill": (2, 1800), "decode": (2, 1800)}
    for task in waiting:
        task.cancel()


async def test_a_quiet_pool_reads_zero_not_no_data() -> None:
    scheduler, metrics = _pool_scheduler()
    await scheduler.refresh_workers()
    scheduler.tick()
    assert metrics.tokens == {("p0", "prefill"): 0, ("d0", "decode"): 0}
    assert metrics.queued == {"prefill": (0, 0), "decode": (0, 0)}
