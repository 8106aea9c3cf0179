"""The capacity file ``tandem-loadtest sweep`` writes is a values entry the chart takes as it is
(``helm -f capacity.json``): it passes values.schema.json, lands in the TandemDeployment's
``autoscaling.capacity`` inside the CRD's schema, and the operator's spec reads the same numbers."""

from __future__ import annotations

from pathlib import Path

import yaml
from tandem_loadtest.sweep import SloTargets, StepResult, build_sweep_report, write_sweep
from tandem_operator.spec import parse_spec

from tests.chart.conftest import CHART, RELEASE, find, run_helm
from tests.chart.crd_schema import validate_custom_resource


def _step(rate_rps: float, ttft_p90_ms: float) -> StepResult:
    return StepResult(
        rate_rps=rate_rps,
        window_s=20.0,
        duration_s=21.0,
        num_requests=20,
        num_ok=20,
        num_failed=0,
        num_cancelled=0,
        goodput_rps=rate_rps,
        throughput_rps=rate_rps,
        ttft_p50_ms=ttft_p90_ms / 2,
        ttft_p90_ms=ttft_p90_ms,
        itl_p50_ms=20.0,
        itl_p90_ms=40.0,
        mean_prompt_tokens=400.0,
        mean_uncached_prompt_tokens=333.3,
        mean_output_tokens=48.0,
    )


def test_the_sweep_capacity_file_renders_into_the_tandemdeployment(tmp_path: Path) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    slo = SloTargets.from_values(CHART / "values.yaml")
    steps = [_step(1.0, 500.0), _step(2.0, 1500.0), _step(4.0, 9000.0)]
    report = build_sweep_report(
        steps, slo, config={}, step_duration_s=20.0, num_prefill_workers=2, num_decode_workers=1
    )
    write_sweep(report, tmp_path, plots=False)
    out = run_helm(
        "template", RELEASE, str(CHART), "--namespace", "tandem", "-f", str(tmp_path / "capacity.json")
    ).stdout
    (td,) = find(tuple(d for d in yaml.safe_load_all(out) if d), "TandemDeployment")
    rendered = td["spec"]["autoscaling"]["capacity"]
    # Knee 2 req/s (4 misses the chart's TTFT target): 2 x 333.3 / 2 prefill workers, 2 x 48 / 1 decode worker.
    assert report["knee_rps"] == 2.0
    assert rendered == {"prefillTokensPerSecondPerWorker": 333, "decodeTokensPerSecondPerWorker": 96}
    validate_custom_resource(td)
    spec = parse_spec(td["spec"]).autoscaling.capacity
    assert (spec.prefill_tokens_per_second_per_worker, spec.decode_tokens_per_second_per_worker) == (333, 96)
    # Without the file: the chart's default, not measured.
    assert values["tandemDeployment"]["autoscaling"]["capacity"] == {
        "prefillTokensPerSecondPerWorker": 0,
        "decodeTokensPerSecondPerWorker": 0,
    }


def test_the_schema_refuses_a_misspelt_or_negative_capacity() -> None:
    for bad in (
        "tandemDeployment.autoscaling.capacity.prefillTokensPerSecond=5",
        "tandemDeployment.autoscaling.capacity.decodeTokensPerSecondPerWorker=-1",
    ):
        proc = run_helm("template", RELEASE, str(CHART), "--set-json", bad, check=False)
        assert proc.returncode != 0 and "capacity" in proc.stderr, (bad, proc.stderr[-500:])
