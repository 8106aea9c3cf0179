"""The worker's /metrics keeps vLLM's ``vllm:*`` names whatever the scraper asks for: served
OpenMetrics, prometheus_client would rename them ``vllm_*`` (Prometheus asks for OpenMetrics
first), and every dashboard, alert and autoscaling query would find nothing."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, Gauge

from tandem.worker.metrics import metrics_app


def _get(path: str, accept: str) -> tuple[str, dict[str, str], str]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(metrics_app({"PATH_INFO": path, "HTTP_ACCEPT": accept}, start_response))
    return seen["status"], seen["headers"], body.decode()


def test_colon_names_survive_an_openmetrics_scrape() -> None:
    gauge = Gauge("tandem_test:kv_cache_usage_perc", "a vLLM-style name", registry=REGISTRY)
    gauge.set(0.5)
    try:
        for accept in ("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5", "*/*"):
            status, headers, body = _get("/metrics", accept)
            assert status.startswith("200") and headers["Content-Type"].startswith("text/plain;")
            assert "\ntandem_test:kv_cache_usage_perc 0.5\n" in body
            assert "tandem_test_kv_cache_usage_perc" not in body
    finally:
        REGISTRY.unregister(gauge)
    assert _get("/nothing", "*/*")[0].startswith("404")
