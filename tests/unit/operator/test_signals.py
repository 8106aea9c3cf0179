"""tandem_operator.signals: Prometheus answers and router metrics text."""

from __future__ import annotations

from tandem_operator.signals import (
    CounterRates,
    QueryScope,
    parse_instant_value,
    parse_router_metrics,
    prefill_arrived_tokens,
)

from tests.kit.router_export import recorded_router_export, with_prefill_arrivals


def test_instant_values() -> None:
    vector = {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "0.75"]}]}}
    assert parse_instant_value(vector) == 0.75
    assert parse_instant_value({"status": "success", "data": {"resultType": "vector", "result": []}}) is None
    assert parse_instant_value({"status": "success", "data": {"resultType": "scalar", "result": [1, "NaN"]}}) is None
    assert parse_instant_value({"status": "error"}) is None


def test_queries_are_scoped_to_the_namespace_and_pool() -> None:
    queries = QueryScope("ns1", "chat").queries("decode")
    assert 'namespace="ns1"' in queries["kv_usage"] and 'pod=~"chat-decode-[a-z0-9]+-[a-z0-9]+"' in queries["kv_usage"]
    assert set(queries) == {
        "pending_demand",
        "budget_usage",
        "in_flight",
        "kv_usage",
        "waiting",
        "itl_p90_s",
        "token_rate",
    }
    assert queries["token_rate"] == 'sum(rate(tandem_gateway_generated_tokens_total{namespace="ns1"}[1m]))'
    # The gateway's output-token counter has a model label: in the models form each decode pool reads its own.
    assert QueryScope("ns1", "chat").queries("decode", model="m1")["token_rate"] == (
        'sum(rate(tandem_gateway_generated_tokens_total{namespace="ns1",model="m1"}[1m]))'
    )
    assert queries["pending_demand"] == 'sum(ray_tandem_router_pending_demand{namespace="ns1",role="decode"})'
    assert 'role="decode"' in queries["budget_usage"] and 'role="decode"' in queries["in_flight"]
    assert 'waiting_for="decode"' in queries["waiting"]
    prefill = QueryScope("ns1", "chat").queries("prefill")
    assert set(prefill) == {"pending_demand", "queue_depth", "in_flight", "uncached_tokens", "ttft_p90_s", "token_rate"}
    # The prefill pool's demand as it arrives (placed at once or queued), not the tokens placed: a saturated
    # pool places at its capacity, and a vote from placements asked for exactly the replicas there were.
    assert prefill["token_rate"] == (
        'sum(rate(ray_tandem_router_prefill_arrived_uncached_tokens_total{namespace="ns1"}[1m]))'
    )
    assert not any("ray_tandem_router_prefill_uncached_tokens_total" in q for q in prefill.values())
    assert 'model="m1"' in QueryScope("ns1", "chat").queries("prefill", model="m1")["token_rate"]
    assert 'waiting_for="prefill"' in prefill["queue_depth"]
    # No decode quantity in a prefill query, nor the reverse.
    assert not any("decode" in q for q in prefill.values())
    assert not any("prefill" in q for q in queries.values())


