"""Adapter-aware placement (issue 40): LoRA requests go only to workers with adapter slots, prefer the
workers that hold their adapter, then a free slot, then an eviction; a burst for a cold adapter loads
it once per role (the overlay), not on every worker; base-model requests are placed as before."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import msgspec
import numpy as np
import pytest

from tandem.common.errors import NoCapacityError
from tandem.common.registry import WorkerRecord
from tandem.common.router_client import RouterClient
from tandem.router.adapter_slots import AdapterOverlay, record_columns
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.deployment import schedule_request_from_proto
from tandem.router.handoff import _decode_pending, _encode_pending
from tandem.router.ledger_events import WaitingRequest
from tandem.router.ledger_mirror import RemoteWaiter
from tandem.router.placement import PendingRequest
from tandem.router.policy import CacheAwarePolicy, CacheAwareWeights, ScheduleRequest
from tandem.router.pool import PoolArrays
from tandem.router.reservations import ReservationTable
from tandem.router.scheduler import Scheduler
from tandem.v1 import router_pb2
from tests.kit import router as kit
from tests.kit.clock import FakeClock
from tests.kit.router import FakeRouterServicer, serving_router

ADAPTER = "support-bot@3"


def lora_worker(worker_id: str, role: str, adapters: tuple[str, ...] = (), max_adapters: int = 2) -> WorkerRecord:
    return WorkerRecord(
        worker_id,
        role,
        "m",
        f"{worker_id}:1",
        block_size_tokens=16,
        num_kv_blocks=1000,
        max_adapters=max_adapters,
        adapters=adapters,
    )


def request(i: int, adapter: str = ADAPTER, tokens: int = 200) -> ScheduleRequest:
    return ScheduleRequest(
        request_id=f"r{i}-日本語-🙂", model="m", num_prompt_tokens=tokens, max_tokens=20, adapter=adapter
    )


def choices(workers: list[WorkerRecord], role: str, num: int = 40, adapter: str = ADAPTER) -> Counter[str]:
    policy = CacheAwarePolicy()
    view = BudgetView(ReservationTable(lease_s=60), BudgetConfig())
    chosen: Counter[str] = Counter()
    for i in range(num):
        scored = policy.choose(request(i, adapter), role, workers, view)
        assert scored is not None
        chosen[scored.worker.worker_id] += 1
    return chosen


def test_the_worker_holding_the_adapter_is_preferred_on_both_roles() -> None:
    workers = [
        lora_worker("p0", "prefill", ("other@1",)),
        lora_worker("p1", "prefill", ("other@1", ADAPTER)),
        lora_worker("p2", "prefill"),
        lora_worker("d0", "decode"),
        lora_worker("d1", "decode", (ADAPTER,)),
    ]
    assert choices(workers, "prefill") == {"p1": 40}
    assert choices(workers, "decode") == {"d1": 40}
    # Another adapter's requests share the free slots (p0 and p2 have one; p1 is full).
    assert set(choices(workers, "prefill", adapter="rare@1")) == {"p0", "p2"}


def test_a_free_slot_is_taken_before_an_eviction() -> None:
    workers = [
        lora_worker("p0", "prefill", ("a@1", "b@1")),
        lora_worker("p1", "prefill", ("c@1",)),
        lora_worker("p2", "prefill", ("d@1", "e@1")),
    ]
    assert choices(workers, "prefill") == {"p1": 40}
    columns = record_columns(workers, ADAPTER)
    assert columns.free_slot.tolist() == [False, True, False]
    assert columns.resident.tolist() == [False, False, False]


def test_a_rare_adapter_is_not_starved_when_every_slot_is_taken() -> None:
    """No slot free anywhere: it still goes somewhere (the least loaded), evicting that worker's LRU."""
    workers = [lora_worker(f"p{i}", "prefill", (f"x{i}@1", f"y{i}@1")) for i in range(3)]
    table = ReservationTable(lease_s=60)
    table.reserve("busy0", ("p0",), {"p0": 8000})
    table.reserve("busy1", ("p1",), {"p1": 8000})
    scored = CacheAwarePolicy().choose(request(0, "rare@2"), "prefill", workers, BudgetView(table, BudgetConfig()))
    assert scored is not None and scored.worker.worker_id == "p2"


