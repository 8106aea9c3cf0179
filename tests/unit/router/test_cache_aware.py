"""Token budgets and the cache_aware policy: locality until saturation, then balance."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.common.block_hash import BlockHasher
from tandem.common.errors import NoCapacityError
from tandem.common.registry import WorkerLoad, WorkerRecord
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.kv_index import KVIndex
from tandem.router.policy import CacheAwarePolicy, CacheAwareWeights, ScheduleRequest, create_policy
from tandem.router.reservations import ReservationTable
from tandem.router.scheduler import Scheduler
from tests.kit.clock import FakeClock
from tests.kit.workers import StaticView

BLOCK = 16
DOC = list(range(1000, 1000 + 4 * BLOCK))  # 4 full blocks


def worker(worker_id: str, role: str, *, num_kv_blocks: int = 100, **load: int) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,
        model="m",
        address=f"{worker_id}:1",
        block_size_tokens=BLOCK,
        num_kv_blocks=num_kv_blocks,
        load=WorkerLoad(**load),  # type: ignore[arg-type]
    )


def make_scheduler(
    workers: list[WorkerRecord], *, policy: str = "cache_aware", prefill_budget: int = 1000
) -> tuple[Scheduler, KVIndex, FakeClock]:
    clock = FakeClock()
    index = KVIndex()
    scheduler = Scheduler(
        StaticView(workers),
        create_policy(policy),
        ReservationTable(lease_s=60, clock=clock),
        budget=BudgetConfig(prefill_tokens_in_flight=prefill_budget),
        index=index,
    )
    return scheduler, index, clock


def request(request_id: str, prompt: list[int], *, salt: str = "", max_tokens: int = 8) -> ScheduleRequest:
    return ScheduleRequest(
        request_id=request_id,
        model="m",
        num_prompt_tokens=len(prompt),
        max_tokens=max_tokens,
        prompt_token_ids=tuple(prompt),
        cache_salt=salt,
    )


async def test_goes_where_the_prefix_is_cached_and_reports_it() -> None:
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode")]
    scheduler, index, _ = make_scheduler(workers)
    index.store("p1", BlockHasher(BLOCK).block_hashes(DOC))
    prompt = DOC + [7] * 10
    for i in range(3):
        placement = await scheduler.schedule(request(f"r{i}", prompt))
        assert placement.prefill.worker_id == "p1"
        assert placement.num_cached_tokens == 4 * BLOCK
        assert "cached=64" in placement.reason
        # budget holds only the uncached tokens
        assert scheduler.reservations.tokens_by_worker()["p1"] == (i + 1) * 10


async def test_cache_salt_isolates_tenants() -> None:
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode")]
    scheduler, index, _ = make_scheduler(workers)
    index.store("p1", BlockHasher(BLOCK).block_hashes(DOC, cache_salt="tenant-a"))
    assert (await scheduler.schedule(request("a", [*DOC, 1], salt="tenant-a"))).num_cached_tokens == 64
    assert (await scheduler.schedule(request("b", [*DOC, 1], salt="tenant-b"))).num_cached_tokens == 0


async def test_stays_warm_until_the_budget_is_spent_then_spreads() -> None:
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode", num_kv_blocks=10_000)]
    scheduler, index, _ = make_scheduler(workers, prefill_budget=100)
    index.store("p0", BlockHasher(BLOCK).block_hashes(DOC))
    prompt = DOC + [5] * 30  # 30 uncached tokens on p0, 94 on p1
    chosen = [(await scheduler.schedule(request(f"r{i}", prompt))).prefill.worker_id for i in range(4)]
    # p0 takes 30 + 30 + 30 = 90 of its 100 tokens; the 4th no longer fits there
    assert chosen == ["p0", "p0", "p0", "p1"]


async def test_cold_requests_go_to_the_emptier_cache() -> None:
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode")]
    scheduler, index, _ = make_scheduler(workers)
    index.store("p0", list(range(50)))  # p0's cache is half full of other prompts
    placement = await scheduler.schedule(request("r", [3] * 40))
    assert placement.prefill.worker_id == "p1"


async def test_decode_budget_is_kv_tokens_from_the_engine_cache() -> None:
    workers = [
        worker("p0", "prefill"),
        worker("d0", "decode", num_kv_blocks=10),
        worker("d1", "decode", num_kv_blocks=10),
    ]
    scheduler, _, _ = make_scheduler(workers)  # decode capacity 0.9 * 160 = 144 tokens
    first = await scheduler.schedule(request("r1", [1] * 100, max_tokens=20))
    second = await scheduler.schedule(request("r2", [1] * 100, max_tokens=20))
    assert {first.decode.worker_id, second.decode.worker_id} == {"d0", "d1"}
    with pytest.raises(NoCapacityError):
        scheduler.place_now(request("r3", [1] * 100, max_tokens=20), workers)


async def test_worker_reports_correct_drift_of_old_reservations() -> None:
    p0 = worker("p0", "prefill")
    workers = [p0, worker("d0", "decode", num_kv_blocks=10_000)]
    scheduler, _, clock = make_scheduler(workers, prefill_budget=100)
    await scheduler.schedule(request("r1", [1] * 90))  # never released: the caller crashed
    with pytest.raises(NoCapacityError):
        scheduler.place_now(request("r2", [2] * 20), workers)
    clock.advance(10)  # older than a heartbeat; p0 reports nothing in flight
    assert scheduler.place_now(request("r2", [2] * 20), workers).prefill.worker_id == "p0"
    # while the worker still reports the tokens, they count
    busy = dataclasses.replace(p0, load=WorkerLoad(num_prompt_tokens_in_flight=200))
    view = BudgetView(scheduler.reservations, BudgetConfig(prefill_tokens_in_flight=100))
    assert view.load_tokens(busy) == 90 + 20


def test_decode_reports_above_the_ledger_count_in_full() -> None:
    d0 = worker("d0", "decode", num_kv_blocks=10, num_kv_tokens_in_flight=120)
    view = BudgetView(ReservationTable(lease_s=10), BudgetConfig())
    assert view.load_tokens(d0) == 120
    assert view.kv_fullness(d0) == pytest.approx(120 / 144)


def test_scores_are_in_unit_interval_and_weights_come_from_config() -> None:
    policy = CacheAwarePolicy(CacheAwareWeights(prefix_locality=0, token_load=1, kv_headroom=0))
    table = ReservationTable(lease_s=10, clock=FakeClock())
    table.reserve("x", ("p0",), {"p0": 50})
    # token_load: 50 in flight + 50 placed lately, of a 200-token budget
    view = BudgetView(table, BudgetConfig(prefill_tokens_in_flight=200), cached_tokens={"p0": 64})
    req = request("r", DOC)
    p0 = worker("p0", "prefill")
    assert policy.score(req, p0, view) == pytest.approx(0.5)
    values = CacheAwarePolicy().scorers(req, p0, view)
    assert values == pytest.approx({"prefix_locality": 1.0, "token_load": 0.5, "kv_headroom": 1.0})
    for w in (p0, worker("d0", "decode"), worker("p1", "prefill", num_kv_blocks=0)):
        assert 0.0 <= CacheAwarePolicy().score(req, w, view) <= 1.0


async def test_round_robin_ignores_the_cache_for_ab_runs() -> None:
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode")]
    scheduler, index, _ = make_scheduler(workers, policy="round_robin")
    index.store("p1", BlockHasher(BLOCK).block_hashes(DOC))
    chosen = [(await scheduler.schedule(request(f"r{i}", DOC))).prefill.worker_id for i in range(4)]
    assert chosen == ["p0", "p1", "p0", "p1"]


async def test_workers_that_leave_the_registry_leave_the_index() -> None:
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode")]
    scheduler, index, _ = make_scheduler(workers)
    index.store("gone", [1, 2])
    await scheduler.schedule(request("r", DOC))
    assert "gone" not in index.workers()


async def test_cold_prompts_spread_over_workers_that_just_computed_others() -> None:
    """Between sequential requests nothing is in flight and every cache looks alike; the
    work placed lately still tells the workers apart, so new tenants do not pile up."""
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode", num_kv_blocks=10_000)]
    scheduler, _, _ = make_scheduler(workers)
    chosen = []
    for tenant in range(4):
        placement = await scheduler.schedule(request(f"t{tenant}", [tenant + 1] * 200, salt=str(tenant)))
        scheduler.end_reservation(placement.request_id)
        chosen.append(placement.prefill.worker_id)
    assert sorted(chosen) == ["p0", "p0", "p1", "p1"]


async def test_requests_without_a_token_count_spread_by_requests_in_flight() -> None:
    """The tie tolerance absorbs token-score noise between replicas; a request without a token
    count has no token score, and the in-flight count (a difference below the tolerance) decides
    exactly: four such requests on two workers of each role land two and two, and a freed slot
    takes the next one."""
    workers = [worker("p0", "prefill"), worker("p1", "prefill"), worker("d0", "decode"), worker("d1", "decode")]
    scheduler, _, _ = make_scheduler(workers)
    placements = [
        await scheduler.schedule(ScheduleRequest(request_id=f"r{i}", model="m"))
        for i in range(4)
    ]
    assert sorted(p.prefill.worker_id for p in placements) == ["p0", "p0", "p1", "p1"]
    assert sorted(p.decode.worker_id for p in placements) == ["d0", "d0", "d1", "d1"]
    freed = next(p for p in placements if p.prefill.worker_id == "p1")
    scheduler.end_reservation(freed.request_id)
    follow_up = await scheduler.schedule(ScheduleRequest(request_id="r-next", model="m"))
    assert follow_up.prefill.worker_id == "p1"
