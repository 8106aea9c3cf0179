"""One set of numbers (issue 42 item 6): the chart's alert rules and the operator's autoscaler call the
same traffic "on target", and the router's prefill budget is what the autoscaler's target is made of.

For each rendering (default values and others), a synthetic latency histogram (labelled as the gateway's
prometheus_client writes it) sits exactly at the SLO (90 % of requests within the target, the p90 on the
target's bucket bound) and just over it (89 %):

* the rendered PrometheusRule under the real ``promtool test rules``: at the SLO no alert fires after
  7 h; just over, the budget alert (ticket) fires and the page does not;
* the operator's own TTFT/ITL query (:meth:`tandem_operator.signals.QueryScope.queries`, with the scope
  the rendered TandemDeployment gives it) evaluated by promtool on the same series gives the p90, and the
  real :func:`tandem_operator.autoscale.decide` / ``votes_for`` with the rendered spec holds at the SLO
  and scales up just over it.

The router's ``TANDEM_ROUTER_BUDGET__PREFILL_TOKENS_IN_FLIGHT`` (every Ray container) times
``autoscaling.prefill.budgetUsage`` is the CR's ``uncachedTokensPerReplica``, and the autoscaler's
uncached-tokens vote holds a pool at exactly that share of the router's budget and asks for one more
replica one token over it. Where ``autoscaling.capacity`` gives the prefill workers' measured tokens/s,
that budget is what one worker computes within ``router.prefillBudgetTtftShare`` of the TTFT target, read
back from the capacity and the SLO the CR hands the operator (``router.prefillTokensInFlight`` unused).

Both numbers are :mod:`tandem_operator.capacity`'s formulas, their one Python rendering: the chart gives the
same budget and target for the same inputs, among them ``make autoscale-demo``'s (its SIMULATED workers'
capacity, its SLO, share and budget usage), so the demo's router and autoscaler are sized as the chart sizes
a cluster's.
"""

from __future__ import annotations

import functools
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.utils import floatToGoString
from tandem_operator import capacity
from tandem_operator.autoscale import PoolSignals, Recommendation, decide, votes_for
from tandem_operator.signals import QueryScope
from tandem_operator.spec import TandemSpec, parse_spec

from tandem.gateway.metrics import INTER_TOKEN_BUCKETS_S, LATENCY_BUCKETS_S
from tests.chart.conftest import CHART, RELEASE, find, run_helm
from tests.chart.test_alert_rules import promtool
from tests.kit import autoscale_demo

NS = "tandem"
GATEWAY_SERVICE = f"{RELEASE}-tandem-gateway"
#: Requests per minute of the synthetic traffic: 90 of 100 within the target is exactly the p90.
TOTAL_PER_MIN = 100
AT_SLO_FAST = 90
OVER_SLO_FAST = 89

RENDERINGS = {
    "defaults": (),
    "other-numbers": (
        "tandemDeployment.slo.ttftP90Seconds=1",
        "tandemDeployment.slo.itlP90Seconds=0.05",
        "router.prefillTokensInFlight=6000",
        "tandemDeployment.autoscaling.prefill.budgetUsage=0.75",
    ),
    # A measured prefill capacity (tandem-loadtest sweep's capacity.json): the router's budget comes from it
    # and router.prefillTokensInFlight no longer counts.
    "measured-capacity": (
        "tandemDeployment.autoscaling.capacity.prefillTokensPerSecondPerWorker=2750.5",
        "tandemDeployment.slo.ttftP90Seconds=1",
        "router.prefillTokensInFlight=6000",
        "router.prefillBudgetTtftShare=0.4",
    ),
}

#: Per SLO: the gateway histogram, its buckets, the pool that holds it, the operator's signal name.
SLOS = {
    "TTFT": ("tandem_gateway_time_to_first_token_seconds", LATENCY_BUCKETS_S, "prefill", "ttft_p90_s"),
    "ITL": ("tandem_gateway_inter_token_latency_seconds", INTER_TOKEN_BUCKETS_S, "decode", "itl_p90_s"),
}


