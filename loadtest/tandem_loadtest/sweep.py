"""Capacity sweep: raise the offered rate step by step, find the knee, write per-worker capacity.

Called by the CLI (``tandem-loadtest sweep``) and by tests (with a fake transport); calls
:func:`tandem_loadtest.runner.run_load` once per step and :mod:`tandem_loadtest.metrics`.

As guidellm's ``sweep`` and AIPerf's profiles do, each step is an open-loop run at one offered
rate (Poisson or constant arrivals) for a fixed time; its requests in flight then finish before
the next step starts, so steps do not share a queue. Per step:

* goodput: requests meeting the SLO per second of the step's arrivals (a request is good when its
  TTFT is within the TTFT target and its TPOT, its mean inter-token gap, within the ITL target),
  and completed requests per second the same way: both comparable with the offered rate (the
  summary's duration, first send to last end, would make a few requests look like a higher rate);
* TTFT p50/p90 and ITL p50/p90 of the completed requests (ITL pooled over all gaps).

A step *meets the SLO* when its TTFT p90 and ITL p90 are within the targets (the line the
chart's autoscaler and alert rules hold: ``tandemDeployment.slo``) and at most
:data:`MAX_FAILED_FRACTION` of its requests failed (errors, 429s, timeouts: a request that never
finished is slower than any target, and p90 leaves 10 % for those). The **knee** is the highest
rate below which every step met the SLO: a later step that passes again after a breach (noise on
a shared host) does not count.

Capacity at the knee, per worker of each pool, from the knee step's completed requests::

    prefill tokens/s per worker = knee rate x mean uncached prompt tokens / prefill workers
    decode tokens/s per worker  = knee rate x mean output tokens / decode workers
    requests/s per worker       = knee rate / the pool's workers

Uncached prompt tokens are the prompt tokens less the cached ones ``usage`` reports (what a
prefill worker computes). The values entry (:func:`values_entry`) is shaped as the chart's
``tandemDeployment.autoscaling.capacity``, so the file can be given to helm with ``-f``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tandem_loadtest import __version__
from tandem_loadtest.arrivals import ConstantArrivals, PoissonArrivals
from tandem_loadtest.metrics import summarize
from tandem_loadtest.runner import ProgressFn, RunConfig, run_load

#: Share of a step's requests that may fail (errors, 429s, timeouts) and the step still meet the SLO:
#: what a p90 target leaves.
MAX_FAILED_FRACTION = 0.1
SWEEP_JSON = "sweep.json"
CAPACITY_JSON = "capacity.json"
STEPS_CSV = "steps.csv"
SWEEP_PNG = "sweep.png"


@dataclass(frozen=True)
class SloTargets:
    """The p90 targets a step must meet (seconds), as the chart's ``tandemDeployment.slo``."""

    ttft_p90_s: float
    itl_p90_s: float
    #: Where they came from (a values file, the command line), for the report.
    source: str = "command line"

    def __post_init__(self) -> None:
        if not (self.ttft_p90_s > 0 and self.itl_p90_s > 0):
            raise ValueError("SLO targets must be positive")

    @classmethod
    def parse(cls, items: Sequence[str]) -> SloTargets:
        """``ttft:MS itl:MS`` (milliseconds, as ``--goodput``); both are needed."""
        found: dict[str, float] = {}
        for item in items:
            for part in item.split():
                name, sep, value = part.partition(":")
                if name not in ("ttft", "itl") or not sep:
                    raise ValueError(f"bad SLO {part!r}: use ttft:MS itl:MS")
                found[name] = float(value) / 1000.0
        if set(found) != {"ttft", "itl"}:
            raise ValueError("give both SLO targets: ttft:MS itl:MS")
        return cls(found["ttft"], found["itl"])

    @classmethod
    def from_values(cls, path: Path) -> SloTargets:
        """``tandemDeployment.slo`` of a Helm values file (the chart's own values.yaml or an override)."""
        import yaml  # type: ignore[import-untyped]  # only this option needs PyYAML

        data = yaml.safe_load(Path(path).read_text()) or {}
        slo = (data.get("tandemDeployment") or {}).get("slo") or {}
        try:
            return cls(
                float(slo["ttftP90Seconds"]), float(slo["itlP90Seconds"]), source=f"{path}: tandemDeployment.slo"
            )
        except KeyError as exc:
            raise ValueError(f"{path} has no tandemDeployment.slo.{exc.args[0]}") from exc

    def goodput_slos_ms(self) -> dict[str, float]:
        """Per-request goodput limits for :func:`~tandem_loadtest.metrics.summarize`."""
        return {"ttft": self.ttft_p90_s * 1000.0, "tpot": self.itl_p90_s * 1000.0}


