"""Pending demand: refusals of a pool at zero, counted over a window and published as a gauge."""

from __future__ import annotations

from tandem.router.metrics import NullRouterMetrics
from tandem.router.pending_demand import MAX_COUNTED, PendingDemand
from tests.kit.clock import FakeClock


class Published(NullRouterMetrics):
    def __init__(self) -> None:
        self.writes: list[tuple[str, str, int]] = []

    def set_pending_demand(self, role: str, model: str, num_refused: int) -> None:
        self.writes.append((role, model, num_refused))


def test_refusals_count_for_the_window_then_read_zero_once() -> None:
    clock, metrics = FakeClock(), Published()
    demand = PendingDemand(metrics, window_s=60.0, clock=clock)
    demand.note("decode", "SmolLM2-135M-Instruct")
    clock.advance(30)
    demand.note("decode", "SmolLM2-135M-Instruct")
    demand.note("prefill", "modèle-ü")
    assert metrics.writes == [
        ("decode", "SmolLM2-135M-Instruct", 1),
        ("decode", "SmolLM2-135M-Instruct", 2),
        ("prefill", "modèle-ü", 1),
    ]
    clock.advance(31)  # the first refusal left the window
    assert demand.counts() == {("decode", "SmolLM2-135M-Instruct"): 1, ("prefill", "modèle-ü"): 1}
    clock.advance(30)
    metrics.writes.clear()
    demand.refresh()
    assert sorted(metrics.writes) == [("decode", "SmolLM2-135M-Instruct", 0), ("prefill", "modèle-ü", 0)]
    metrics.writes.clear()
    demand.refresh()  # zero once, then no more: Ray drops the series
    assert metrics.writes == [] and demand.counts() == {}


def test_a_flood_of_retries_saturates_the_count() -> None:
    clock, metrics = FakeClock(), Published()
    demand = PendingDemand(metrics, window_s=60.0, clock=clock)
    for _ in range(MAX_COUNTED + 5):
        demand.note("decode", "")
    assert demand.counts() == {("decode", ""): MAX_COUNTED}
