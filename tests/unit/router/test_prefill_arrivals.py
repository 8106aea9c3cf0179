"""The prefill pool's demand as it arrives (tandem.router.placement.Placer.arrived): each Schedule headed for
prefill counts its uncached prompt tokens once, at its first admission attempt, placed at once or queued,
and never again on the queue's tries; the placed counter counts only what was placed. A saturated pool
places at its capacity whatever arrives: the autoscaler's token_rate reads the arrivals."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tandem.common.block_hash import BlockHasher
from tandem.common.errors import NoCapacityError
from tandem.common.registry import WorkerRecord
from tandem.router.policy import ScheduleRequest
from tandem.router.scheduler import Scheduler
from tests.kit import router as kit
from tests.kit.clock import FakeClock
from tests.unit.router.test_cache_aware import BLOCK, worker
from tests.unit.router.test_local_prefill import PlacementCounts

THRESHOLD = 40
#: A served model name with non-ASCII and quoting characters: the counter's label is the request's model.
MODEL = "mödel-\u2603 'x'\"; DROP"


class ArrivalCounts(PlacementCounts):
    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[tuple[int, str]] = []

    def count_prefill_arrival(self, num_tokens: int, *, model: str) -> None:
        self.arrivals.append((num_tokens, model))

    @property
    def arrived_tokens(self) -> int:
        return sum(n for n, _ in self.arrivals)


def of_model(record: WorkerRecord) -> WorkerRecord:
    return dataclasses.replace(record, model=MODEL)


def make(
    *, prefill_budget: int = 100, timeout_s: float = 2.0, burst: bool = False, decode_blocks: int = 100
) -> tuple[Scheduler, ArrivalCounts]:
    metrics = ArrivalCounts()
    scheduler = kit.make_scheduler(
        [of_model(worker("p0", "prefill")), of_model(worker("d0", "decode", num_kv_blocks=decode_blocks))],
        metrics=metrics,
        clock=FakeClock(),
        lease_s=60,
        budget={"prefill_tokens_in_flight": prefill_budget},
        disaggregation={"min_uncached_tokens": THRESHOLD, **({} if burst else {"burst_local_prefill": False})},
        queue={"timeout_s": timeout_s, "poll_interval_s": 0.01},
    )
    return scheduler, metrics


def req(request_id: str, num_tokens: int = 60, *, first: int = 0, **fields: object) -> ScheduleRequest:
    """A prompt of distinct tokens from ``first`` (nothing cached unless a test stores it)."""
    return ScheduleRequest(
        request_id=request_id,
        model=MODEL,
        num_prompt_tokens=num_tokens,
        max_tokens=4,
        prompt_token_ids=tuple(range(first, first + num_tokens)),
        **fields,  # type: ignore[arg-type]
    )


async def test_a_request_placed_at_once_arrives_once_with_its_uncached_tokens() -> None:
    scheduler, metrics = make()
    placement = await scheduler.schedule(req("now 'é'", 60))
    assert placement.prefill is not None and placement.prefill.worker_id == "p0"
    assert metrics.arrivals == [(60, MODEL)]
    assert metrics.prefill_tokens == 60


async def test_a_queued_request_arrives_when_it_is_queued_not_again_when_placed() -> None:
    """Budget for one 60-token prompt: the next two wait. Each counts as it arrives, before any is placed,
    and the queue's many tries (every 10 ms) count nothing more; placements count as they happen."""
    scheduler, metrics = make()
    await scheduler.schedule(req("first", first=0))
    waiting = [asyncio.create_task(scheduler.schedule(req(f"w{i} \u00e9", first=100 * (i + 1)))) for i in range(2)]
    await asyncio.sleep(0.1)  # ten polls of the queue
    assert scheduler.queue_depth == 2
    assert metrics.arrived_tokens == 180 and len(metrics.arrivals) == 3
    assert metrics.prefill_tokens == 60  # the pool placed one: it cannot show the other two
    scheduler.end_reservation("first")
    placed = await asyncio.wait_for(waiting[0], 1)
    scheduler.end_reservation(placed.request_id)
    await asyncio.wait_for(waiting[1], 1)
    assert metrics.arrived_tokens == 180 and len(metrics.arrivals) == 3
    assert metrics.prefill_tokens == 180


async def test_a_request_that_times_out_in_the_queue_was_demand() -> None:
    scheduler, metrics = make(timeout_s=0.1)
    await scheduler.schedule(req("first"))
    with pytest.raises(NoCapacityError):
        await scheduler.schedule(req("late", first=500))
    assert metrics.arrived_tokens == 120  # both arrived
    assert metrics.prefill_tokens == 60  # one was placed


async def test_only_requests_headed_for_prefill_arrive_there() -> None:
    """A short prompt (the decode worker computes it), a decode-only Schedule (its prefill ran already) and a
    local-only one are no prefill demand."""
    scheduler, metrics = make(prefill_budget=10_000)
    short = await scheduler.schedule(req("short", THRESHOLD - 1))
    assert short.local_prefill
    await scheduler.schedule(req("decode-only", 500, first=1000, prefill_done_on_worker_id="p0"))
    local = await scheduler.schedule(req("local-only", 500, first=2000, local_prefill_only=True))
    assert local.local_prefill
    assert metrics.arrivals == []
    await scheduler.schedule(req("long", THRESHOLD, first=3000))
    assert metrics.arrivals == [(THRESHOLD, MODEL)]


async def test_a_cached_prefix_does_not_arrive_at_prefill_even_behind_a_queue() -> None:
    """The tokens counted are the queue gauge's estimate (the prompt less what some worker holds), for a
    request placed at once and for one that goes into the queue behind another untried."""
    scheduler, metrics = make(prefill_budget=200)
    doc = list(range(9000, 9000 + 4 * BLOCK))  # 64 tokens that p0 holds
    scheduler.index.store("p0", BlockHasher(BLOCK).block_hashes(doc))

    def with_doc(request_id: str, first: int) -> ScheduleRequest:
        prompt = doc + list(range(first, first + 100))
        return ScheduleRequest(
            request_id=request_id,
            model=MODEL,
            num_prompt_tokens=len(prompt),
            max_tokens=4,
            prompt_token_ids=tuple(prompt),
        )

    await scheduler.schedule(with_doc("placed", 0))  # 100 uncached of 164
    await scheduler.schedule(req("fills", 100, first=5000))  # 200 of 200 in flight
    head = asyncio.create_task(scheduler.schedule(req("head", 100, first=6000)))
    await asyncio.sleep(0.02)
    behind = asyncio.create_task(scheduler.schedule(with_doc("behind", 1000)))  # queued behind head, untried
    await asyncio.sleep(0.02)
    assert scheduler.queue_depth == 2
    assert [n for n, _ in metrics.arrivals] == [100, 100, 100, 100]
    assert scheduler.queued()["prefill"] == (2, 200)  # the gauge's figure is the same estimate
    for task in (head, behind):
        task.cancel()


async def test_a_burst_run_on_the_decode_worker_was_prefill_demand() -> None:
    """A long prompt run on its decode worker because the prefill worker was backed up: the prefill pool
    was short of it, so it arrives there, while the placed counter counts only the handed-off one."""
    scheduler, metrics = make(prefill_budget=10_000, burst=True, decode_blocks=1000)
    await scheduler.schedule(req("ahead", 1000))
    burst = await scheduler.schedule(req("burst", 1000, first=5000))
    assert burst.local_prefill and "burst" in burst.reason
    assert metrics.arrived_tokens == 2000
    assert metrics.prefill_tokens == 1000
