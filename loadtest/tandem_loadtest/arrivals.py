"""Arrival processes: when the next request is sent.

Called by :mod:`tandem_loadtest.runner` (and parsed by the CLI); calls numpy.

Open-loop processes yield send times in seconds from the start of the run,
independent of how fast the server answers:

* ``poisson:RATE``    exponential gaps, mean rate RATE requests/s;
* ``constant:RATE``   one request every 1/RATE s;
* ``burst:SIZE:EVERY_S``  SIZE requests at once, every EVERY_S seconds;
* ``ramp:START:END:OVER_S``  rate rising linearly from START to END req/s
  over OVER_S seconds, then staying at END (deterministic spacing: the k-th
  request goes when the integral of the rate reaches k).

``concurrency:N`` is closed-loop: N users, each sending its next request as
soon as the previous one ends. It has no schedule; the runner handles it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


class ArrivalProcess(ABC):
    """A source of send times. ``closed_loop`` processes have none."""

    closed_loop: bool = False

    @abstractmethod
    def send_times_s(self, rng: np.random.Generator) -> Iterator[float]:
        """Send times (s from run start), non-decreasing, endless. Called once per run."""

    @abstractmethod
    def describe(self) -> str: ...


@dataclass(frozen=True)
class PoissonArrivals(ArrivalProcess):
    rate_rps: float

    def send_times_s(self, rng: np.random.Generator) -> Iterator[float]:
        t = 0.0
        while True:
            t += float(rng.exponential(1.0 / self.rate_rps))
            yield t

    def describe(self) -> str:
        return f"poisson:{self.rate_rps:g}"


@dataclass(frozen=True)
class ConstantArrivals(ArrivalProcess):
    rate_rps: float

    def send_times_s(self, rng: np.random.Generator) -> Iterator[float]:
        k = 0
        while True:
            yield k / self.rate_rps
            k += 1

    def describe(self) -> str:
        return f"constant:{self.rate_rps:g}"


@dataclass(frozen=True)
class BurstArrivals(ArrivalProcess):
    burst_size: int
    every_s: float

    def send_times_s(self, rng: np.random.Generator) -> Iterator[float]:
        k = 0
        while True:
            for _ in range(self.burst_size):
                yield k * self.every_s
            k += 1

    def describe(self) -> str:
        return f"burst:{self.burst_size}:{self.every_s:g}"


@dataclass(frozen=True)
class RampArrivals(ArrivalProcess):
    start_rps: float
    end_rps: float
    over_s: float

    def send_times_s(self, rng: np.random.Generator) -> Iterator[float]:
        r0, r1, ramp_s = self.start_rps, self.end_rps, self.over_s
        slope = (r1 - r0) / ramp_s
        ramp_total = (r0 + r1) / 2 * ramp_s  # requests sent during the ramp
        k = 0
        while True:
            if k > ramp_total:
                yield ramp_s + (k - ramp_total) / r1
            elif abs(slope) < 1e-12:
                yield k / r0
            else:
                # Solve r0 t + slope t^2 / 2 = k for t >= 0.
                yield (-r0 + math.sqrt(r0 * r0 + 2 * slope * k)) / slope
            k += 1

    def describe(self) -> str:
        return f"ramp:{self.start_rps:g}:{self.end_rps:g}:{self.over_s:g}"


@dataclass(frozen=True)
class FixedConcurrency(ArrivalProcess):
    concurrency: int
    closed_loop = True

    def send_times_s(self, rng: np.random.Generator) -> Iterator[float]:
        raise TypeError("fixed concurrency is closed-loop; it has no send schedule")

    def describe(self) -> str:
        return f"concurrency:{self.concurrency}"


def parse_arrival(spec: str) -> ArrivalProcess:
    """Parse ``poisson:2``, ``constant:2``, ``burst:8:5``, ``ramp:0.5:4:60`` or ``concurrency:4``."""
    kind, *args = spec.strip().split(":")
    try:
        values = [float(a) for a in args]
        process: ArrivalProcess
        if kind == "poisson" and len(values) == 1:
            process = PoissonArrivals(values[0])
        elif kind == "constant" and len(values) == 1:
            process = ConstantArrivals(values[0])
        elif kind == "burst" and len(values) == 2 and values[0] == int(values[0]):
            process = BurstArrivals(int(values[0]), values[1])
        elif kind == "ramp" and len(values) == 3:
            process = RampArrivals(values[0], values[1], values[2])
        elif kind == "concurrency" and len(values) == 1 and values[0] == int(values[0]):
            process = FixedConcurrency(int(values[0]))
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"bad arrival spec {spec!r}: use poisson:RATE, constant:RATE, burst:SIZE:EVERY_S, "
            "ramp:START_RPS:END_RPS:OVER_S or concurrency:N"
        ) from None
    if any(v <= 0 for v in values):
        raise ValueError(f"bad arrival spec {spec!r}: rates, sizes and durations must be > 0")
    return process