def test_a_popular_adapter_stays_put_under_load_and_spreads_only_when_its_workers_are_out_of_budget() -> None:
    workers = [lora_worker("p0", "prefill", (ADAPTER, "x@1")), lora_worker("p1", "prefill", ("y@1", "z@1"))]
    policy = CacheAwarePolicy()
    table = ReservationTable(lease_s=60)
    # p0 is much busier than p1, but p1 would have to evict: the adapter stays on p0.
    table.reserve("busy", ("p0",), {"p0": 12_000})
    scored = policy.choose(request(0), "prefill", workers, BudgetView(table, BudgetConfig()))
    assert scored is not None and scored.worker.worker_id == "p0"
    # p0's budget is spent (16,384 prompt tokens in flight): the filter drops it and the adapter
    # spreads to p1.
    table.reserve("full", ("p0",), {"p0": 4_300})
    scored = policy.choose(request(1), "prefill", workers, BudgetView(table, BudgetConfig()))
    assert scored is not None and scored.worker.worker_id == "p1"


def test_a_worker_with_lora_off_never_gets_an_adapter_request() -> None:
    workers = [
        lora_worker("p0", "prefill", max_adapters=0),
        lora_worker("p1", "prefill", ("x@1", "y@1")),
        lora_worker("d0", "decode", max_adapters=0),
        lora_worker("d1", "decode", ("x@1", "y@1")),
    ]
    table = ReservationTable(lease_s=60)
    table.reserve("busy", ("p1", "d1"), {"p1": 12_000, "d1": 12_000})
    view = BudgetView(table, BudgetConfig())
    policy = CacheAwarePolicy()
    for i in range(20):
        for role, lora_on in (("prefill", "p1"), ("decode", "d1")):
            scored = policy.choose(request(i), role, workers, view)
            assert scored is not None and scored.worker.worker_id == lora_on
    # A base-model request still goes to the idle worker with LoRA off.
    base = replace(request(0), adapter="")
    scored = policy.choose(base, "prefill", workers, view)
    assert scored is not None and scored.worker.worker_id == "p0"


@pytest.mark.asyncio
async def test_no_worker_with_adapter_slots_is_a_clear_no_capacity_error() -> None:
    workers = [lora_worker("p0", "prefill", max_adapters=0), lora_worker("d0", "decode", max_adapters=0)]
    scheduler = kit.make_scheduler(workers)
    with pytest.raises(NoCapacityError) as caught:
        await scheduler.schedule(request(0))
    message = str(caught.value)
    assert "no decode worker with LoRA adapters available for model 'm'" in message
    assert "0 with adapter slots" in message
    assert ":1" not in message  # no worker address
    # The base model is served by the same workers.
    placed = await scheduler.schedule(replace(request(1), adapter=""))
    assert placed.decode.worker_id == "d0"


def _cold_burst(scheduler: Scheduler, workers: list[WorkerRecord], num: int = 12) -> tuple[set[str], set[str]]:
    prefill, decode = set(), set()
    for i in range(num):
        decision = scheduler.place_now(request(i, "cold@1", tokens=400), workers)
        assert decision.prefill is not None
        prefill.add(decision.prefill.worker_id)
        decode.add(decision.decode.worker_id)
    return prefill, decode


def test_the_overlay_keeps_a_burst_for_a_cold_adapter_on_one_worker_per_role() -> None:
    """The records do not change during the burst (the heartbeat lags): without the overlay the token
    load spreads the burst and every worker loads the adapter; with it, one worker per role does."""
    workers = [lora_worker(f"p{i}", "prefill") for i in range(4)] + [lora_worker(f"d{i}", "decode") for i in range(4)]
    clock = FakeClock()
    scheduler = kit.make_scheduler(workers, clock=clock)
    assert _cold_burst(scheduler, workers) == ({_one(scheduler, "p")}, {_one(scheduler, "d")})

    blind = kit.make_scheduler(workers, clock=clock)
    blind._placer.adapters.ttl_s = 0.0  # the records alone
    prefill, decode = _cold_burst(blind, workers)
    assert len(prefill) > 1 and len(decode) > 1


def _one(scheduler: Scheduler, prefix: str) -> str:
    overlay: AdapterOverlay = scheduler._placer.adapters
    holders = [w for (w, a) in overlay._placed if a == "cold@1" and w.startswith(prefix)]
    assert len(holders) == 1, holders
    return holders[0]


