"""Prometheus endpoint of a worker: vLLM's own ``vllm:*`` metrics (registered
by AsyncLLM in this process) plus ``tandem_kv_*`` counters read from the
engine's KV server on each scrape. Started by ``__main__``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.common.tls import TLSSettings, channel
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

if TYPE_CHECKING:
    from tandem.worker.service import WorkerService


class ServiceCollector(Collector):
    """The request-handling side's own counters, read at scrape time."""

    def __init__(self, service: WorkerService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "tandem_worker_decode_stats_unavailable",
            "Finished decodes reported without their KV load figures (the KV server did not answer in time)",
            labels=["role"],
        )
        c.add_metric([self._service.role], float(self._service.num_decode_stats_unavailable))
        yield c


class KVCollector(Collector):
    """Reads the KV server's counters at scrape time (no state of its own)."""

    def __init__(self, kv_address: str, role: str, tls: TLSSettings) -> None:
        self._stub = kv_transfer_pb2_grpc.KVTransferStub(channel(kv_address, tls))
        self._role = role

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stub.GetStats(kv_transfer_pb2.KVStatsRequest(), timeout=2)
        except grpc.RpcError:
            return
        labels = ["role"]
        for name, doc, value in (
            ("tandem_kv_transfer_bytes_sent", "KV bytes served to decode engines", s.bytes_sent_total),
            ("tandem_kv_transfer_bytes_received", "KV bytes pulled from prefill engines", s.bytes_received_total),
            ("tandem_kv_tokens_loaded", "Prompt tokens whose KV was loaded over gRPC", s.kv_tokens_loaded_total),
            ("tandem_kv_transfer_seconds", "Time spent pulling KV", s.transfer_seconds_total),
            ("tandem_kv_transfer_failures", "KV loads that failed", s.loads_failed_total),
            ("tandem_kv_leases_expired", "Held KV freed by lease expiry", s.leases_expired_total),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self._role], float(value))
            yield c
        g = GaugeMetricFamily("tandem_kv_held_blocks", "KV blocks held for decode engines", labels=labels)
        g.add_metric([self._role], float(s.num_held_blocks))
        yield g


def start_metrics_server(host: str, port: int, service: WorkerService, tls: TLSSettings) -> None:
    """Serve /metrics on its own thread."""
    REGISTRY.register(KVCollector(service.kv_address, service.role, tls))
    REGISTRY.register(ServiceCollector(service))
    start_http_server(port, addr=host)