@dataclass(frozen=True)
class StepResult:
    """One step's figures (latencies in ms, None without completed requests)."""

    rate_rps: float
    #: Seconds of arrivals (the step's window): goodput and throughput are per second of it.
    window_s: float
    #: From the first send to the end of the last request (the step's requests drained).
    duration_s: float
    num_requests: int
    num_ok: int
    num_failed: int
    num_cancelled: int
    goodput_rps: float
    throughput_rps: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    mean_prompt_tokens: float | None
    mean_uncached_prompt_tokens: float | None
    mean_output_tokens: float | None

    @classmethod
    def from_summary(cls, rate_rps: float, window_s: float, s: dict[str, Any]) -> StepResult:
        ok = s["num_ok"]
        cached = (s["cached_prompt_fraction"] or 0.0) * s["total_input_tokens"]
        return cls(
            rate_rps=rate_rps,
            window_s=window_s,
            duration_s=s["duration_s"],
            num_requests=s["num_requests"],
            num_ok=ok,
            num_failed=s["num_errors"] + s["num_rate_limited"],
            num_cancelled=s["num_cancelled"],
            goodput_rps=s["goodput"]["num_good"] / window_s,
            throughput_rps=ok / window_s,
            ttft_p50_ms=s["ttft_ms"]["p50"],
            ttft_p90_ms=s["ttft_ms"]["p90"],
            itl_p50_ms=s["itl_ms"]["p50"],
            itl_p90_ms=s["itl_ms"]["p90"],
            mean_prompt_tokens=s["total_input_tokens"] / ok if ok else None,
            mean_uncached_prompt_tokens=(s["total_input_tokens"] - cached) / ok if ok else None,
            mean_output_tokens=s["total_output_tokens"] / ok if ok else None,
        )

    def failed_fraction(self) -> float:
        expected = self.num_requests - self.num_cancelled
        return self.num_failed / expected if expected else 0.0

    def meets(self, slo: SloTargets) -> bool:
        if self.num_ok == 0 or self.ttft_p90_ms is None or self.itl_p90_ms is None:
            return False
        return (
            self.ttft_p90_ms <= slo.ttft_p90_s * 1000.0
            and self.itl_p90_ms <= slo.itl_p90_s * 1000.0
            and self.failed_fraction() <= MAX_FAILED_FRACTION
        )


def find_knee(steps: Sequence[StepResult], slo: SloTargets) -> StepResult | None:
    """The highest-rate step below which every step (by rate) met the SLO; None if the lowest did not."""
    knee = None
    for step in sorted(steps, key=lambda s: s.rate_rps):
        if not step.meets(slo):
            break
        knee = step
    return knee


@dataclass(frozen=True)
class Capacity:
    """What one worker of each pool serves at the knee."""

    knee_rps: float
    num_prefill_workers: int
    num_decode_workers: int
    prefill_tokens_per_s_per_worker: float
    decode_tokens_per_s_per_worker: float
    prefill_requests_per_s_per_worker: float
    decode_requests_per_s_per_worker: float


def capacity_at(knee: StepResult, *, num_prefill_workers: int, num_decode_workers: int) -> Capacity:
    if num_prefill_workers < 1 or num_decode_workers < 1:
        raise ValueError("each pool needs at least one worker to measure")
    rate = knee.rate_rps
    return Capacity(
        knee_rps=rate,
        num_prefill_workers=num_prefill_workers,
        num_decode_workers=num_decode_workers,
        prefill_tokens_per_s_per_worker=rate * (knee.mean_uncached_prompt_tokens or 0.0) / num_prefill_workers,
        decode_tokens_per_s_per_worker=rate * (knee.mean_output_tokens or 0.0) / num_decode_workers,
        prefill_requests_per_s_per_worker=rate / num_prefill_workers,
        decode_requests_per_s_per_worker=rate / num_decode_workers,
    )


def values_entry(capacity: Capacity) -> dict[str, Any]:
    """The chart values that carry it (``helm ... -f capacity.json``): tokens/s per worker, rounded down."""
    return {
        "tandemDeployment": {
            "autoscaling": {
                "capacity": {
                    "prefillTokensPerSecondPerWorker": math.floor(capacity.prefill_tokens_per_s_per_worker),
                    "decodeTokensPerSecondPerWorker": math.floor(capacity.decode_tokens_per_s_per_worker),
                }
            }
        }
    }


StepFn = Callable[[int, float], ProgressFn | None]


