"""The fleet table: a whole pool's budgets and scores as arrays, equal to the one-worker-at-a-time
path (BudgetView) they replace, kept in step in place."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tandem.common.registry import WorkerLoad, WorkerRecord
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.fair_share import TenantShares
from tandem.router.fleet import FleetTable
from tandem.router.policy import CacheAwarePolicy, LeastLoadedPolicy, ScheduleRequest
from tandem.router.pool import PoolArrays
from tandem.router.reservations import ReservationTable
from tests.kit.clock import FakeClock


def pool_workers(rnd: random.Random, n: int = 40) -> list[WorkerRecord]:
    workers = []
    for i in range(n):
        role = "prefill" if i % 2 else "decode"
        workers.append(
            WorkerRecord(
                f"w{i:02d}",
                role,
                "m",
                f"w{i}:1",
                block_size_tokens=16,
                num_kv_blocks=rnd.choice((0, 200, 5_000)),
                load=WorkerLoad(
                    num_running_requests=rnd.randrange(5),
                    num_waiting_requests=rnd.randrange(3),
                    kv_usage=rnd.random(),
                    num_prompt_tokens_in_flight=rnd.randrange(3000),
                    num_kv_tokens_in_flight=rnd.randrange(30_000),
                ),
            )
        )
    return workers


@pytest.mark.parametrize("seed", range(5))
def test_the_arrays_equal_the_one_worker_at_a_time_budget_view(seed: int) -> None:
    rnd = random.Random(seed)
    clock = FakeClock()
    workers = pool_workers(rnd)
    table = ReservationTable(lease_s=600, clock=clock, young_s=2.0)
    config = BudgetConfig(prefill_tokens_in_flight=4096)
    fleet = FleetTable.build(workers, config, table)
    for step in range(60):  # reservations that come, age past young_s and go, while the fleet follows
        clock.advance(rnd.random() * 0.5)
        if rnd.random() < 0.6 or not len(table):
            chosen = rnd.sample(workers, 2)
            table.reserve(
                f"r{step}", tuple(w.worker_id for w in chosen), {w.worker_id: rnd.randrange(1, 3000) for w in chosen}
            )
        else:
            table.end(rnd.choice(table.reservations()).request_id)
        fleet.refresh_own(table.drain_changed(), table)
        view = BudgetView(table, config)
        for role in ("prefill", "decode"):
            arrays = fleet.arrays(role, "m", {}, clock())
            assert arrays is not None
            reference = PoolArrays.from_view(role, "m", workers, view)
            assert [w.worker_id for w in arrays.workers] == [w.worker_id for w in reference.workers]
            for field in ("capacity_tokens", "load_tokens", "recent_tokens", "kv_fullness", "num_in_flight"):
                np.testing.assert_allclose(getattr(arrays, field), getattr(reference, field), rtol=1e-9, err_msg=field)
            request = ScheduleRequest(request_id=f"q{step}", model="m", num_prompt_tokens=700, max_tokens=50)
            for policy in (CacheAwarePolicy(), LeastLoadedPolicy()):
                np.testing.assert_allclose(policy.scores(request, arrays), policy.scores(request, reference))
                assert (policy.eligible(request, arrays) == policy.eligible(request, reference)).all()


def test_a_heartbeat_updates_the_table_in_place_and_a_new_worker_does_not() -> None:
    rnd = random.Random(1)
    workers = pool_workers(rnd, 6)
    table = ReservationTable(lease_s=600)
    fleet = FleetTable.build(workers, BudgetConfig(), table)
    busier = [dataclasses.replace(w, load=WorkerLoad(num_kv_tokens_in_flight=12_345)) for w in workers]
    assert fleet.update(busier)
    decode = fleet.arrays("decode", "m", {}, 0.0)
    assert decode is not None and (decode.load_tokens == 12_345).all()
    assert not fleet.update([*busier, dataclasses.replace(workers[0], worker_id="w99")])  # someone came
    assert not fleet.update([dataclasses.replace(busier[0], started_unix_s=5.0), *busier[1:]])  # a restart


def test_tenant_shares_decay_and_weigh() -> None:
    now = [1000.0]
    shares = TenantShares(half_life_s=10.0, weights={"gold": 2.0}, wall_clock=lambda: now[0])
    shares.add("a", 1000)
    shares.add("gold", 1000)
    assert shares.served("a") == pytest.approx(1000) and shares.served("gold") == pytest.approx(500)
    now[0] += 10.0
    assert shares.served("a") == pytest.approx(500)
    shares.add("a", 100, at_unix=now[0] - 10.0)  # a placement another replica made 10 s ago
    assert shares.served("a") == pytest.approx(550)
    now[0] += 1000.0
    shares.forget_idle()
    assert shares.snapshot() == {}


class _ChangingView:
    """A WorkerView whose list the test replaces."""

    def __init__(self, workers: list[WorkerRecord]) -> None:
        self.list = workers

    async def workers(self) -> list[WorkerRecord]:
        return self.list


async def test_a_large_fleets_newer_loads_are_taken_in_slices_and_decisions_keep_the_old_list_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from tandem.router import intake as intake_module
    from tandem.router.policy import create_policy
    from tandem.router.scheduler import Scheduler

    workers = pool_workers(random.Random(2), intake_module.SLICED_UPDATE_MIN_WORKERS + 40)
    view = _ChangingView(workers)
    scheduler = Scheduler(view, create_policy("cache_aware"), ReservationTable(lease_s=600))
    await scheduler.refresh_workers()
    assert scheduler.intake.last_workers is workers
    # Every worker reports a new load: a list that is the same fleet, only busier.
    busier = [dataclasses.replace(w, load=WorkerLoad(num_kv_tokens_in_flight=7_777)) for w in workers]
    view.list = busier
    assert await scheduler.intake.workers() is workers  # decisions go on with the list they had...
    taking = scheduler.intake.taking
    assert taking is not None and not taking.done()
    assert await scheduler.intake.workers() is workers  # ...and a second look does not start another take
    assert scheduler.intake.taking is taking
    # The take yields to the loop between slices (here after every chunk): decisions in between see
    # some workers' new loads, with the old list still theirs.
    monkeypatch.setattr(intake_module, "UPDATE_SLICE_S", 0.0)
    seen_partly = False
    while not taking.done():
        await asyncio.sleep(0)
        assert scheduler.intake.fleet is not None
        loads = scheduler.intake.fleet.arrays("decode", "m", {}, 0.0)
        assert loads is not None
        taken = int((loads.load_tokens == 7_777).sum())
        if 0 < taken < len(loads.load_tokens):
            seen_partly = True
            assert scheduler.intake.last_workers is workers
    assert seen_partly
    assert scheduler.intake.last_workers is busier
    assert scheduler.intake.fleet is not None and scheduler.intake.fleet.workers is busier
    decode = scheduler.intake.fleet.arrays("decode", "m", {}, 0.0)
    assert decode is not None and (decode.load_tokens == 7_777).all()
    # A list in which a worker changed what it is (a restart) is taken at once, with a new table.
    fleet_before = scheduler.intake.fleet
    restarted = [dataclasses.replace(busier[0], started_unix_s=9.0), *busier[1:]]
    view.list = restarted
    await scheduler.refresh_workers()
    assert scheduler.intake.last_workers is restarted and scheduler.intake.fleet is not fleet_before
    assert scheduler.intake.fleet.workers is restarted


async def test_a_small_fleets_newer_list_is_taken_at_once() -> None:
    from tandem.router.policy import create_policy
    from tandem.router.scheduler import Scheduler

    workers = pool_workers(random.Random(3), 8)
    view = _ChangingView(workers)
    scheduler = Scheduler(view, create_policy("cache_aware"), ReservationTable(lease_s=600))
    await scheduler.refresh_workers()
    view.list = [dataclasses.replace(w, load=WorkerLoad(num_kv_tokens_in_flight=5)) for w in workers]
    assert await scheduler.intake.workers() is view.list and scheduler.intake.taking is None
