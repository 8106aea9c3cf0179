"""The gateway from outside (issue 43, item 6, and item 5's public paths): an HTTPRoute
(``gatewayAPI.enabled``) validated against the Gateway API's own schemas (tests/chart/gateway_api.py), with
request timeouts off so Server-Sent Event streams are not cut; and the same public paths for the Ingress
and the HTTPRoute: the API and its OpenAPI document, the playground page only when asked, never /metrics,
/healthz or /readyz."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.chart import gateway_api
from tests.chart.conftest import CHART, RELEASE, one, render, run_helm

FULL = f"{RELEASE}-tandem"
ROUTE = ("gatewayAPI.enabled=true", "gatewayAPI.parentRefs[0].name=public", "gatewayAPI.parentRefs[0].namespace=gw")
API_ONLY = {("/v1", "Prefix"), ("/openapi.json", "Exact")}


def _route_paths(route: dict[str, Any]) -> set[tuple[str, str]]:
    kinds = {"PathPrefix": "Prefix", "Exact": "Exact"}
    (rule,) = route["spec"]["rules"]
    return {(m["path"]["value"], kinds[m["path"]["type"]]) for m in rule["matches"]}


def _ingress_paths(ingress: dict[str, Any]) -> set[tuple[str, str]]:
    (rule,) = ingress["spec"]["rules"]
    return {(p["path"], p["pathType"]) for p in rule["http"]["paths"]}


def test_the_httproute_is_valid_and_keeps_streams_open() -> None:
    docs = render(None, ROUTE)
    route = one(docs, "HTTPRoute", f"{FULL}-gateway")
    assert gateway_api.validate([route]) == ["ok"]
    (rule,) = route["spec"]["rules"]
    assert rule["timeouts"] == {"request": "0s", "backendRequest": "0s"}  # 0s: no timeout (GEP-1742)
    service = one(docs, "Service", f"{FULL}-gateway")
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}]
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gw"}]


def test_the_validator_is_not_a_rubber_stamp() -> None:
    route = copy.deepcopy(one(render(None, ROUTE), "HTTPRoute", f"{FULL}-gateway"))
    route["spec"]["rules"][0]["timeouts"]["request"] = "forever"
    broken_port = copy.deepcopy(route)
    broken_port["spec"]["rules"][0]["timeouts"]["request"] = "0s"
    broken_port["spec"]["rules"][0]["backendRefs"][0]["port"] = "http"
    verdicts = gateway_api.validate([route, broken_port])
    assert verdicts[0].startswith("invalid") and "timeouts/request" in verdicts[0]
    assert verdicts[1].startswith("invalid") and "port" in verdicts[1]


@pytest.mark.parametrize("playground", [False, True])
def test_ingress_and_route_expose_the_same_public_paths(playground: bool) -> None:
    docs = render(None, (*ROUTE, "gateway.ingress.enabled=true", f"gateway.publicPlayground={str(playground).lower()}"))
    expected = API_ONLY | ({("/", "Exact")} if playground else set())
    assert _route_paths(one(docs, "HTTPRoute", f"{FULL}-gateway")) == expected
    assert _ingress_paths(one(docs, "Ingress", f"{FULL}-gateway")) == expected
    # Nothing else of the gateway's is reachable: the playground is the exact page, not a prefix.
    for path in ("/metrics", "/healthz", "/readyz"):
        assert not any(path.startswith(p) if kind == "Prefix" else path == p for p, kind in expected)


def test_a_route_without_a_gateway_fails_with_a_message() -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--set", "gatewayAPI.enabled=true", check=False)
    assert proc.returncode != 0
    assert "set gatewayAPI.parentRefs" in proc.stderr


def test_metrics_have_a_port_of_their_own_that_only_prometheus_reaches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway serves /metrics on TANDEM_GATEWAY_METRICS_PORT alone (tests/unit/gateway/test_edge_streaming.py
    runs that process); the chart sets it, names the port, scrapes it, and admits only the monitoring namespace."""
    from tandem.gateway.settings import GatewaySettings

    docs = render("ci/values-everything.yaml")
    container = one(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for name, value in env.items():
        if name.startswith("TANDEM_GATEWAY_") and value is not None and "ROUTER" not in name:
            monkeypatch.setenv(name, value)
    assert GatewaySettings().metrics_port == ports["metrics"] != ports["http"]
    service = one(docs, "Service", f"{FULL}-gateway")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"http": "http", "metrics": "metrics"}
    (endpoint,) = one(docs, "ServiceMonitor", f"{FULL}-gateway")["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    api_rule, metrics_rule = one(docs, "NetworkPolicy", f"{FULL}-gateway")["spec"]["ingress"]
    assert api_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    (peer,) = metrics_rule["from"]
    assert peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
