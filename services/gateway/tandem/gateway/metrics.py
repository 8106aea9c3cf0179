"""Prometheus metrics of the gateway, in a registry of their own (served at
``/metrics`` by :mod:`tandem.gateway.app`). Recorded by the route handlers
(latencies as the client sees them: measured when bytes are handed to the
server) and by the orchestrator (per-stage timings). Labels never carry
request content, tenants' keys or ids.

The latencies the operator's per-model autoscaling reads (TTFT, inter-token
latency; the end-to-end latency beside them) carry a ``model`` label: the base
model the request ran on (an adapter's requests count as their base model's),
one of the served models :meth:`GatewayMetrics.serve_models` names (the app sets
them); any other name is recorded as ``model=""``, so no request can add a label
value."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# From a millisecond to several minutes: TTFT under load and whole long answers both fit.
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
INTER_TOKEN_BUCKETS_S = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


class GatewayMetrics:
    """All gateway metrics; one instance per app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        #: The values the ``model`` label may take (:meth:`serve_models`).
        self._models: frozenset[str] = frozenset()
        self.time_to_first_token_s = Histogram(
            "tandem_gateway_time_to_first_token_seconds",
            "Request received to first generated text handed to the client, by base model.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token_latency_s = Histogram(
            "tandem_gateway_inter_token_latency_seconds",
            "Time between consecutive generated tokens handed to the client (a chunk of k tokens "
            "counts k observations of gap/k), by base model.",
            ["model"],
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self.e2e_request_latency_s = Histogram(
            "tandem_gateway_e2e_request_latency_seconds",
            "Request received to last byte of the response (successful requests), by base model.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.stage_s = Histogram(
            "tandem_gateway_stage_seconds",
            "Time spent in one stage of the request path: auth (key lookup), tokenize (body read, "
            "validation, prompt assembly, chat template), quota (Redis admission), schedule (router, admission "
            "queue included), prefill (first token, gateway's view), prefill_engine (the prefill worker's engine "
            "time), kv_transfer (decode worker pulling KV), first_byte_write (first token to first byte handed "
            "to the server), decode (remaining tokens).",
            ["stage"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.requests_total = Counter(
            "tandem_gateway_requests_total",
            "Finished requests by endpoint and HTTP status (499: the client went away).",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.in_flight_requests = Gauge(
            "tandem_gateway_in_flight_requests",
            "Generation requests being served now.",
            registry=self.registry,
        )
        self.generated_tokens_total = Counter(
            "tandem_gateway_generated_tokens_total",
            "Completion tokens handed to clients, by base model (the decode pool's demand in the operator).",
            ["model"],
            registry=self.registry,
        )

        self.worker_retries_total = Counter(
            "tandem_gateway_worker_retries_total",
            "Requests placed once more because their prefill or decode worker was unavailable before it "
            "answered (a worker that died and whose registration has not expired yet).",
            ["role"],
            registry=self.registry,
        )
        self.migrations_total = Counter(
            "tandem_gateway_migrations_total",
            "Requests moved to another worker after theirs failed: role=decode, a stream whose decode worker "
            "died mid-stream, resumed on another after the tokens already sent; role=prefill, a prefill "
            "placed again before its first token. reason: the worker's gRPC status (unavailable).",
            ["role", "reason"],
            registry=self.registry,
        )
        self.kv_prefetches_total = Counter(
            "tandem_gateway_kv_prefetches_total",
            "PrefetchKV calls to decode workers (KV pulled while the prefill runs) by outcome: started, "
            "refused by the decode worker (its answer says why), failed (the call itself).",
            ["outcome"],
            registry=self.registry,
        )
        self.router_unavailable_retries_total = Counter(
            "tandem_gateway_router_unavailable_retries_total",
            "Schedule calls asked again because the router was unreachable (restarting).",
            registry=self.registry,
        )
        self.slow_reader_disconnects_total = Counter(
            "tandem_gateway_slow_reader_disconnects_total",
            "Streams cut off because the client stopped reading (their generation was cancelled).",
            registry=self.registry,
        )
        self.stored_turns_forgotten_total = Counter(
            "tandem_gateway_stored_turns_forgotten_total",
            "Oldest turns forgotten from a stored conversation (store=conversation) or a stored response's "
            "chain (store=response) because it alone was over the tenant's storage byte limit once its answer "
            "was appended (an answer longer than the estimate the request was admitted with). The next turn's "
            "prompt starts with the instructions and the kept turns: past the instructions, its prefix is not "
            "in the cache once.",
            ["store"],
            registry=self.registry,
        )
        self.rejected_requests_total = Counter(
            "tandem_gateway_rejected_requests_total",
            "Requests refused before generation: unauthenticated (401), forbidden (403), rate_limited (429), "
            "backend_unavailable (503: Redis down), draining (503).",
            ["reason"],
            registry=self.registry,
        )
        self.draining = Gauge(
            "tandem_gateway_draining",
            "1 while this replica drains (SIGTERM received).",
            registry=self.registry,
        )

    def serve_models(self, names: Iterable[str]) -> None:
        """The served (base) models' names: the only values of the ``model`` label."""
        self._models = frozenset(names)

    def model_label(self, model: str) -> str:
        """``model`` when it is a served model, else ""."""
        return model if model in self._models else ""

    def count_generated(self, num_tokens: int, *, model: str) -> None:
        """``num_tokens`` completion tokens of a request of the base model ``model`` reached the client."""
        self.generated_tokens_total.labels(model=self.model_label(model)).inc(num_tokens)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage_s.labels(stage=stage).observe(seconds)

    def observe_first_token(self, ttft_s: float, *, model: str) -> None:
        """A request of the base model ``model`` handed its first text to the client ``ttft_s`` after it arrived."""
        self.time_to_first_token_s.labels(model=self.model_label(model)).observe(ttft_s)

    def observe_e2e(self, e2e_s: float, *, model: str) -> None:
        """A successful request of ``model`` handed its last byte ``e2e_s`` after it arrived."""
        self.e2e_request_latency_s.labels(model=self.model_label(model)).observe(e2e_s)

    def observe_tokens(self, gap_s: float, num_tokens: int, *, model: str) -> None:
        """``num_tokens`` of a request of ``model`` arrived together ``gap_s`` after the previous ones."""
        if num_tokens <= 0:
            return
        per_token_s = gap_s / num_tokens
        histogram = self.inter_token_latency_s.labels(model=self.model_label(model))
        for _ in range(num_tokens):
            histogram.observe(per_token_s)
