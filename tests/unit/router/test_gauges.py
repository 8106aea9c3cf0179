"""The router's gauges per model (tandem.router.gauges): two models' workers in one router, each
model's pools and queue published under its own ``model`` label, the other's load never in them,
and a model whose workers all left read zero once and then no more. (The real Ray export of the
same gauges, read by the operator's parser: tests/integration/test_router_ray.py.)"""

from __future__ import annotations

import asyncio

import pytest

from tandem.common.errors import InvalidRequestError
from tandem.common.registry import WorkerRecord
from tandem.router.metrics import NullRouterMetrics
from tandem.router.policy import ScheduleRequest
from tests.kit.router import make_scheduler
from tests.kit.workers import StaticView, make_worker

pytestmark = pytest.mark.asyncio


class LabelledMetrics(NullRouterMetrics):
    """Every value the router sets, by its full label set, and the order it set them in."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, ...], float] = {}
        self.log: list[tuple[str, ...]] = []
        self.schedules: list[tuple[str, str]] = []
        self.placements: list[tuple[bool, str]] = []
        self.waits: list[tuple[str, str]] = []

    def _set(self, key: tuple[str, ...], value: float) -> None:
        self.values[key] = value
        self.log.append(key)

    def observe_schedule(self, duration_s: float, *, outcome: str, model: str) -> None:
        self.schedules.append((outcome, model))

    def set_in_flight(self, worker_id: str, model: str, num_requests: int) -> None:
        self._set(("in_flight", worker_id, model), num_requests)

    def set_tokens_in_flight(self, worker_id: str, role: str, model: str, num_tokens: int) -> None:
        self._set(("tokens", worker_id, role, model), num_tokens)

    def set_pool(self, role: str, model: str, budget_used_fraction: float, num_in_flight: int) -> None:
        self._set(("pool_used", role, model), budget_used_fraction)
        self._set(("pool_in_flight", role, model), num_in_flight)

    def set_queued(self, waiting_for: str, model: str, num_requests: int, num_uncached_tokens: int) -> None:
        self._set(("queued", waiting_for, model), num_requests)
        self._set(("queued_tokens", waiting_for, model), num_uncached_tokens)

    def observe_queue_wait(self, duration_s: float, *, outcome: str, model: str) -> None:
        self.waits.append((outcome, model))

    def count_placement(self, *, local_prefill: bool, model: str) -> None:
        self.placements.append((local_prefill, model))


def two_models() -> list[WorkerRecord]:
    return [
        make_worker(f"{model}-{role[0]}{i}", role, model=model)
        for model in ("alpha", "beta")
        for role in ("prefill", "decode")
        for i in range(2)
    ]


def req(request_id: str, model: str, tokens: int) -> ScheduleRequest:
    return ScheduleRequest(request_id=request_id, model=model, num_prompt_tokens=tokens, max_tokens=4, tenant="t")


async def test_each_models_pools_and_queue_are_published_under_its_own_label() -> None:
    metrics = LabelledMetrics()
    view = StaticView(two_models())
    # Prefill budget 100 tokens per worker: alpha's two prefill workers take one 60-token prompt each,
    # its third waits for prefill; beta is placed without waiting.
    scheduler = make_scheduler(
        view=view,
        metrics=metrics,
        lease_s=60,
        budget={"prefill_tokens_in_flight": 100},
        queue={"timeout_s": 5.0, "poll_interval_s": 0.01},
    )
    await scheduler.refresh_workers()
    await scheduler.schedule(req("a1", "alpha", 60))
    await scheduler.schedule(req("a2", "alpha", 60))
    waiting = asyncio.create_task(scheduler.schedule(req("a3", "alpha", 70)))
    await scheduler.schedule(req("b1", "beta", 30))
    await asyncio.sleep(0.05)
    scheduler.tick()
    v = metrics.values

    assert v[("queued", "prefill", "alpha")] == 1 and v[("queued_tokens", "prefill", "alpha")] == 70
    assert v[("queued", "prefill", "beta")] == 0 and v[("queued_tokens", "prefill", "beta")] == 0
    assert v[("pool_in_flight", "prefill", "alpha")] == 2 and v[("pool_in_flight", "decode", "alpha")] == 2
    assert v[("pool_in_flight", "prefill", "beta")] == 1 and v[("pool_in_flight", "decode", "beta")] == 1
    # Budget in use, averaged over the model's own prefill workers only: alpha 60+60 of 200, beta 30 of 200.
    assert v[("pool_used", "prefill", "alpha")] == pytest.approx(0.6)
    assert v[("pool_used", "prefill", "beta")] == pytest.approx(0.15)
    alpha_tokens = sum(n for k, n in v.items() if k[0] == "tokens" and k[2] == "prefill" and k[3] == "alpha")
    beta_tokens = sum(n for k, n in v.items() if k[0] == "tokens" and k[2] == "prefill" and k[3] == "beta")
    assert (alpha_tokens, beta_tokens) == (120, 30)
    # Each worker's series carries its own model.
    assert all(k[-1] == k[1].split("-")[0] for k in v if k[0] in ("in_flight", "tokens"))
    assert sorted(metrics.placements) == [(False, "alpha"), (False, "alpha"), (False, "beta")]

    scheduler.end_reservation("a1")
    await asyncio.wait_for(waiting, 1)
    assert ("admitted", "alpha") in metrics.waits
    assert set(metrics.schedules) == {("ok", "alpha"), ("ok", "beta")}


async def test_an_unknown_model_adds_no_label_value() -> None:
    metrics = LabelledMetrics()
    scheduler = make_scheduler(view=StaticView(two_models()), metrics=metrics, lease_s=60)
    await scheduler.refresh_workers()
    with pytest.raises(InvalidRequestError):
        await scheduler.schedule(req("x", "no-such-model-<script>", 10))
    scheduler.tick()
    assert metrics.schedules == [("model_not_found", "")]
    assert {k[-1] for k in metrics.values} == {"alpha", "beta"}


async def test_a_model_whose_workers_left_reads_zero_once_then_no_more() -> None:
    metrics = LabelledMetrics()
    view = StaticView(two_models())
    scheduler = make_scheduler(view=view, metrics=metrics, lease_s=60)
    await scheduler.refresh_workers()
    await scheduler.schedule(req("b1", "beta", 30))
    scheduler.tick()
    assert metrics.values[("pool_in_flight", "decode", "beta")] == 1
    scheduler.end_reservation("b1")

    view.list = [w for w in view.list if w.model == "alpha"]  # beta's pods are gone
    await scheduler.refresh_workers()
    metrics.log.clear()
    scheduler.tick()
    beta = {k: metrics.values[k] for k in metrics.log if k[-1] == "beta" and k[0] in ("pool_used", "pool_in_flight")}
    beta |= {k: metrics.values[k] for k in metrics.log if k[-1] == "beta" and k[0].startswith("queued")}
    assert len(beta) == 8 and set(beta.values()) == {0}, beta  # its pools and queue: zero, once
    metrics.log.clear()
    scheduler.tick()
    assert metrics.log and not [k for k in metrics.log if k[-1] == "beta"]  # then not set again: Ray drops them
    assert ("pool_in_flight", "decode", "alpha") in metrics.log  # the model still served goes on