# The shape of Ray's export (names, labels); a test against a real Ray Serve router
# (tests/integration/test_router_ray.py) parses the real thing.
RAY_TEXT = """\
# HELP ray_tandem_router_prefill_tokens_in_flight Uncached prompt tokens ...
# TYPE ray_tandem_router_prefill_tokens_in_flight gauge
ray_tandem_router_prefill_tokens_in_flight{Component="core_worker",replica="a",worker_id="p0"} 1000.0
ray_tandem_router_prefill_tokens_in_flight{Component="core_worker",replica="b",worker_id="p0"} 500.0
# TYPE ray_tandem_router_decode_tokens_in_flight gauge
ray_tandem_router_decode_tokens_in_flight{replica="a",worker_id="d0"} 90000.0
# TYPE ray_tandem_router_queued_requests gauge
ray_tandem_router_queued_requests{replica="a",waiting_for="prefill"} 3.0
ray_tandem_router_queued_requests{replica="b",waiting_for="prefill"} 4.0
ray_tandem_router_queued_requests{replica="a",waiting_for="decode"} 2.0
# TYPE ray_tandem_router_queued_uncached_tokens gauge
ray_tandem_router_queued_uncached_tokens{replica="a",waiting_for="prefill"} 700.0
ray_tandem_router_queued_uncached_tokens{replica="a",waiting_for="decode"} 9000.0
# TYPE ray_tandem_router_pool_budget_used_fraction gauge
ray_tandem_router_pool_budget_used_fraction{replica="a",role="prefill"} 0.1
ray_tandem_router_pool_budget_used_fraction{replica="a",role="decode"} 0.9
ray_tandem_router_pool_budget_used_fraction{replica="b",role="decode"} 0.7
# TYPE ray_tandem_router_pool_in_flight_requests gauge
ray_tandem_router_pool_in_flight_requests{replica="a",role="prefill"} 1.0
ray_tandem_router_pool_in_flight_requests{replica="a",role="decode"} 5.0
ray_tandem_router_pool_in_flight_requests{replica="b",role="decode"} 6.0
"""


def test_router_metrics_sum_over_replicas_and_keep_the_pools_apart() -> None:
    prefill = parse_router_metrics(RAY_TEXT, "prefill")
    assert prefill.queue_depth == 7 and prefill.uncached_tokens == 1000 + 500 + 700
    assert prefill.kv_usage is None and prefill.waiting is None
    decode = parse_router_metrics(RAY_TEXT, "decode")
    assert decode.waiting == 2 and decode.queue_depth is None and decode.uncached_tokens is None
    # Requests in flight are each replica's own (summed); the budget in use is the pool's (averaged).
    assert prefill.in_flight == 1 and prefill.budget_usage is None
    assert decode.in_flight == 11 and decode.budget_usage == 0.8


def test_unprefixed_names_are_not_read() -> None:
    """What the operator once asked for and Ray never exports."""
    text = "# TYPE tandem_router_queue_depth gauge\ntandem_router_queue_depth 3\n"
    assert parse_router_metrics(text, "prefill") == parse_router_metrics("", "prefill")
    assert parse_router_metrics("", "prefill").uncached_tokens is None


def test_several_router_pods_sum_their_counts_and_average_the_budget_over_every_replica() -> None:
    """One text per router pod (source router with a Service): queues, backlogs and requests in flight are
    each held by one replica and add up; the budget in use is every replica's view of the whole pool, so it
    is averaged over all replicas (0.9, 0.7 on one pod, 0.2 on the other: 0.6, not the pods' mean 0.5)."""
    second_pod = """\
# TYPE ray_tandem_router_queued_requests gauge
ray_tandem_router_queued_requests{replica="c",waiting_for="prefill"} 5.0
# TYPE ray_tandem_router_prefill_tokens_in_flight gauge
ray_tandem_router_prefill_tokens_in_flight{replica="c",worker_id="p1"} 250.0
# TYPE ray_tandem_router_pool_budget_used_fraction gauge
ray_tandem_router_pool_budget_used_fraction{replica="c",role="decode"} 0.2
# TYPE ray_tandem_router_pool_in_flight_requests gauge
ray_tandem_router_pool_in_flight_requests{replica="c",role="decode"} 4.0
"""
    prefill = parse_router_metrics([RAY_TEXT, second_pod], "prefill")
    assert prefill.queue_depth == 7 + 5 and prefill.uncached_tokens == 1000 + 500 + 700 + 250
    decode = parse_router_metrics([RAY_TEXT, second_pod], "decode")
    assert decode.in_flight == 11 + 4
    assert decode.budget_usage is not None and abs(decode.budget_usage - 0.6) < 1e-12


