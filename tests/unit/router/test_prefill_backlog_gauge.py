"""The prefill pool's backlog gauge counts what its workers still compute, as the admission counts it.

A request's reservation lives from Schedule to Release: through its prefill and then through its whole
decode. The prefill budget stops counting a reservation once it is older than a heartbeat and the worker
reports less (tandem.router.kernels.budget_state); the gauge the autoscaler reads
(``tandem_router_prefill_tokens_in_flight``, its ``uncached_tokens`` vote) counted every reservation until
Release, so short chats with long answers (make autoscale-demo --scenario short-chats: ~1.35 s of prefill,
~8 s of decode each) read as six times the prefill backlog there was and grew prefill 1 -> 2 -> 3 while
one worker was 60 % busy and TTFT p90 was 2 s of a 5 s SLO.
"""

from __future__ import annotations

import dataclasses

from tandem.common.registry import WorkerLoad, WorkerRecord
from tandem.router.budget import BudgetConfig
from tandem.router.gauges import Gauges
from tandem.router.metrics import NullRouterMetrics
from tandem.router.policy import ScheduleRequest
from tandem.router.reservations import ReservationTable
from tests.kit.router import gauges_flushed, make_scheduler
from tests.kit.workers import TWO_WORKERS


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class TokenMetrics(NullRouterMetrics):
    def __init__(self) -> None:
        self.tokens: dict[tuple[str, str], int] = {}

    def set_tokens_in_flight(self, worker_id: str, role: str, model: str, num_tokens: int) -> None:
        self.tokens[(worker_id, role)] = num_tokens


def _workers(prefill_reports: int, decode_reports: int) -> list[WorkerRecord]:
    """p0 and d0 reporting their tokens in flight at their last heartbeat."""
    p0, d0 = TWO_WORKERS
    return [
        dataclasses.replace(p0, load=WorkerLoad(num_prompt_tokens_in_flight=prefill_reports)),
        dataclasses.replace(d0, load=WorkerLoad(num_kv_tokens_in_flight=decode_reports)),
    ]


async def test_a_finished_prefill_leaves_the_prefill_backlog_while_its_decode_runs() -> None:
    clock, metrics = Clock(), TokenMetrics()
    workers = _workers(prefill_reports=0, decode_reports=0)
    scheduler = make_scheduler(workers, metrics=metrics, clock=clock, lease_s=600)
    await scheduler.refresh_workers()
    request = ScheduleRequest(request_id="chat-ü東", model="m", num_prompt_tokens=60, max_tokens=400)
    await scheduler.schedule(request)
    await gauges_flushed()
    assert metrics.tokens == {("p0", "prefill"): 60, ("d0", "decode"): 460}  # just placed: counted in full

    # Still prefilling (the worker reports the prompt) after a heartbeat: still the prefill pool's backlog.
    clock.now_s += 3.0
    workers[:] = _workers(prefill_reports=60, decode_reports=0)
    await scheduler.refresh_workers()
    scheduler.tick()
    assert metrics.tokens[("p0", "prefill")] == 60

    # Prefill done, the answer streams on d0: the prefill worker reports nothing, and neither its budget
    # nor the gauge counts the request; decode holds it in full until Release.
    clock.now_s += 3.0
    workers[:] = _workers(prefill_reports=0, decode_reports=460)
    await scheduler.refresh_workers()
    scheduler.tick()
    assert metrics.tokens == {("p0", "prefill"): 0, ("d0", "decode"): 460}
    scheduler.end_reservation("chat-ü東")
    await gauges_flushed()
    assert metrics.tokens == {("p0", "prefill"): 0, ("d0", "decode"): 0}


class OtherReplica:
    """SIMULATED: another router replica's reservations as this one's ledger mirrors them (all old)."""

    def __init__(self, tokens: dict[str, int]) -> None:
        self.tokens = tokens

    def others_tokens(self, worker_id: str) -> int:
        return self.tokens.get(worker_id, 0)

    def others_young_tokens(self, worker_id: str) -> int:
        return 0


def test_two_replicas_gauges_add_up_to_what_the_budget_counts() -> None:
    """Each replica publishes its share of the corrected load, so the operator's sum over replicas is the
    admission's count: two old 60-token reservations (one per replica) on p0, which reports one prompt of
    60 still computing, read 30 + 30 = 60, not 120."""
    clock = Clock()
    reservations = ReservationTable(lease_s=600, clock=clock, young_s=2.0)
    reservations.reserve("mine-ü", ("p0", "d0"), {"p0": 60, "d0": 100})
    clock.now_s += 3.0  # older than a heartbeat
    metrics = TokenMetrics()
    gauges = Gauges(metrics, reservations, BudgetConfig(prefill_tokens_in_flight=1000), OtherReplica({"p0": 60}))  # type: ignore[arg-type]
    gauges.refresh(_workers(prefill_reports=60, decode_reports=100), {})
    assert metrics.tokens[("p0", "prefill")] == 30  # its half of min(120 reserved, 60 reported)
    assert metrics.tokens[("d0", "decode")] == 100
    gauges.refresh(_workers(prefill_reports=120, decode_reports=100), {})  # both still computing
    assert metrics.tokens[("p0", "prefill")] == 60