def test_the_overlay_plays_the_workers_lru_and_expires() -> None:
    clock = FakeClock()
    overlay = AdapterOverlay(ttl_s=5.0, clock=clock)
    w = lora_worker("p0", "prefill", ("a@1", "b@1"))
    overlay.placed("p0", "a@1")  # a used: b is now the least recently used
    overlay.placed("p0", "c@1")  # c loaded: b evicted
    assert overlay.loaded(w) == ("a@1", "c@1")
    columns = overlay.columns([w], "b@1")
    assert columns.resident.tolist() == [False] and columns.free_slot.tolist() == [False]
    clock.advance(5.1)
    assert overlay.loaded(w) == ("a@1", "b@1")  # the record again
    overlay.placed("p0", "d@1")
    assert len(overlay) == 1  # the expired entries went


def test_base_requests_score_exactly_as_without_the_adapter_scorer() -> None:
    workers = [lora_worker(f"p{i}", "prefill", (ADAPTER,) if i == 1 else ()) for i in range(5)]
    table = ReservationTable(lease_s=60)
    table.reserve("busy", ("p2",), {"p2": 5000})
    view = BudgetView(table, BudgetConfig())
    pool = PoolArrays.from_view("prefill", "m", workers, view, cached_tokens={"p3": 96})
    base = replace(request(0), adapter="")
    with_it = CacheAwarePolicy().scores(base, pool)
    without = CacheAwarePolicy(CacheAwareWeights(adapter_affinity=0.0)).scores(base, pool)  # type: ignore[call-arg]
    assert np.array_equal(with_it, without)
    assert not np.array_equal(CacheAwarePolicy().scores(request(0), pool), with_it)


def test_the_adapter_travels_from_the_wire_and_through_a_hand_off() -> None:
    proto = router_pb2.ScheduleRequest(request_id="r", model="m", num_prompt_tokens=10, adapter=ADAPTER)
    assert schedule_request_from_proto(proto).adapter == ADAPTER
    pending = PendingRequest(request(0))
    waiting = msgspec.msgpack.decode(msgspec.msgpack.encode(_encode_pending(pending, "normal")), type=WaitingRequest)
    remote = RemoteWaiter(request(0).request_id, "t", 0, 0.0, "other", waiting)
    decoded = _decode_pending(remote)
    assert decoded is not None and decoded.request.adapter == ADAPTER


@pytest.mark.asyncio
async def test_the_client_sends_the_adapter_and_gets_the_no_adapter_worker_error_back() -> None:
    """RouterClient → the wire → the deployment's decoding, and the router's refusal back through the
    status and trailers the deployment sets (the gateway maps NoCapacityError to a 503 in the OpenAI shape)."""
    workers = [lora_worker("p0", "prefill", max_adapters=0), lora_worker("d0", "decode", max_adapters=0)]
    with pytest.raises(NoCapacityError) as caught:
        await kit.make_scheduler(workers).schedule(request(0))
    servicer = FakeRouterServicer(errors_by_model={"lora-off": caught.value})
    async with serving_router(servicer) as address, RouterClient(address, timeout_s=2) as client:
        await client.schedule("req-1", "m", num_prompt_tokens=5, adapter=ADAPTER)
        with pytest.raises(NoCapacityError, match="no decode worker with LoRA adapters available"):
            await client.schedule("req-2", "lora-off", num_prompt_tokens=5, adapter=ADAPTER)
        await client.schedule("req-3", "m", num_prompt_tokens=5)
    sent, _, base = servicer.scheduled
    assert schedule_request_from_proto(sent).adapter == ADAPTER
    assert schedule_request_from_proto(base).adapter == ""


def test_a_heartbeat_that_moves_the_adapter_moves_the_placements() -> None:
    """The fleet table takes newer records in place (same workers, new loads and adapters): the
    holders of each adapter follow them."""
    before = [
        lora_worker("p0", "prefill", (ADAPTER,)),
        lora_worker("p1", "prefill", ("x@1", "y@1")),
        lora_worker("d0", "decode", (ADAPTER,)),
        lora_worker("d1", "decode", ("x@1", "y@1")),
    ]
    clock = FakeClock()
    scheduler = kit.make_scheduler(before, clock=clock)
    first = scheduler.place_now(request(0), before)
    assert first.prefill is not None and (first.prefill.worker_id, first.decode.worker_id) == ("p0", "d0")
    clock.advance(6.0)  # past the overlay: the records alone
    after = [
        replace(before[0], adapters=("x@1", "y@1")),
        replace(before[1], adapters=("y@1", ADAPTER)),
        replace(before[2], adapters=("x@1", "y@1")),
        replace(before[3], adapters=(ADAPTER, "y@1")),
    ]
    second = scheduler.place_now(request(1), after)
    assert second.prefill is not None and (second.prefill.worker_id, second.decode.worker_id) == ("p1", "d1")
