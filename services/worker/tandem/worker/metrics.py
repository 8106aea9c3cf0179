"""Prometheus endpoint of a worker: vLLM's own ``vllm:*`` metrics (registered
by AsyncLLM in this process) plus ``tandem_kv_*`` counters of the engine's KV
server, as the worker service last read them (the registry heartbeat reads
them every second, through the engine). Started by ``__main__``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tandem.worker.service import WorkerService


class KVCollector(Collector):
    """The KV server's counters at scrape time (no state of its own)."""

    def __init__(self, service: WorkerService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        s = self._service.last_kv_stats
        labels = ["role"]
        role = self._service.role
        for name, doc, value in (
            ("tandem_kv_transfer_bytes_sent", "KV bytes served to decode engines", s.bytes_sent_total),
            ("tandem_kv_transfer_bytes_received", "KV bytes pulled from prefill engines", s.bytes_received_total),
            ("tandem_kv_tokens_loaded", "Prompt tokens whose KV was loaded over gRPC", s.kv_tokens_loaded_total),
            ("tandem_kv_transfer_seconds", "Time spent pulling KV", s.transfer_seconds_total),
            ("tandem_kv_transfer_failures", "KV loads that failed", s.loads_failed_total),
            ("tandem_kv_leases_expired", "Held KV freed by lease expiry", s.leases_expired_total),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([role], float(value))
            yield c
        g = GaugeMetricFamily("tandem_kv_held_blocks", "KV blocks held for decode engines", labels=labels)
        g.add_metric([role], float(s.num_held_blocks))
        yield g


def start_metrics_server(host: str, port: int, service: WorkerService) -> None:
    """Serve /metrics on its own thread."""
    REGISTRY.register(KVCollector(service))
    start_http_server(port, addr=host)
