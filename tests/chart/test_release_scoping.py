"""Two releases in one namespace never read each other's autoscaling signals (issue 43 item 5, issue 42
item 3): both rendered by helm into one namespace, each TandemDeployment names its own router metrics
and gateway Services, the ServiceMonitors scrape only those (Prometheus labels the series ``service``),
and the operator's PromQL for each release, evaluated by promtool over both releases' series at once,
gives that release's figures only. The router's series come from the real router's export (recorded,
tests/kit/router_export.py), the gateway's from the gateway's own metrics registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tandem_operator.signals import QueryScope

from tandem.gateway.metrics import GatewayMetrics
from tests.chart.conftest import CHART, find, one, run_helm
from tests.kit.promql import check_promql, histogram_quantile, series_from_exposition
from tests.kit.router_export import recorded_router_export, with_queued_requests

NS = "shared"
RELEASES = ("alpha", "beta")
#: Per release: requests waiting for prefill (router), TTFT of its requests (gateway), decode KV usage (workers).
QUEUED = {"alpha": 3, "beta": 5}
TTFT_S = {"alpha": 0.3, "beta": 6.0}
KV_USAGE = {"alpha": 0.2, "beta": 0.9}


def _render(release: str) -> tuple[dict[str, Any], ...]:
    out = run_helm(
        "template", release, str(CHART), "--namespace", NS, "--set", "monitoring.serviceMonitors.enabled=true"
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def _selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def _scope(docs: tuple[dict[str, Any], ...]) -> QueryScope:
    (td,) = find(docs, "TandemDeployment")
    autoscaling = td["spec"]["autoscaling"]
    return QueryScope(
        NS,
        td["metadata"]["name"],
        router_service=autoscaling["routerMetricsService"],
        gateway_service=autoscaling["gatewayMetricsService"],
    )


def _gateway_text(ttft_s: float) -> str:
    metrics = GatewayMetrics()
    metrics.serve_models(["smol"])
    for _ in range(10):
        metrics.observe_first_token(ttft_s, model="smol")
    return generate_latest(metrics.registry).decode()


def _ttft_buckets(text: str) -> dict[float, float]:
    return {
        float(s.labels["le"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "tandem_gateway_time_to_first_token_seconds_bucket"
    }


def test_each_release_scrapes_and_queries_only_its_own_services() -> None:
    docs = {release: _render(release) for release in RELEASES}
    scopes = {release: _scope(d) for release, d in docs.items()}
    assert (
        len({s.router_service for s in scopes.values()}) == 2 and len({s.gateway_service for s in scopes.values()}) == 2
    )
    for release, own in docs.items():
        (other,) = (d for r, d in docs.items() if r != release)
        scope = scopes[release]
        for component, service in (("router", scope.router_service), ("gateway", scope.gateway_service)):
            svc = one(own, "Service", service)
            assert svc["spec"]["selector"]["app.kubernetes.io/instance"] == release, svc["spec"]["selector"]
            assert svc["spec"]["selector"]["app.kubernetes.io/component"] == component
            monitor = one(own, "ServiceMonitor", svc["metadata"]["name"].removesuffix("-metrics"))
            match = monitor["spec"]["selector"]["matchLabels"]
            # The release's monitor scrapes its own Service and none of the other release's Services.
            assert _selects(match, svc["metadata"]["labels"]), (match, svc["metadata"]["labels"])
            assert not any(_selects(match, s["metadata"]["labels"]) for s in find(other, "Service"))
        (pod_monitor,) = find(own, "PodMonitor")
        assert pod_monitor["spec"]["selector"]["matchLabels"] == {"tandem.dev/deployment": scope.deployment_name}


def test_each_releases_queries_read_its_own_series_only(tmp_path: Path) -> None:
    scopes = {release: _scope(_render(release)) for release in RELEASES}
    series: list[dict[str, str]] = []
    gateway_texts = {}
    for release, scope in scopes.items():
        router_text = with_queued_requests(recorded_router_export(), "prefill", QUEUED[release])
        series += series_from_exposition(router_text, {"namespace": NS, "service": scope.router_service})
        gateway_texts[release] = _gateway_text(TTFT_S[release])
        series += series_from_exposition(gateway_texts[release], {"namespace": NS, "service": scope.gateway_service})
        # vLLM's gauge on a decode pod, named as the pool Deployment names its pods.
        pod = f"{scope.deployment_name}-decode-7c9d8f6b5-x2k9p"
        series.append(
            {
                "series": f'vllm:kv_cache_usage_perc{{namespace="{NS}",pod="{pod}"}}',
                "values": f"{KV_USAGE[release]} {KV_USAGE[release]} {KV_USAGE[release]}",
            }
        )
    expected: dict[str, float | None] = {}
    for release, scope in scopes.items():
        prefill, decode = scope.queries("prefill"), scope.queries("decode")
        expected[prefill["queue_depth"]] = QUEUED[release]
        expected[prefill["ttft_p90_s"]] = histogram_quantile(0.9, _ttft_buckets(gateway_texts[release]))
        expected[decode["kv_usage"]] = KV_USAGE[release]
    # What the queries read without the Services (the namespace alone): both releases' queues at once.
    unscoped = QueryScope(NS, scopes["alpha"].deployment_name)
    expected[unscoped.queries("prefill")["queue_depth"]] = sum(QUEUED.values())
    check_promql(tmp_path, series, expected)
