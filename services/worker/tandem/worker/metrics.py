"""Prometheus endpoint of a worker: vLLM's own ``vllm:*`` metrics (registered
by AsyncLLM in this process) plus ``tandem_kv_*`` counters of the engine's KV
server, as the worker service last read them (through the engine: by GetLoad,
and by the registry heartbeat at most every 30 s), and on a decode worker the
service's own ``tandem_decode_continuations_total{mode}`` and the prefetches'
``tandem_kv_prefetches_total{outcome}``, ``tandem_kv_staged_bytes``, the pulls through shared memory
``tandem_kv_shm_loads_total`` and their ``tandem_kv_shm_fallbacks_total{reason}``; with LoRA on, the adapter
slots' ``tandem_worker_adapter_{loads,evictions,load_failures}_total`` and
``tandem_worker_adapters_loaded`` / ``tandem_worker_adapter_slots`` (tandem.worker.adapters). Started by
``__main__``.

Always in Prometheus's text format: asked for OpenMetrics (as Prometheus
asks first), prometheus_client escapes the colons of ``vllm:*`` names to
underscores, so the same series would be named ``vllm:kv_cache_usage_perc`` or
``vllm_kv_cache_usage_perc`` depending on the scraper (seen with Prometheus
2.42 and prometheus_client 0.26). Dashboards, alerts and the autoscaler ask
for ``vllm:*``; this endpoint never renames them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.worker.handling import CONTINUATION_MODES
from tandem.worker.kv_connector.shm import FALLBACK_REASONS

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
        yield from _adapter_metrics(self._service)
        if role == "decode":
            c = CounterMetricFamily(
                "tandem_decode_continuations",
                "Decodes by how they continued the first token: appended to the prompt, replayed, or a local prefill",
                labels=["mode"],
            )
            by_mode = self._service.decodes_by_continuation
            for mode in CONTINUATION_MODES:
                c.add_metric([mode], float(by_mode.get(mode, 0)))
            yield c
            c = CounterMetricFamily(
                "tandem_kv_prefetches",
                "KV prefetches (a prompt's KV streamed while its prefill ran): used by the decode, wasted "
                "(failed, not covering the load, or never used), refused at the start",
                labels=["outcome"],
            )
            c.add_metric(["used"], float(s.prefetches_used_total))
            c.add_metric(["wasted"], float(s.prefetches_wasted_total))
            c.add_metric(["refused"], float(self._service.prefetches_by_outcome.get("refused", 0)))
            yield c
            g = GaugeMetricFamily("tandem_kv_staged_bytes", "Bytes of prefetched KV waiting for their decode")
            g.add_metric([], float(s.staged_bytes))
            yield g
            c = CounterMetricFamily("tandem_kv_shm_loads", "KV loads pulled through shared memory (same host)")
            c.add_metric([], float(s.shm_loads_total))
            yield c
            c = CounterMetricFamily(
                "tandem_kv_shm_prefetches", "KV prefetches streamed through shared memory (same host), all written"
            )
            c.add_metric([], float(s.shm_prefetches_total))
            yield c
            c = CounterMetricFamily(
                "tandem_kv_shm_fallbacks",
                "Pulls and prefetches through shared memory that fell back to gRPC, by reason",
                labels=["reason"],
            )
            for reason in FALLBACK_REASONS:
                c.add_metric([reason], float(s.shm_fallbacks_total.get(reason, 0)))
            yield c


def _adapter_metrics(service: WorkerService) -> Iterator[Metric]:
    """The adapter slots' counters (nothing with LoRA off)."""
    adapters = service.adapters
    if adapters is None:
        return
    role = service.role
    for name, doc, value in (
        ("tandem_worker_adapter_loads", "LoRA adapters loaded into the engine", adapters.num_loads),
        (
            "tandem_worker_adapter_evictions",
            "Idle LoRA adapters removed from the engine to load another",
            adapters.num_evictions,
        ),
        ("tandem_worker_adapter_load_failures", "LoRA adapter loads that failed", adapters.num_load_failures),
    ):
        c = CounterMetricFamily(name, doc, labels=["role"])
        c.add_metric([role], float(value))
        yield c
    for name, doc, value in (
        ("tandem_worker_adapters_loaded", "LoRA adapters in the engine now", len(adapters.loaded())),
        ("tandem_worker_adapter_slots", "LoRA adapters the engine holds at once (max_loras)", adapters.max_adapters),
    ):
        g = GaugeMetricFamily(name, doc, labels=["role"])
        g.add_metric([role], float(value))
        yield g


def metrics_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """WSGI: ``GET /metrics`` in the text format, whatever the ``Accept`` header asks."""
    if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]
    body = generate_latest(REGISTRY)
    start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
    return [body]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


def start_metrics_server(host: str, port: int, service: WorkerService) -> None:
    """Serve /metrics on its own thread."""
    REGISTRY.register(KVCollector(service))
    server = make_server(host, port, metrics_app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="tandem-metrics", daemon=True).start()
