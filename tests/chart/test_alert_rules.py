"""The chart's SLO rules under promtool (Debian's prometheus package, `make prometheus`):
`promtool check rules` on the rendered PrometheusRule, and `promtool test rules` feeding the
gateway's histogram series, with the bucket label exactly as prometheus_client writes it, so
that a burn fires and a healthy service stays quiet. (tests/integration/test_prometheus_queries.py
runs the same rules in a real Prometheus against the real stack.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.utils import floatToGoString

from tests.chart.conftest import CHART, run_helm

NS = "tandem"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run `make prometheus`", pytrace=False)
    return path


def _rules(tmp_path: Path, *values: str) -> tuple[Path, dict[str, Any]]:
    out = run_helm(
        "template",
        "rel",
        str(CHART),
        "--namespace",
        NS,
        "--set",
        "monitoring.prometheusRules.enabled=true",
        *[arg for v in values for arg in ("--set", v)],
    ).stdout
    (rule,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule"]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    return path, alerts


def _series(metric: str, slo_s: float, fast_per_min: int, total_per_min: int) -> list[dict[str, str]]:
    bucket = f'{metric}_bucket{{namespace="{NS}",le="{floatToGoString(slo_s)}"}}'
    return [
        {"series": bucket, "values": f"0+{fast_per_min}x480"},
        {"series": f'{metric}_count{{namespace="{NS}"}}', "values": f"0+{total_per_min}x480"},
    ]


def _expected(alert: dict[str, Any]) -> dict[str, Any]:
    return {"exp_labels": alert["labels"], "exp_annotations": alert["annotations"]}


def _run(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}))
    proc = subprocess.run([promtool(), "test", "rules", str(spec)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rendered_rules_pass_promtool_check(tmp_path: Path) -> None:
    path, alerts = _rules(tmp_path)
    proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"TandemTTFTBudgetBurnFast", "TandemITLBudgetBurnSlow"} <= set(alerts)


@pytest.mark.parametrize(
    ("slo", "metric", "slo_s", "values"),
    [
        ("TTFT", "tandem_gateway_time_to_first_token_seconds", 2.0, ()),
        ("ITL", "tandem_gateway_inter_token_latency_seconds", 0.1, ()),
        # An SLO written as a whole number still names the bucket the gateway exports ("3.0").
        ("TTFT", "tandem_gateway_time_to_first_token_seconds", 3.0, ("tandemDeployment.slo.ttftP90Seconds=3",)),
    ],
)
def test_a_burning_budget_pages_and_a_healthy_service_stays_quiet(
    tmp_path: Path, slo: str, metric: str, slo_s: float, values: tuple[str, ...]
) -> None:
    _, alerts = _rules(tmp_path, *values)
    fast, slow = alerts[f"Tandem{slo}BudgetBurnFast"], alerts[f"Tandem{slo}BudgetBurnSlow"]
    _run(
        tmp_path,
        [
            {  # 60 % of the requests slower than the SLO: 6x the 10 % budget a p90 target leaves
                "interval": "1m",
                "input_series": _series(metric, slo_s, fast_per_min=40, total_per_min=100),
                "alert_rule_test": [
                    {"eval_time": "70m", "alertname": fast["alert"], "exp_alerts": [_expected(fast)]},
                    {"eval_time": "7h", "alertname": slow["alert"], "exp_alerts": [_expected(slow)]},
                ],
            },
            {  # every request within the SLO
                "interval": "1m",
                "input_series": _series(metric, slo_s, fast_per_min=100, total_per_min=100),
                "alert_rule_test": [
                    {"eval_time": "70m", "alertname": fast["alert"], "exp_alerts": []},
                    {"eval_time": "7h", "alertname": slow["alert"], "exp_alerts": []},
                ],
            },
        ],
    )
