"""Arrival processes: rates, spacing and parsing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tandem_loadtest.arrivals import (
    BurstArrivals,
    ConstantArrivals,
    FixedConcurrency,
    PoissonArrivals,
    RampArrivals,
    parse_arrival,
)


def _take(process: object, n: int, seed: int = 0) -> np.ndarray:
    return np.array(list(itertools.islice(process.send_times_s(np.random.default_rng(seed)), n)))  # type: ignore[attr-defined]


def test_poisson_has_the_asked_rate_and_exponential_gaps() -> None:
    times = _take(PoissonArrivals(4.0), 20_000)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    # Exponential: std equals mean (a constant process would have std 0).
    assert gaps.std() == pytest.approx(0.25, rel=0.05)


def test_poisson_is_reproducible_per_seed() -> None:
    assert np.array_equal(_take(PoissonArrivals(2.0), 50, seed=7), _take(PoissonArrivals(2.0), 50, seed=7))
    assert not np.array_equal(_take(PoissonArrivals(2.0), 50, seed=7), _take(PoissonArrivals(2.0), 50, seed=8))


def test_constant_rate_is_evenly_spaced() -> None:
    times = _take(ConstantArrivals(5.0), 11)
    assert times[0] == 0.0
    assert np.allclose(np.diff(times), 0.2)


def test_bursts_send_groups_at_once() -> None:
    times = _take(BurstArrivals(3, 2.0), 9)
    assert list(times) == [0, 0, 0, 2, 2, 2, 4, 4, 4]


def test_linear_ramp_sends_the_integral_of_the_rate() -> None:
    ramp = RampArrivals(1.0, 5.0, 10.0)
    times = _take(ramp, 200)
    assert np.all(np.diff(times) >= 0)
    # Requests sent by time T = integral of the rate = (1 + 5) / 2 * 10 = 30.
    assert int(np.sum(times <= 10.0)) == pytest.approx(31, abs=1)
    gaps = np.diff(times)
    early, late = gaps[:3].mean(), gaps[25:29].mean()
    assert early > 2 * late  # the rate rises
    after = np.diff(times[times > 11.0])
    assert np.allclose(after, 0.2)  # then holds at the end rate


def test_flat_ramp_is_constant() -> None:
    assert np.allclose(np.diff(_take(RampArrivals(2.0, 2.0, 5.0), 30)), 0.5)


def test_parse_arrival_specs() -> None:
    assert parse_arrival("poisson:2.5") == PoissonArrivals(2.5)
    assert parse_arrival("constant:3") == ConstantArrivals(3.0)
    assert parse_arrival("burst:8:5") == BurstArrivals(8, 5.0)
    assert parse_arrival("ramp:0.5:4:60") == RampArrivals(0.5, 4.0, 60.0)
    process = parse_arrival("concurrency:4")
    assert isinstance(process, FixedConcurrency) and process.closed_loop and process.concurrency == 4
    for bad in ("poisson", "poisson:x", "burst:2.5:1", "ramp:1:2", "concurrency:0", "zipf:1", "constant:-1"):
        with pytest.raises(ValueError):
            parse_arrival(bad)


def test_closed_loop_has_no_schedule() -> None:
    with pytest.raises(TypeError):
        next(FixedConcurrency(2).send_times_s(np.random.default_rng()))
