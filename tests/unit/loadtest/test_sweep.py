"""The capacity sweep: the knee (the highest rate below which every step met the SLO), the per-worker
capacity at it, the values entry and report files, and a sweep against a simulated server that slows
as requests pile up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tandem_loadtest.arrivals import FixedConcurrency
from tandem_loadtest.cli import main as cli_main
from tandem_loadtest.distributions import LengthDist
from tandem_loadtest.runner import RunConfig
from tandem_loadtest.sweep import (
    MAX_FAILED_FRACTION,
    SloTargets,
    StepResult,
    build_sweep_report,
    capacity_at,
    find_knee,
    run_sweep,
    summary_line,
    values_entry,
    write_sweep,
)
from tandem_loadtest.tenants import TenantConfig
from tandem_loadtest.workloads import WorkloadOptions

from tests.kit.openai_server import FakeOpenAIServer

CHART_VALUES = Path(__file__).resolve().parents[3] / "charts" / "tandem" / "values.yaml"
SLO = SloTargets(ttft_p90_s=2.0, itl_p90_s=0.1)


def step(
    rate_rps: float,
    *,
    ttft_p90_ms: float = 500.0,
    itl_p90_ms: float = 50.0,
    num_requests: int = 20,
    num_failed: int = 0,
    num_cancelled: int = 0,
    prompt: float = 300.0,
    uncached: float = 200.0,
    output: float = 32.0,
) -> StepResult:
    ok = num_requests - num_failed - num_cancelled
    return StepResult(
        rate_rps=rate_rps,
        window_s=20.0,
        duration_s=21.0,
        num_requests=num_requests,
        num_ok=ok,
        num_failed=num_failed,
        num_cancelled=num_cancelled,
        goodput_rps=rate_rps,
        throughput_rps=rate_rps,
        ttft_p50_ms=ttft_p90_ms / 2,
        ttft_p90_ms=ttft_p90_ms,
        itl_p50_ms=itl_p90_ms / 2,
        itl_p90_ms=itl_p90_ms,
        mean_prompt_tokens=prompt if ok else None,
        mean_uncached_prompt_tokens=uncached if ok else None,
        mean_output_tokens=output if ok else None,
    )


def test_the_knee_is_the_last_step_of_the_passing_run_from_the_lowest_rate() -> None:
    steps = [step(4.0, ttft_p90_ms=2500.0), step(1.0), step(2.0, ttft_p90_ms=1999.0), step(8.0)]
    knee = find_knee(steps, SLO)
    # Sorted by rate: 1 and 2 meet, 4 misses TTFT; 8 passing again (noise) does not move the knee past 4.
    assert knee is not None and knee.rate_rps == 2.0


@pytest.mark.parametrize(
    "missed",
    [
        {"ttft_p90_ms": 2000.1},
        {"itl_p90_ms": 100.1},
        # More failures than a p90 leaves: 3 of 20 (cancellations not counted) is 15 %.
        {"num_failed": 3},
        {"num_failed": 17, "num_cancelled": 3},
    ],
)
def test_a_step_misses_on_either_p90_or_on_failures(missed: dict[str, float]) -> None:
    bad = step(1.0, **missed)  # type: ignore[arg-type]
    assert not bad.meets(SLO)
    assert find_knee([step(0.5), bad, step(2.0)], SLO) == step(0.5)
    assert find_knee([bad], SLO) is None


def test_failures_up_to_what_the_p90_leaves_still_meet() -> None:
    s = step(1.0, num_requests=22, num_failed=2, num_cancelled=2)  # 2 of 20 sent and not cancelled: 10 %
    assert s.failed_fraction() == pytest.approx(MAX_FAILED_FRACTION) and s.meets(SLO)
    # The targets themselves are inclusive, as the autoscaler's "at most 10 % slower".
    assert step(1.0, ttft_p90_ms=2000.0, itl_p90_ms=100.0).meets(SLO)


def test_a_step_with_no_completed_request_misses() -> None:
    assert not step(1.0, num_failed=0, num_cancelled=20).meets(SLO)


def test_capacity_divides_the_knee_by_each_pool() -> None:
    knee = step(3.0, prompt=300.0, uncached=120.0, output=40.0)
    cap = capacity_at(knee, num_prefill_workers=2, num_decode_workers=3)
    assert cap.knee_rps == 3.0
    # Prefill computes the uncached prompt tokens: 3 req/s x 120 tokens over 2 workers.
    assert cap.prefill_tokens_per_s_per_worker == pytest.approx(3.0 * 120.0 / 2)
    assert cap.decode_tokens_per_s_per_worker == pytest.approx(3.0 * 40.0 / 3)
    assert cap.prefill_requests_per_s_per_worker == pytest.approx(1.5)
    assert cap.decode_requests_per_s_per_worker == pytest.approx(1.0)
    entry = values_entry(cap)["tandemDeployment"]["autoscaling"]["capacity"]
    assert entry == {"prefillTokensPerSecondPerWorker": 180, "decodeTokensPerSecondPerWorker": 40}
    with pytest.raises(ValueError):
        capacity_at(knee, num_prefill_workers=0, num_decode_workers=1)


def test_uncached_tokens_come_from_the_summary_cached_fraction() -> None:
    summary = {
        "num_ok": 4,
        "num_requests": 5,
        "num_errors": 1,
        "num_rate_limited": 0,
        "num_cancelled": 0,
        "duration_s": 10.0,
        "total_input_tokens": 1000,
        "total_output_tokens": 80,
        "cached_prompt_fraction": 0.25,
        "request_throughput_rps": 0.4,
        "goodput": {"num_good": 3, "request_goodput_rps": 0.3},
        "ttft_ms": {"p50": 100.0, "p90": 200.0},
        "itl_ms": {"p50": 10.0, "p90": 20.0},
    }
    s = StepResult.from_summary(0.5, 8.0, summary)
    # Per second of the step's arrivals (8 s), not of the summary's 10 s of first send to last end.
    assert (s.goodput_rps, s.throughput_rps, s.duration_s) == (3 / 8.0, 4 / 8.0, 10.0)
    assert s.mean_prompt_tokens == 250.0 and s.mean_uncached_prompt_tokens == 187.5 and s.mean_output_tokens == 20.0
    assert s.num_failed == 1 and s.failed_fraction() == pytest.approx(0.2)


def test_slo_from_the_chart_values_and_the_command_line() -> None:
    chart = yaml.safe_load(CHART_VALUES.read_text())["tandemDeployment"]["slo"]
    slo = SloTargets.from_values(CHART_VALUES)
    assert (slo.ttft_p90_s, slo.itl_p90_s) == (chart["ttftP90Seconds"], chart["itlP90Seconds"])
    assert "tandemDeployment.slo" in slo.source
    assert SloTargets.parse(["ttft:3000", "itl:250"]) == SloTargets(3.0, 0.25)
    assert SloTargets(1.5, 0.05).goodput_slos_ms() == {"ttft": 1500.0, "tpot": 50.0}
    for bad in (["ttft:3000"], ["tpot:50", "ttft:1"], ["ttft"]):
        with pytest.raises(ValueError):
            SloTargets.parse(bad)


def test_report_files_and_summary_line(tmp_path: Path) -> None:
    steps = [step(0.5), step(1.0, ttft_p90_ms=1500.0, uncached=200.9), step(2.0, ttft_p90_ms=9000.0)]
    report = build_sweep_report(
        steps, SLO, config={"model": "m"}, step_duration_s=20.0, num_prefill_workers=1, num_decode_workers=1
    )
    assert report["knee_rps"] == 1.0 and [s["meets_slo"] for s in report["steps"]] == [True, True, False]
    paths = write_sweep(report, tmp_path)
    assert {p.name for p in paths} == {"sweep.json", "steps.csv", "capacity.json", "sweep.png"}
    assert all(p.stat().st_size > 0 for p in paths)
    assert json.loads((tmp_path / "capacity.json").read_text()) == report["values"]
    assert len((tmp_path / "steps.csv").read_text().splitlines()) == 1 + len(steps)
    line = summary_line(report)
    assert line.startswith("sweep: knee_rps=1.00 steps=3 met=2 ttft_p90_ms=1500 ")
    assert "prefill_tokens_per_s_per_worker=200 decode_tokens_per_s_per_worker=32" in line

    none = build_sweep_report(
        [step(0.5, itl_p90_ms=500.0)], SLO, config={}, step_duration_s=20.0, num_prefill_workers=1, num_decode_workers=1
    )
    assert none["knee_rps"] is None and none["capacity"] is None
    assert {p.name for p in write_sweep(none, tmp_path / "none", plots=False)} == {"sweep.json", "steps.csv"}
    assert "knee_rps=none" in summary_line(none)


def base_config() -> RunConfig:
    """Target, tenant and workload; the sweep replaces the arrivals and bounds of each step."""
    return RunConfig(
        base_url="http://fake/v1",
        model="m",
        arrival=FixedConcurrency(1),
        num_requests=1,
        tenants=[TenantConfig("a", "sk-a", {"synthetic": 1.0})],
        workload=WorkloadOptions(input_tokens=LengthDist.parse("16"), output_tokens=LengthDist.parse("5")),
    )


async def test_sweep_against_a_server_that_slows_with_load_stops_past_the_knee() -> None:
    # Simulated: each request in flight adds 20 ms to the next TTFT. At 2 and 10 req/s a few requests
    # overlap (TTFT ~20-40 ms); at 40 req/s the in-flight count runs away (TTFT p90 far over 100 ms).
    server = FakeOpenAIServer(ttft_s=0.02, gap_s=0.005, ttft_per_in_flight_s=0.02)
    slo = SloTargets(ttft_p90_s=0.1, itl_p90_s=0.2)
    seen: list[tuple[float, bool]] = []
    steps = await run_sweep(
        base_config(),
        [40.0, 2.0, 10.0, 80.0],
        step_duration_s=1.0,
        slo=slo,
        arrival="constant",
        transport=server.transport(),
        on_step=lambda s, met: seen.append((s.rate_rps, met)),
    )
    # Lowest first; the sweep stops at the first miss, so 80 req/s is never offered.
    assert seen == [(2.0, True), (10.0, True), (40.0, False)]
    assert [s.rate_rps for s in steps] == [2.0, 10.0, 40.0]
    assert all(s.num_requests == pytest.approx(s.rate_rps * 1.0, abs=2) for s in steps)
    knee = find_knee(steps, slo)
    assert knee is not None and knee.rate_rps == 10.0
    assert knee.mean_output_tokens == 5.0 and knee.mean_uncached_prompt_tokens == 7.0  # the fake's usage
    cap = capacity_at(knee, num_prefill_workers=1, num_decode_workers=2)
    assert cap.prefill_tokens_per_s_per_worker == pytest.approx(70.0)
    assert cap.decode_tokens_per_s_per_worker == pytest.approx(25.0)


def test_cli_needs_the_slo_once(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["sweep", "--url", "http://127.0.0.1:9", "--model", "m", "--rates", "1"]
    assert cli_main(common) == 2
    assert cli_main([*common, "--slo", "ttft:1", "itl:1", "--slo-values", str(CHART_VALUES)]) == 2
    assert "give the SLO once" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main([*common[:-1], "0,1", "--slo", "ttft:1", "itl:1"])