async def run_sweep(
    base: RunConfig,
    rates_rps: Sequence[float],
    *,
    step_duration_s: float,
    slo: SloTargets,
    arrival: str = "poisson",
    stop_after_breaches: int = 1,
    transport: httpx.AsyncBaseTransport | None = None,
    on_step: Callable[[StepResult, bool], None] | None = None,
    progress_for: StepFn | None = None,
) -> list[StepResult]:
    """Run one step per rate, lowest first; stop after ``stop_after_breaches`` steps missed the SLO
    (0: run every rate). ``base`` gives the target, tenants and workload; its bounds are replaced."""
    if not rates_rps or any(r <= 0 for r in rates_rps):
        raise ValueError("give one or more positive rates")
    steps: list[StepResult] = []
    breaches = 0
    for i, rate in enumerate(sorted(rates_rps)):
        process = PoissonArrivals(rate) if arrival == "poisson" else ConstantArrivals(rate)
        config = dataclasses.replace(
            base, arrival=process, num_requests=None, duration_s=step_duration_s, seed=base.seed + i
        )
        progress = progress_for(i, rate) if progress_for is not None else None
        result = await run_load(config, transport=transport, progress=progress)
        summary = summarize(result.records, result.duration_s, slo.goodput_slos_ms())
        step = StepResult.from_summary(rate, step_duration_s, summary)
        steps.append(step)
        met = step.meets(slo)
        if on_step is not None:
            on_step(step, met)
        breaches += not met
        if stop_after_breaches and breaches >= stop_after_breaches:
            break
    return steps


def build_sweep_report(
    steps: Sequence[StepResult],
    slo: SloTargets,
    *,
    config: dict[str, Any],
    step_duration_s: float,
    num_prefill_workers: int,
    num_decode_workers: int,
) -> dict[str, Any]:
    knee = find_knee(steps, slo)
    capacity = (
        capacity_at(knee, num_prefill_workers=num_prefill_workers, num_decode_workers=num_decode_workers)
        if knee is not None
        else None
    )
    return {
        "tool": {"name": "tandem-loadtest sweep", "version": __version__},
        "config": config,
        "step_duration_s": step_duration_s,
        "slo": dataclasses.asdict(slo),
        "max_failed_fraction": MAX_FAILED_FRACTION,
        "steps": [{**dataclasses.asdict(s), "meets_slo": s.meets(slo)} for s in steps],
        "knee_rps": knee.rate_rps if knee is not None else None,
        "capacity": dataclasses.asdict(capacity) if capacity is not None else None,
        "values": values_entry(capacity) if capacity is not None else None,
    }


def write_sweep(report: dict[str, Any], out: Path, *, plots: bool = True) -> list[Path]:
    """``sweep.json`` (everything), ``steps.csv``, ``capacity.json`` (the values entry, when a knee was
    found) and ``sweep.png``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / SWEEP_JSON, out / STEPS_CSV]
    paths[0].write_text(json.dumps(report, indent=1))
    fields = [f.name for f in dataclasses.fields(StepResult)] + ["meets_slo"]
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(report["steps"])
    if report["values"] is not None:
        paths.append(out / CAPACITY_JSON)
        paths[-1].write_text(json.dumps(report["values"], indent=1) + "\n")
    if plots:
        from tandem_loadtest.plots import plot_sweep

        paths.append(plot_sweep(report, out / SWEEP_PNG))
    return paths


def summary_line(report: dict[str, Any]) -> str:
    """One line for the terminal and the make target."""
    steps = report["steps"]
    knee = next((s for s in steps if s["rate_rps"] == report["knee_rps"]), None)
    # The capacity as the values entry carries it (rounded down), so the line and capacity.json agree.
    cap = report["values"]["tandemDeployment"]["autoscaling"]["capacity"] if report["values"] else {}

    def fmt(value: float | None, digits: int = 0) -> str:
        return "none" if value is None else f"{value:.{digits}f}"

    return (
        f"sweep: knee_rps={fmt(report['knee_rps'], 2)} steps={len(steps)} "
        f"met={sum(s['meets_slo'] for s in steps)} "
        f"ttft_p90_ms={fmt(knee and knee['ttft_p90_ms'])} itl_p90_ms={fmt(knee and knee['itl_p90_ms'])} "
        f"slo_ttft_ms={report['slo']['ttft_p90_s'] * 1000:.0f} slo_itl_ms={report['slo']['itl_p90_s'] * 1000:.0f} "
        f"prefill_tokens_per_s_per_worker={fmt(cap.get('prefillTokensPerSecondPerWorker'))} "
        f"decode_tokens_per_s_per_worker={fmt(cap.get('decodeTokensPerSecondPerWorker'))}"
    )
