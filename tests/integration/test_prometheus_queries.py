"""Every PromQL expression Tandem ships (the operator's autoscaling queries, the Grafana
dashboard's panels, the chart's recording and alerting rules) returns data from a real
Prometheus (Debian's package) scraping the real local stack under load: gateway, Ray Serve
router, vLLM workers. Nothing is written from the consumers' assumption of the names.

The scrape configuration stands in for what the chart's ServiceMonitors and PodMonitor add in
a cluster: the ``namespace`` label, and ``pod`` and ``pool`` on the workers' series. The only
expressions left out read kube-state-metrics (replicas per Deployment), which no Tandem component
produces and no cluster runs here."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tandem_operator.signals import QueryScope

from tandem.local.prometheus import LocalPrometheus, stack_targets
from tandem.local.stack import LocalStack
from tests.chart.conftest import CHART, run_helm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

NAMESPACE = "tandem-local"
#: The TandemDeployment's name: its pools' pods are <name>-prefill-* and <name>-decode-*.
DEPLOYMENT = "tandem"
DASHBOARD = CHART / "dashboards" / "tandem.json"
#: Read kube-state-metrics, not a Tandem component.
NOT_PRODUCED_HERE = ("kube_deployment_",)


def _chart_rules() -> list[dict[str, Any]]:
    """The chart's PrometheusRule groups, rendered for NAMESPACE with its default SLOs."""
    out = run_helm(
        "template", "tandem", str(CHART), "--namespace", NAMESPACE, "--set", "monitoring.prometheusRules.enabled=true"
    ).stdout
    (rule,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def _dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    return [
        e.replace("$namespace", NAMESPACE).replace("$deployment", DEPLOYMENT).replace("$__rate_interval", "1m")
        for e in exprs
        if not any(name in e for name in NOT_PRODUCED_HERE)
    ]


@pytest.fixture(scope="module")
def prometheus(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPrometheus]:
    if shutil.which("prometheus") is None:
        pytest.skip("needs Debian's prometheus (make prometheus)")
    server = LocalPrometheus(
        Path(tmp_path_factory.mktemp("prometheus")),
        stack_targets(stack.config, NAMESPACE, DEPLOYMENT),
        rule_groups=_chart_rules(),
    )
    server.start()
    yield server
    server.stop()


def _load(stack: LocalStack, stop: threading.Event) -> None:
    """Chats through the gateway, two at a time, until ``stop``: histograms and rates get data."""
    body = {
        "model": stack.config.served_model_name,
        "messages": [{"role": "user", "content": "Name a colour. Café, 東京, 👋 — <|im_end|> is just text."}],
        "max_tokens": 12,
        "stream": True,
    }

    def one() -> None:
        while not stop.is_set():
            with httpx.Client(base_url=stack.config.gateway_url, headers=stack.auth_headers, timeout=120) as client:
                with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    assert resp.status_code == 200
                    for _ in resp.iter_lines():
                        pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(timeout=120)


def _has_data(prometheus: LocalPrometheus, promql: str) -> bool:
    return bool(prometheus.query(promql))


def test_every_shipped_query_returns_data_from_the_real_stack(stack: LocalStack, prometheus: LocalPrometheus) -> None:
    groups = _chart_rules()
    recorded = [r["expr"] for g in groups for r in g["rules"] if "record" in r]
    # An alert fires on a condition; what it reads must exist: every series name in its expression.
    alert_inputs = sorted(
        {name for g in groups for r in g["rules"] if "alert" in r for name in re.findall(r"tandem:[\w:]+", r["expr"])}
    )
    by_role = [QueryScope(NAMESPACE, DEPLOYMENT).queries(role) for role in ("prefill", "decode")]
    # Pending demand is exported only once a request found a pool at zero (test_router_ray reads it from
    # the live export through the operator's parser): a stack serving both pools must show none.
    pending = [queries["pending_demand"] for queries in by_role]
    operator = [q for queries in by_role for signal, q in queries.items() if signal != "pending_demand"]
    queries = {
        **{f"operator: {q}": q for q in operator},
        **{f"dashboard: {q}": q for q in _dashboard_exprs()},
        **{f"recording rule: {q}": q for q in recorded},
        **{f"alert input: {q}": q for q in alert_inputs},
    }
    assert len(operator) == 11 and len(pending) == 2 and recorded and alert_inputs

    stop = threading.Event()
    loader = threading.Thread(target=_load, args=(stack, stop), daemon=True)
    loader.start()
    try:
        # Ray exports the router's metrics every ~10 s; rates need two scrapes with traffic between.
        missing = dict(queries)
        deadline = time.monotonic() + 150
        while missing and time.monotonic() < deadline:
            time.sleep(3)
            missing = {label: q for label, q in missing.items() if not _has_data(prometheus, q)}
    finally:
        stop.set()
        loader.join(timeout=150)
    assert not missing, "no data for:\n" + "\n".join(sorted(missing))
    assert [prometheus.query(q) for q in pending] == [[], []]  # valid PromQL (else it raises), no false demand
