"""The KEDA example (charts/tandem/examples/keda-scaledobjects.yaml) asks Prometheus exactly what
the operator asks, with the TandemDeployment's default targets, and targets the Deployments the
operator creates for the chart's default release; with autoscaling.external the operator leaves
their replicas to KEDA."""

from __future__ import annotations

import yaml
from tandem_operator.reconcile import replicas_to_apply
from tandem_operator.resources import pool_name
from tandem_operator.signals import QueryScope
from tandem_operator.spec import PoolSpec, TandemSpec

from tests.chart.conftest import CHART, find, render

EXAMPLE = CHART / "examples" / "keda-scaledobjects.yaml"
#: Per signal: the TandemDeployment default it mirrors.
DEFAULTS = TandemSpec.model_fields["autoscaling"].default
SLO = TandemSpec.model_fields["slo"].default
THRESHOLDS = {
    "queue_depth": DEFAULTS.prefill.queue_depth_per_replica,
    "uncached_tokens": DEFAULTS.prefill.uncached_tokens_per_replica,
    "ttft_p90_s": SLO.ttft_p90_seconds,
    "budget_usage": DEFAULTS.decode.budget_usage,
    "kv_usage": DEFAULTS.decode.kv_usage,
    "waiting": DEFAULTS.decode.waiting_per_replica,
    "itl_p90_s": SLO.itl_p90_seconds,
}


def test_the_keda_example_asks_what_the_operator_asks() -> None:
    objects = [o for o in yaml.safe_load_all(EXAMPLE.read_text()) if o]
    assert [o["metadata"]["name"] for o in objects] == ["tandem-prefill", "tandem-decode"]
    (td,) = find(render(None, ("fullnameOverride=tandem",)), "TandemDeployment")
    for obj, role in zip(objects, ("prefill", "decode"), strict=True):
        assert obj["spec"]["scaleTargetRef"]["name"] == pool_name(td["metadata"]["name"], role)
        autoscaling = td["spec"]["autoscaling"]
        scope = QueryScope(
            obj["metadata"]["namespace"],
            td["metadata"]["name"],
            router_service=autoscaling["routerMetricsService"],
            gateway_service=autoscaling["gatewayMetricsService"],
        )
        assert scope.router_service == "tandem-router-metrics" and scope.gateway_service == "tandem-gateway"
        queries = scope.queries(role)
        # Requests in flight feed only the operator's demand vote, which a KEDA trigger cannot express.
        del queries["in_flight"]
        # Pending demand starts a pool at zero (a vote for one replica, not a total per replica); the example
        # keeps minReplicaCount 1, so the pools never sit at zero under KEDA.
        del queries["pending_demand"]
        # Tokens/s held against the measured per-worker capacity is voted on only where
        # autoscaling.capacity gives that figure (tandem-loadtest sweep); the chart's defaults, which the
        # example goes with, leave it 0 (not measured), so the operator casts no such vote there either.
        assert not autoscaling.get("capacity", {}).get(f"{role}TokensPerSecondPerWorker"), autoscaling
        queries.pop("token_rate", None)
        triggers = {t["name"]: t for t in obj["spec"]["triggers"]}
        assert set(triggers) == set(queries), role
        for name, trigger in triggers.items():
            assert trigger["metadata"]["query"] == queries[name], name
            assert float(trigger["metadata"]["threshold"]) == THRESHOLDS[name], name
            # Ratio-style votes (usage, latency) are "Value"; totals per replica are "AverageValue".
            expected = "Value" if name in ("budget_usage", "kv_usage", "ttft_p90_s", "itl_p90_s") else "AverageValue"
            assert trigger.get("metricType", "AverageValue") == expected, name


def test_with_an_external_autoscaler_the_operator_keeps_whatever_replicas_it_set() -> None:
    pool = PoolSpec(replicas=1, min_replicas=1, max_replicas=4)
    assert replicas_to_apply(pool, autoscaling_enabled=True, current=7, external=True) == 7
    assert replicas_to_apply(pool, autoscaling_enabled=False, current=7, external=True) == 7
    assert replicas_to_apply(pool, autoscaling_enabled=False, current=7) == 1  # the spec's count
    assert replicas_to_apply(pool, autoscaling_enabled=True, current=None, external=True) == 1  # creation
    (td,) = find(render(None, ("tandemDeployment.autoscaling.external=true",)), "TandemDeployment")
    assert td["spec"]["autoscaling"]["external"] is True