@functools.cache
def _docs(sets: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    """The chart rendered with ``sets`` as JSON values (helm's --set keeps 0.05 a string)."""
    args = [arg for item in ("monitoring.prometheusRules.enabled=true", *sets) for arg in ("--set-json", item)]
    out = run_helm("template", RELEASE, str(CHART), "--namespace", NS, *args).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def _spec(docs: tuple[dict[str, Any], ...]) -> TandemSpec:
    (td,) = find(docs, "TandemDeployment")
    return parse_spec(td["spec"])


def _target_s(spec: TandemSpec, slo: str) -> float:
    return spec.slo.ttft_p90_seconds if slo == "TTFT" else spec.slo.itl_p90_seconds


def _next_bound(buckets: tuple[float, ...], target_s: float) -> float:
    assert target_s in buckets, f"the SLO {target_s} s is not a bucket bound of the gateway's histogram"
    return buckets[buckets.index(target_s) + 1]


def _series(metric: str, target_s: float, next_s: float, fast_per_min: int) -> list[dict[str, str]]:
    """Cumulative buckets as the gateway exports them: ``fast_per_min`` within the target, the rest in the
    next bucket. Labelled with the namespace (the alerts' selector) and the gateway Service (the operator's)."""
    labels = f'namespace="{NS}",service="{GATEWAY_SERVICE}"'
    counts = {target_s: fast_per_min, next_s: TOTAL_PER_MIN, math.inf: TOTAL_PER_MIN}
    series = [
        {"series": f'{metric}_bucket{{{labels},le="{floatToGoString(le)}"}}', "values": f"0+{n}x480"}
        for le, n in counts.items()
    ]
    series.append({"series": f"{metric}_count{{{labels}}}", "values": f"0+{TOTAL_PER_MIN}x480"})
    return series


def _p90_s(target_s: float, next_s: float, fast_per_min: int) -> float:
    """Prometheus's histogram_quantile: linear within the bucket the 90th percentile falls in."""
    if fast_per_min >= 0.9 * TOTAL_PER_MIN:
        return target_s
    return target_s + (next_s - target_s) * (0.9 * TOTAL_PER_MIN - fast_per_min) / (TOTAL_PER_MIN - fast_per_min)


def _promtool_test(tmp_path: Path, rules: dict[str, Any], tests: list[dict[str, Any]]) -> None:
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rules["spec"]["groups"]}))
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}))
    proc = subprocess.run([promtool(), "test", "rules", str(spec)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _scales_up(spec: TandemSpec, role: str, signal: str, p90_s: float) -> bool:
    """The autoscaler's own answer to a p90 held for a minute: does the pool grow?"""
    pool = spec.pools.prefill if role == "prefill" else spec.pools.decode
    current = pool.replicas
    if role == "prefill":
        # TTFT grows prefill only while prefill is short (docs/kubernetes.md): here its backlog is one
        # token over target, whose own vote asks current + 1 whatever the latency; the TTFT vote is read.
        target = spec.autoscaling.prefill.uncached_tokens_per_replica
        signals = PoolSignals(queue_depth=0, uncached_tokens=current * target + 1, ttft_p90_s=p90_s)
        return votes_for("prefill", current, signals, spec.autoscaling, spec.slo)["ttft_p90"] > current
    history: tuple[Recommendation, ...] = ()
    grown = False
    for now_s in range(0, 61, 15):  # past scaleUpStabilizationSeconds (30 s)
        decision, history = decide(
            role="decode",
            current_replicas=current,
            signals=PoolSignals(itl_p90_s=p90_s),
            pool=pool,
            policy=spec.autoscaling,
            slo=spec.slo,
            history=history,
            now_s=float(now_s),
        )
        grown = grown or decision.desired_replicas > current
    return grown


def _router_budget(docs: tuple[dict[str, Any], ...]) -> int:
    (ray,) = find(docs, "RayService")
    cluster = ray["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    (budget,) = {  # every Ray container admits the same budget
        env["value"]
        for template in templates
        for container in template["spec"]["containers"]
        for env in container.get("env", [])
        if env["name"] == "TANDEM_ROUTER_BUDGET__PREFILL_TOKENS_IN_FLIGHT"
    }
    return int(budget)


@pytest.mark.parametrize("slo", sorted(SLOS))
@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_alerts_and_autoscaler_call_the_same_traffic_on_target(tmp_path: Path, rendering: str, slo: str) -> None:
    docs = _docs(RENDERINGS[rendering])
    spec = _spec(docs)
    (rules,) = find(docs, "PrometheusRule")
    metric, buckets, role, signal = SLOS[slo]
    target_s = _target_s(spec, slo)
    next_s = _next_bound(buckets, target_s)
    scope = QueryScope(
        namespace=NS,
        deployment_name=find(docs, "TandemDeployment")[0]["metadata"]["name"],
        router_service=spec.autoscaling.router_metrics_service,
        gateway_service=spec.autoscaling.gateway_metrics_service,
    )
    assert scope.gateway_service == GATEWAY_SERVICE
    operator_query = scope.queries(role)[signal]
    ticket, page = f"Tandem{slo}BudgetBurnSlow", f"Tandem{slo}BudgetBurnFast"

    tests: list[dict[str, Any]] = []
    for fast in (AT_SLO_FAST, OVER_SLO_FAST):
        tests.append(
            {
                "interval": "1m",
                "input_series": _series(metric, target_s, next_s, fast),
                "promql_expr_test": [
                    {  # the operator's p90 is the one fed to its autoscaler below (within 1e-9)
                        "expr": f"abs(({operator_query}) - {_p90_s(target_s, next_s, fast)!r}) < bool 1e-9",
                        "eval_time": "10m",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    }
                ],
                "alert_rule_test": [
                    {"eval_time": "7h", "alertname": page, "exp_alerts": []},
                    {
                        "eval_time": "7h",
                        "alertname": ticket,
                        "exp_alerts": []
                        if fast == AT_SLO_FAST
                        else [
                            {
                                "exp_labels": {"alertname": ticket, "severity": "ticket"},
                                "exp_annotations": next(
                                    r for g in rules["spec"]["groups"] for r in g["rules"] if r.get("alert") == ticket
                                )["annotations"],
                            }
                        ],
                    },
                ],
            }
        )
    _promtool_test(tmp_path, rules, tests)  # the alerts, and the p90 the operator reads

    assert not _scales_up(spec, role, signal, _p90_s(target_s, next_s, AT_SLO_FAST))
    assert _scales_up(spec, role, signal, _p90_s(target_s, next_s, OVER_SLO_FAST))


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_the_router_budget_is_what_the_autoscaler_targets(rendering: str) -> None:
    sets = RENDERINGS[rendering]
    docs = _docs(sets)
    spec = _spec(docs)
    budget = _router_budget(docs)
    values = dict(s.split("=", 1) for s in sets)
    usage = float(values.get("tandemDeployment.autoscaling.prefill.budgetUsage", 0.5))
    measured = spec.autoscaling.capacity.prefill_tokens_per_second_per_worker
    if measured:
        # What one worker computes (the operator's own capacity figure) within the share of its TTFT target.
        share = float(values["router.prefillBudgetTtftShare"])
        assert measured == float(values["tandemDeployment.autoscaling.capacity.prefillTokensPerSecondPerWorker"])
        assert budget == capacity.prefill_budget_tokens(measured, spec.slo.ttft_p90_seconds, share) == 1100
        assert budget != int(values["router.prefillTokensInFlight"])
    else:
        assert capacity.prefill_budget_tokens(measured, spec.slo.ttft_p90_seconds, 0.5) is None
        assert budget == int(values.get("router.prefillTokensInFlight", 16384))
    target = spec.autoscaling.prefill.uncached_tokens_per_replica
    assert target == capacity.uncached_tokens_per_replica(budget, usage)

    # The autoscaler's own vote: a pool at exactly that share of the router's budget holds, one token more
    # asks for another replica.
    current = 3
    at = PoolSignals(queue_depth=0, uncached_tokens=current * budget * usage)
    over = PoolSignals(queue_depth=0, uncached_tokens=current * budget * usage + 1)
    assert votes_for("prefill", current, at, spec.autoscaling, spec.slo)["uncached_tokens"] == current
    assert votes_for("prefill", current, over, spec.autoscaling, spec.slo)["uncached_tokens"] == current + 1


def _autoscale_demo() -> Any:
    return autoscale_demo.load()


def test_the_python_share_default_is_the_charts() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["router"]["prefillBudgetTtftShare"] == capacity.DEFAULT_PREFILL_BUDGET_TTFT_SHARE


@pytest.mark.parametrize("scenario", ["ramp", "short-chats", "long-prompts"])
def test_the_demo_sizes_its_router_and_autoscaler_as_the_chart_does(scenario: str) -> None:
    """The chart, given the demo's SIMULATED per-worker capacity, SLO, share and budget usage, renders the
    router budget and the autoscaler target the demo runs with."""
    demo = _autoscale_demo()
    sc = demo.SCENARIOS[scenario]
    tokens_per_s = demo.simulated_prefill_tokens_per_s(sc)
    docs = _docs(
        (
            f"tandemDeployment.autoscaling.capacity.prefillTokensPerSecondPerWorker={tokens_per_s!r}",
            f"tandemDeployment.slo.ttftP90Seconds={demo.TTFT_P90_S!r}",
            f"router.prefillBudgetTtftShare={demo.PREFILL_BUDGET_TTFT_SHARE!r}",
            f"tandemDeployment.autoscaling.prefill.budgetUsage={demo.PREFILL_BUDGET_USAGE!r}",
        )
    )
    demo_spec = demo.demo_spec("SmolLM2-135M-Instruct", sc)
    assert _router_budget(docs) == demo.prefill_budget_tokens(sc)
    assert (
        _spec(docs).autoscaling.prefill.uncached_tokens_per_replica
        == demo_spec.autoscaling.prefill.uncached_tokens_per_replica
    )
    assert _spec(docs).slo.ttft_p90_seconds == demo_spec.slo.ttft_p90_seconds
    # The capacity the chart hands the operator is the demo's too: its token_rate vote runs on the same figure.
    assert (
        _spec(docs).autoscaling.capacity.prefill_tokens_per_second_per_worker
        == demo_spec.autoscaling.capacity.prefill_tokens_per_second_per_worker
        == tokens_per_s
    )
