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


PENDING_DEMAND = "ray_tandem_router_pending_demand"
PREFILL_ARRIVALS = "ray_tandem_router_prefill_arrived_uncached_tokens_total"


def with_prefill_arrivals(text: str, num_tokens: float) -> str:
    """``text`` with its one ``prefill_arrived_uncached_tokens_total`` sample (a counter) set to ``num_tokens``."""
    lines = text.splitlines()
    hits = [i for i, line in enumerate(lines) if line.startswith(PREFILL_ARRIVALS + "{")]
    assert len(hits) == 1, f"expected one {PREFILL_ARRIVALS} sample, found {len(hits)}"
    series, _, _ = lines[hits[0]].rpartition(" ")
    lines[hits[0]] = f"{series} {float(num_tokens)!r}"
    return "\n".join(lines) + "\n"


def with_pending_demand(text: str, role: str, num_refused: int) -> str:
    """``text`` plus a ``pending_demand`` sample for ``role`` (the pool at zero), with the labels Ray puts on
    the recorded queue sample (its ``waiting_for`` becoming ``role``): the shape
    tests/integration/test_router_ray.py checks against the live export of a real refusal."""
    (line,) = [
        line
        for line in text.splitlines()
        if line.startswith(QUEUED_REQUESTS + "{") and 'waiting_for="prefill"' in line
    ]
    series, _, _ = line.rpartition(" ")
    series = PENDING_DEMAND + series[len(QUEUED_REQUESTS) :].replace('waiting_for="prefill"', f'role="{role}"')
    return text + f"# TYPE {PENDING_DEMAND} gauge\n{series} {float(num_refused)!r}\n"


def label_shapes(text: str) -> set[tuple[str, frozenset[str]]]:
    """Each ``ray_tandem_router_*`` sample's name and label keys (not values: ids and sessions vary)."""
    return {
        (sample.name, frozenset(sample.labels))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("ray_tandem_router_")
    }
