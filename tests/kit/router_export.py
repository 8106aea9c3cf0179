"""A recorded export of the real router (Ray Serve's Prometheus endpoint, Ray 2.60): the
``ray_tandem_router_*`` families of one model, taken from the scrape in
tests/integration/test_router_ray.py::test_metrics_reach_rays_prometheus_endpoint, which also checks
that every series here still has the names and label keys of the live export.

Tests that need router metrics text without a Ray cluster (the operator reading several router pods)
take this text and set the values they need with :func:`with_queued_requests`; the format stays the
producer's.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

SAMPLE_PATH = Path(__file__).with_name("router_export_sample.prom")
QUEUED_REQUESTS = "ray_tandem_router_queued_requests"


def recorded_router_export() -> str:
    return SAMPLE_PATH.read_text()


def with_queued_requests(text: str, waiting_for: str, num_requests: int) -> str:
    """``text`` with its one ``queued_requests{waiting_for=...}`` sample set to ``num_requests``."""
    lines = text.splitlines()
    hits = [
        i
        for i, line in enumerate(lines)
        if line.startswith(QUEUED_REQUESTS + "{") and f'waiting_for="{waiting_for}"' in line
    ]
    assert len(hits) == 1, f"expected one {QUEUED_REQUESTS} sample waiting for {waiting_for}, found {len(hits)}"
    series, _, _ = lines[hits[0]].rpartition(" ")
    lines[hits[0]] = f"{series} {float(num_requests)!r}"
    return "\n".join(lines) + "\n"


def label_shapes(text: str) -> set[tuple[str, frozenset[str]]]:
    """Each ``ray_tandem_router_*`` sample's name and label keys (not values: ids and sessions vary)."""
    return {
        (sample.name, frozenset(sample.labels))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("ray_tandem_router_")
    }
