"""tandem_operator.signals: Prometheus answers and router metrics text."""

from __future__ import annotations

from tandem_operator.signals import QueryScope, parse_instant_value, parse_router_metrics


def test_instant_values() -> None:
    vector = {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "0.75"]}]}}
    assert parse_instant_value(vector) == 0.75
    assert parse_instant_value({"status": "success", "data": {"resultType": "vector", "result": []}}) is None
    assert parse_instant_value({"status": "success", "data": {"resultType": "scalar", "result": [1, "NaN"]}}) is None
    assert parse_instant_value({"status": "error"}) is None


def test_queries_are_scoped_to_the_namespace_and_pool() -> None:
    queries = QueryScope("ns1", "chat").queries("decode")
    assert 'namespace="ns1"' in queries["kv_usage"] and 'pod=~"chat-decode-.*"' in queries["kv_usage"]
    assert set(QueryScope("ns1", "chat").queries("prefill")) == {"queue_depth", "uncached_tokens", "ttft_p90_s"}


def test_router_metrics_sum_over_replicas() -> None:
    text = (
        "# TYPE tandem_router_queue_depth gauge\n"
        'tandem_router_queue_depth{replica="a"} 3\n'
        'tandem_router_queue_depth{replica="b"} 4\n'
        "# TYPE tandem_router_uncached_prompt_tokens_in_flight gauge\n"
        'tandem_router_uncached_prompt_tokens_in_flight{replica="a"} 1000\n'
    )
    signals = parse_router_metrics(text)
    assert signals.queue_depth == 7 and signals.uncached_tokens == 1000 and signals.kv_usage is None
