from __future__ import annotations

from collections import Counter

import pytest

from tandem.common.errors import BackendUnavailableError, InvalidRequestError, NoCapacityError
from tandem.common.registry import WorkerRecord
from tandem.router.metrics import NullRouterMetrics
from tandem.router.placement import POOL_AT_ZERO_RETRY_AFTER_S
from tandem.router.policy import ScheduleRequest
from tandem.router.worker_view import CachedWorkerView
from tests.kit.clock import FakeClock
from tests.kit.router import gauges_flushed, make_scheduler
from tests.kit.workers import FakeRegistry, make_pool, make_worker

pytestmark = pytest.mark.asyncio


class RecordingMetrics(NullRouterMetrics):
    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.in_flight: dict[str, int] = {}
        self.pending_demand: dict[tuple[str, str], int] = {}

    def set_pending_demand(self, role: str, model: str, num_refused: int) -> None:
        self.pending_demand[(role, model)] = num_refused

    def observe_schedule(self, duration_s: float, *, outcome: str, model: str) -> None:
        assert duration_s >= 0
        self.outcomes.append(outcome)

    def set_in_flight(self, worker_id: str, model: str, num_requests: int) -> None:
        self.in_flight[worker_id] = num_requests


class Harness:
    def __init__(self, workers: list[WorkerRecord], *, policy: str = "least_loaded", lease_s: float = 600) -> None:
        self.clock = FakeClock()
        self.registry = FakeRegistry(workers)
        self.metrics = RecordingMetrics()
        view = CachedWorkerView(self.registry, refresh_interval_s=0.0, max_stale_s=5.0, clock=self.clock)
        self.scheduler = make_scheduler(
            view=view, metrics=self.metrics, clock=self.clock, policy=policy, lease_s=lease_s
        )

    async def schedule(self, request_id: str, model: str = "m", **kwargs: object):  # type: ignore[no-untyped-def]
        return await self.scheduler.schedule(ScheduleRequest(request_id=request_id, model=model, **kwargs))  # type: ignore[arg-type]


async def test_placement_has_one_worker_of_each_role_and_a_lease() -> None:
    h = Harness(make_pool(2, 2), lease_s=30)
    placement = await h.schedule("r1")
    assert placement.prefill.role == "prefill" and placement.decode.role == "decode"
    assert placement.lease_s == 30
    assert placement.reason.startswith("least_loaded prefill=")
    assert h.scheduler.reservations.num_in_flight(placement.prefill.worker_id) == 1
    assert h.metrics.outcomes == ["ok"]
    await gauges_flushed()
    assert h.metrics.in_flight == {placement.prefill.worker_id: 1, placement.decode.worker_id: 1}


async def test_unreleased_requests_spread_over_all_workers() -> None:
    h = Harness(make_pool(2, 2))
    placements = [await h.schedule(f"r{i}") for i in range(4)]
    assert Counter(p.prefill.worker_id for p in placements) == {"p0": 2, "p1": 2}
    assert Counter(p.decode.worker_id for p in placements) == {"d0": 2, "d1": 2}


async def test_release_frees_the_pair_for_the_next_request() -> None:
    h = Harness(make_pool(2, 1))
    first = await h.schedule("r1")
    assert h.scheduler.end_reservation("r1") is True
    assert h.scheduler.end_reservation("r1") is False
    assert h.scheduler.reservations.in_flight_by_worker() == {}
    await gauges_flushed()
    assert h.metrics.in_flight[first.prefill.worker_id] == 0


async def test_expired_lease_stops_counting() -> None:
    h = Harness(make_pool(2, 1), lease_s=10)
    await h.schedule("crashed-gateway")
    h.clock.advance(11)
    second = await h.schedule("r2")
    # Only r2 is left: the lease of the request nobody released was swept.
    assert h.scheduler.reservations.in_flight_by_worker() == {second.prefill.worker_id: 1, "d0": 1}
    assert h.scheduler.end_reservation("crashed-gateway") is False


async def test_exclude_worker_ids_is_honoured() -> None:
    h = Harness(make_pool(2, 2))
    for i in range(5):
        placement = await h.schedule(f"r{i}", exclude_worker_ids=frozenset({"p0", "d1"}))
        assert (placement.prefill.worker_id, placement.decode.worker_id) == ("p1", "d0")


async def test_retry_of_the_same_request_moves_its_reservation() -> None:
    h = Harness(make_pool(2, 1))
    first = await h.schedule("r1")
    retry = await h.schedule("r1", exclude_worker_ids=frozenset({first.prefill.worker_id}))
    assert retry.prefill.worker_id != first.prefill.worker_id
    assert h.scheduler.reservations.in_flight_by_worker() == {retry.prefill.worker_id: 1, "d0": 1}


async def test_no_worker_of_a_role_is_no_capacity_and_pending_demand() -> None:
    """A pool at zero: NoCapacityError (503 + Retry-After at the gateway) with the longer retry delay,
    counted as that pool's pending demand under the model's label (its prefill pool serves it)."""
    h = Harness(make_pool(2, 0))
    for request_id in ("r1", "r2"):
        with pytest.raises(NoCapacityError, match="no decode worker registered for model 'm'") as info:
            await h.schedule(request_id)
        assert info.value.retry_after_s == POOL_AT_ZERO_RETRY_AFTER_S
    assert h.scheduler.reservations.in_flight_by_worker() == {}
    assert h.metrics.outcomes == ["PoolAtZeroError", "PoolAtZeroError"]
    assert h.metrics.pending_demand == {("decode", "m"): 2}
    h.scheduler.tick()
    assert h.metrics.pending_demand == {("decode", "m"): 2}  # re-published within the window


