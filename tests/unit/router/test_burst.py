"""Balance under bursts (tandem.router.burst): a long prompt runs on its decode worker alone when the
prefill worker it would be handed to is backed up and the decode worker has room; otherwise it is
handed off, or waits for decode budget, as before."""

from __future__ import annotations

import pytest

from tandem.common.errors import NoCapacityError
from tandem.common.registry import WorkerRecord
from tandem.router.burst import DEFAULT_STALL_WEIGHT, burst_cost
from tandem.router.policy import ScheduleRequest
from tandem.router.scheduler import Scheduler
from tandem.router.settings import RouterConfig
from tests.kit import router as kit
from tests.kit.clock import FakeClock
from tests.unit.router.test_cache_aware import worker
from tests.unit.router.test_local_prefill import PlacementCounts

THRESHOLD = 40
#: Room on a decode worker for several long prompts (16-token blocks x 0.9 of the KV cache).
ROOMY_DECODE_BLOCKS = 1000


class BurstCounts(PlacementCounts):
    def __init__(self) -> None:
        super().__init__()
        self.bursts = 0

    def count_burst(self, *, model: str) -> None:
        self.bursts += 1


def make_scheduler(
    workers: list[WorkerRecord], *, prefill_budget: int = 10_000, **disaggregation: object
) -> tuple[Scheduler, BurstCounts]:
    metrics = BurstCounts()
    scheduler = kit.make_scheduler(
        workers,
        metrics=metrics,
        clock=FakeClock(),
        lease_s=60,
        budget={"prefill_tokens_in_flight": prefill_budget},
        disaggregation={"min_uncached_tokens": THRESHOLD, **disaggregation},
        queue={"timeout_s": 0.2, "poll_interval_s": 0.05},
    )
    return scheduler, metrics


def pool(decode_blocks: int = ROOMY_DECODE_BLOCKS) -> list[WorkerRecord]:
    return [worker("p0", "prefill"), worker("d0", "decode", num_kv_blocks=decode_blocks)]


def long(request_id: str, num_tokens: int = 1000, *, first: int = 0) -> ScheduleRequest:
    """A long prompt of distinct tokens (nothing cached anywhere); the id is hostile on purpose."""
    return ScheduleRequest(
        request_id=request_id,
        model="m",
        num_prompt_tokens=num_tokens,
        max_tokens=8,
        prompt_token_ids=tuple(range(first, first + num_tokens)),
    )


async def test_a_backed_up_prefill_worker_sends_a_long_prompt_to_a_decode_worker_with_room() -> None:
    scheduler, metrics = make_scheduler(pool())
    first = await scheduler.schedule(long("ahead"))
    assert not first.local_prefill and first.prefill is not None  # nothing ahead on p0: handed off
    # p0 has 1,000 tokens ahead; d0 has one stream: 0.25 x (1 + 1) x 1,000 = 500 < 1,000.
    burst = await scheduler.schedule(long("burst\u00e9 \u2603 'x'\"; DROP", first=5000))
    assert burst.local_prefill and burst.prefill is None and burst.decode.worker_id == "d0"
    assert "local_prefill burst wait=1000 extra=500" in burst.reason
    assert metrics.bursts == 1 and (metrics.local, metrics.disaggregated) == (1, 1)
    # Only the decode worker holds the burst; the prefill worker's demand is the first prompt alone.
    assert scheduler.reservations.in_flight_by_worker() == {"p0": 1, "d0": 2}
    assert scheduler.reservations.tokens_by_worker()["p0"] == 1000
    assert metrics.prefill_tokens == 1000


async def test_an_idle_prefill_worker_keeps_its_long_prompts() -> None:
    scheduler, metrics = make_scheduler(pool())
    for i in range(3):
        placement = await scheduler.schedule(long(f"alone-{i}", first=i * 2000))
        assert not placement.local_prefill and placement.prefill is not None, placement.reason
        scheduler.end_reservation(placement.request_id)
    assert metrics.bursts == 0 and metrics.disaggregated == 3