def test_pending_demand_is_read_per_pool_and_summed_over_pods() -> None:
    """Requests refused for want of any decode worker (the pool at zero): decode's signal, not prefill's;
    absent (no refusal in the router's window) is no signal, not zero."""
    refusals = """\
# TYPE ray_tandem_router_pending_demand gauge
ray_tandem_router_pending_demand{replica="a",role="decode",model="m"} 3.0
ray_tandem_router_pending_demand{replica="b",role="decode",model="m"} 1.0
ray_tandem_router_pending_demand{replica="b",role="decode",model="other"} 9.0
"""
    second_pod = (
        "# TYPE ray_tandem_router_pending_demand gauge\n"
        'ray_tandem_router_pending_demand{replica="c",role="decode",model="m"} 2.0\n'
    )
    assert parse_router_metrics([RAY_TEXT + refusals, second_pod], "decode", "m").pending_demand == 6
    assert parse_router_metrics([RAY_TEXT + refusals, second_pod], "decode").pending_demand == 15
    assert parse_router_metrics([RAY_TEXT + refusals], "prefill").pending_demand is None
    assert parse_router_metrics(RAY_TEXT, "decode").pending_demand is None


def test_the_prefill_demand_is_the_arrivals_counter_of_the_real_export() -> None:
    """The recorded export (its shape checked against a live Ray Serve router): the counter Ray exports with
    ``_total``, selected by model; a pod that has counted nothing yet (no series) reads 0."""
    text = with_prefill_arrivals(recorded_router_export(), 1234)
    model = "model-test_metrics_reach_rays_prometheus_endpoint"
    assert prefill_arrived_tokens(text, model) == 1234
    assert prefill_arrived_tokens(text) == 1234  # the single-model form: unselected
    assert prefill_arrived_tokens(text, "mödel \u2603 'x'") == 0
    assert prefill_arrived_tokens(RAY_TEXT) == 0
    # The placed counter is not the arrivals one.
    placed = "# TYPE ray_tandem_router_prefill_uncached_tokens_total counter\n"
    placed += 'ray_tandem_router_prefill_uncached_tokens_total{model="m"} 900.0\n'
    assert prefill_arrived_tokens(placed) == 0


def test_counter_rates_sum_the_pods_over_a_minute_and_survive_a_restart() -> None:
    rates = CounterRates(window_s=60.0)
    assert rates.rate("ns/a/prefill", {"pod-1": 100.0, "pod-2": 0.0}, 0.0) is None  # one reading: no rate yet
    assert rates.rate("ns/a/prefill", {"pod-1": 1100.0, "pod-2": 500.0}, 10.0) == 100.0 + 50.0
    # pod-2 restarted (its counter from zero again): its 200 new tokens count, not -300.
    assert rates.rate("ns/a/prefill", {"pod-1": 2100.0, "pod-2": 200.0}, 20.0) == 2000 / 20 + (500 + 200) / 20
    # Another resource's readings are its own.
    assert rates.rate("ns/b/prefill", {"pod-1": 5.0}, 20.0) is None
    # A pod new since the last read: no rate this time (some pods' only would read as less demand).
    assert rates.rate("ns/a/prefill", {"pod-1": 3100.0, "pod-2": 200.0, "pod-3": 0.0}, 30.0) is None
    # pod-3 left: forgotten, the rest go on.
    assert rates.rate("ns/a/prefill", {"pod-1": 4100.0, "pod-2": 200.0}, 40.0) == 4000 / 40 + 700 / 40
    # The readings of the last minute and the last one before it: older ones drop out.
    assert rates.rate("ns/a/prefill", {"pod-1": 4100.0, "pod-2": 200.0}, 100.0) == 0.0  # from t=40
    assert rates.rate("ns/a/prefill", {"pod-1": 10100.0, "pod-2": 200.0}, 130.0) == 6000 / 90  # from t=40
    assert rates.rate("ns/a/prefill", {"pod-1": 10100.0, "pod-2": 200.0}, 170.0) == 6000 / 70  # from t=100