async def test_busy_or_excluded_workers_are_no_pending_demand() -> None:
    h = Harness(make_pool(1, 1))
    with pytest.raises(NoCapacityError, match="1 excluded"):
        await h.schedule("r1", exclude_worker_ids=frozenset({"p0"}))
    assert h.metrics.pending_demand == {} and h.scheduler.pending_demand.counts() == {}


async def test_empty_registry_is_no_capacity_not_unknown_model() -> None:
    with pytest.raises(NoCapacityError):
        await Harness([]).schedule("r1")


async def test_all_workers_excluded_is_no_capacity() -> None:
    h = Harness(make_pool(1, 1))
    with pytest.raises(NoCapacityError, match="1 excluded"):
        await h.schedule("r1", exclude_worker_ids=frozenset({"p0"}))


async def test_unknown_model_is_model_not_found() -> None:
    h = Harness([*make_pool(1, 1), make_worker("q0", "prefill", model="other")])
    with pytest.raises(InvalidRequestError) as info:
        await h.schedule("r1", model="nope")
    assert info.value.code == "model_not_found"
    assert "served models: m, other" in str(info.value)
    assert h.metrics.outcomes == ["model_not_found"]


@pytest.mark.parametrize("request_id,model", [("", "m"), ("r1", "")])
async def test_missing_request_id_or_model_is_invalid(request_id: str, model: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await Harness(make_pool(1, 1)).schedule(request_id, model)
    assert info.value.code == "invalid_request"


async def test_registry_down_propagates_backend_unavailable() -> None:
    h = Harness(make_pool(1, 1))
    h.registry.fail = True
    with pytest.raises(BackendUnavailableError):
        await h.schedule("r1")


async def test_round_robin_ignores_in_flight() -> None:
    h = Harness(make_pool(2, 2), policy="round_robin")
    placements = [await h.schedule(f"r{i}") for i in range(4)]
    assert [p.prefill.worker_id for p in placements] == ["p0", "p1", "p0", "p1"]


async def test_tick_sweeps_without_traffic_and_refreshes_gauges() -> None:
    h = Harness(make_pool(1, 1), lease_s=10)
    await h.schedule("r1")
    h.metrics.in_flight.clear()
    h.scheduler.tick()
    # Still in flight: the gauges are set again so Ray does not forget them.
    assert h.metrics.in_flight == {"p0": 1, "d0": 1}
    h.clock.advance(11)
    h.scheduler.tick()
    assert h.metrics.in_flight == {"p0": 0, "d0": 0}
    h.metrics.in_flight.clear()
    h.scheduler.tick()
    # Known workers' zeros are refreshed too: a pool at rest reads 0 to the autoscaler, not "no data".
    assert h.metrics.in_flight == {"p0": 0, "d0": 0}


async def test_tick_publishes_each_pools_budget_in_use_and_requests_in_flight() -> None:
    import dataclasses

    pool = [
        dataclasses.replace(w, block_size_tokens=128, num_kv_blocks=10) if w.role == "decode" else w
        for w in make_pool(1, 2)
    ]
    h = Harness(pool)
    published: dict[str, tuple[float, int]] = {}

    def set_pool(role: str, model: str, used: float, n: int) -> None:
        assert model == "m"
        published[role] = (used, n)

    h.metrics.set_pool = set_pool  # type: ignore[method-assign]
    h.scheduler.tick()  # the registry not read yet: no model known, no pool to publish
    assert published == {}
    await h.scheduler.refresh_workers()
    h.scheduler.tick()  # no request yet: an empty pool reads zeros
    assert published == {"prefill": (0.0, 0), "decode": (0.0, 0)}
    await h.schedule("r1", num_prompt_tokens=100, max_tokens=44)  # 144 tokens on one decode worker of 1,152
    h.scheduler.tick()
    used, num_in_flight = published["decode"]
    assert used == pytest.approx(144 / 1152 / 2) and num_in_flight == 1
    used, num_in_flight = published["prefill"]
    assert used == pytest.approx(100 / 16_384) and num_in_flight == 1
    h.scheduler.end_reservation("r1")
    h.scheduler.tick()
    assert published == {"prefill": (0.0, 0), "decode": (0.0, 0)}


async def test_a_model_missing_from_the_cached_list_is_read_for_before_it_is_refused() -> None:
    """With the list refreshed in the background (the deployment), a Schedule for a model whose
    workers registered after the last read finds them; one for a model nobody serves is refused,
    and the next ones for it do not read the registry again for a refresh interval."""

    class RawRegistry(FakeRegistry):
        async def list_raw_records(self, *, batch_size: int = 0) -> list[bytes]:
            self.num_calls += 1
            return [w.to_json().encode() for w in self.workers]

    clock, registry = FakeClock(), RawRegistry(make_pool(1, 1))
    view = CachedWorkerView(registry, refresh_interval_s=0.5, max_stale_s=5.0, clock=clock, refresh_in_background=True)
    scheduler = make_scheduler(view=view, lease_s=60)
    await scheduler.schedule(ScheduleRequest(request_id="r1", model="m", num_prompt_tokens=10, max_tokens=4))
    new_workers = [make_worker("p-new", "prefill", model="new"), make_worker("d-new", "decode", model="new")]
    registry.workers = [*make_pool(1, 1), *new_workers]
    placed = await scheduler.schedule(ScheduleRequest(request_id="r2", model="new", num_prompt_tokens=10, max_tokens=4))
    assert placed.decode.model == "new" and registry.num_calls == 2
    clock.advance(0.1)
    for i in range(3):
        with pytest.raises(InvalidRequestError) as refused:
            await scheduler.schedule(ScheduleRequest(request_id=f"x{i}", model="nobody", num_prompt_tokens=10))
        assert refused.value.code == "model_not_found"
    assert registry.num_calls == 3