async def test_a_short_wait_against_a_busy_decode_worker_is_handed_off() -> None:
    scheduler, metrics = make_scheduler(pool())
    await scheduler.schedule(long("ahead", 300))
    placement = await scheduler.schedule(long("next", first=5000))
    # wait 300 against 0.25 x (1 + 1) x 1,000 = 500: the decode worker's streams would pay more.
    assert not placement.local_prefill and placement.prefill is not None
    assert metrics.bursts == 0


async def test_the_decode_workers_own_burst_backlog_counts_against_the_next() -> None:
    scheduler, metrics = make_scheduler(pool())
    await scheduler.schedule(long("ahead"))
    burst = await scheduler.schedule(long("burst", first=5000))
    assert burst.local_prefill
    # 1,000 ahead on p0 against d0's 1,000 of burst + 0.25 x (2 + 1) x 1,000: handed off.
    third = await scheduler.schedule(long("third", first=9000))
    assert not third.local_prefill and third.prefill is not None
    assert metrics.bursts == 1
    # The burst ended: d0's backlog is gone, and p0 has 2,000 ahead against 0.25 x (2 + 1) x 1,000.
    scheduler.end_reservation("burst")
    fourth = await scheduler.schedule(long("fourth", first=13000))
    assert fourth.local_prefill and "burst wait=2000 extra=750" in fourth.reason
    assert metrics.bursts == 2


async def test_a_spent_prefill_budget_sends_the_request_to_decode_instead_of_the_queue() -> None:
    scheduler, metrics = make_scheduler(pool(), prefill_budget=1500)
    await scheduler.schedule(long("ahead"))
    placement = await scheduler.schedule(long("over-budget", first=5000))
    assert placement.local_prefill and "burst wait=1000" in placement.reason
    assert scheduler.queue_depth == 0 and metrics.bursts == 1


async def test_a_full_decode_worker_takes_no_burst_the_request_waits() -> None:
    # d0's KV budget holds one long prompt (100 blocks x 16 x 0.9 = 1,440 tokens), not two.
    scheduler, metrics = make_scheduler(pool(decode_blocks=100), prefill_budget=1500)
    await scheduler.schedule(long("ahead"))
    with pytest.raises(NoCapacityError):
        await scheduler.schedule(long("waits", first=5000))
    assert metrics.bursts == 0
    assert scheduler.reservations.in_flight_by_worker() == {"p0": 1, "d0": 1}


@pytest.mark.parametrize("disaggregation", [{"burst_local_prefill": False}, {"min_uncached_tokens": 0}])
async def test_off_the_request_goes_through_the_prefill_worker(disaggregation: dict[str, object]) -> None:
    scheduler, metrics = make_scheduler(pool(), **disaggregation)
    await scheduler.schedule(long("ahead"))
    placement = await scheduler.schedule(long("queued", first=5000))
    assert not placement.local_prefill and placement.prefill is not None
    assert metrics.bursts == 0


async def test_a_request_without_its_prompt_length_is_never_a_burst() -> None:
    scheduler, metrics = make_scheduler(pool())
    await scheduler.schedule(long("ahead"))
    placement = await scheduler.schedule(ScheduleRequest(request_id="unsized", model="m", max_tokens=8))
    assert not placement.local_prefill and metrics.bursts == 0


def test_the_formula() -> None:
    cost = burst_cost(
        wait_tokens=2000, ahead_on_decode=500, num_decode_streams=3, uncached_on_decode=1000, stall_weight=0.25
    )
    assert (cost.wait_tokens, cost.extra_tokens, cost.local) == (2000, 1500, True)
    assert not burst_cost(
        wait_tokens=0, ahead_on_decode=0, num_decode_streams=0, uncached_on_decode=1000, stall_weight=0.0
    ).local  # nothing ahead on the prefill worker: never


def test_the_settings() -> None:
    config = RouterConfig().disaggregation
    assert config.burst_local_prefill and config.burst_stall_weight == DEFAULT_STALL_WEIGHT
    with pytest.raises(ValueError):
        RouterConfig.model_validate({"disaggregation": {"burst_stall_weight": -1}})
