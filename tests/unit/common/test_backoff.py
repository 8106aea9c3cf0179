from __future__ import annotations

import pytest

from tandem.common.backoff import backoff_delays
from tests.kit.clock import FakeClock


def test_delays_double_up_to_the_cap_and_fit_the_budget() -> None:
    clock = FakeClock()
    delays = []
    for delay_s in backoff_delays(within_s=10.0, clock=clock):
        delays.append(delay_s)
        clock.now_s += delay_s  # the caller sleeps that long
    assert delays == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0]  # 9.75 s; one more 2 s wait would end past 10 s
    assert sum(delays) <= 10.0


def test_time_spent_on_the_calls_counts_against_the_budget() -> None:
    clock = FakeClock()
    delays = []
    for delay_s in backoff_delays(within_s=5.0, first_s=1.0, max_s=1.0, clock=clock):
        delays.append(delay_s)
        clock.now_s += delay_s + 1.5  # each failed call itself took 1.5 s
    assert delays == [1.0, 1.0]


def test_a_budget_shorter_than_the_first_wait_gives_no_retry() -> None:
    assert list(backoff_delays(within_s=0.0)) == []
    assert list(backoff_delays(within_s=0.2, first_s=0.25)) == []


@pytest.mark.parametrize(("first_s", "max_s"), [(0.0, 1.0), (2.0, 1.0)])
def test_nonsense_parameters_are_refused(first_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="first_s"):
        next(backoff_delays(within_s=1.0, first_s=first_s, max_s=max_s))
