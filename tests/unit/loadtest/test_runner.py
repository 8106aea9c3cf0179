"""The runner against a fake streaming server: bounds, arrival modes,
concurrency caps, tenants' keys, outcome counting, cancellation, chat history."""

from __future__ import annotations

import time

import pytest
from tandem_loadtest.arrivals import BurstArrivals, ConstantArrivals, FixedConcurrency, PoissonArrivals
from tandem_loadtest.distributions import LengthDist
from tandem_loadtest.metrics import summarize
from tandem_loadtest.runner import RunConfig, run_load
from tandem_loadtest.tenants import TenantConfig
from tandem_loadtest.workloads import WorkloadOptions

from tests.kit.openai_server import FakeOpenAIServer

SMALL = WorkloadOptions(input_tokens=LengthDist.parse("16"), output_tokens=LengthDist.parse("5"))


def config(**overrides: object) -> RunConfig:
    base: dict[str, object] = {
        "base_url": "http://fake/v1",
        "model": "m",
        "arrival": FixedConcurrency(2),
        "tenants": [TenantConfig("a", "sk-a", {"synthetic": 1.0})],
        "workload": SMALL,
        "num_requests": 6,
    }
    base.update(overrides)
    return RunConfig(**base)  # type: ignore[arg-type]


async def test_count_bound_and_fixed_concurrency() -> None:
    server = FakeOpenAIServer()
    result = await run_load(config(arrival=FixedConcurrency(3), num_requests=9), transport=server.transport())
    assert len(result.records) == 9 and len(server.requests) == 9
    assert server.max_in_flight == 3
    assert all(r.status == "ok" and r.completion_tokens == 5 and len(r.content_times_s) == 5 for r in result.records)
    headers, body = server.requests[0]
    assert headers["authorization"] == "Bearer sk-a"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 5
    assert "ignore_eos" not in body
    m = summarize(result.records, result.duration_s)
    assert m["ttft_ms"]["p50"] == pytest.approx(20, abs=15)


async def test_duration_bound_stops_issuing() -> None:
    server = FakeOpenAIServer()
    started = time.perf_counter()
    result = await run_load(config(arrival=ConstantArrivals(20.0), num_requests=None, duration_s=0.5,
                                   ignore_eos=True), transport=server.transport())
    # At most 0.5 s × 20 req/s (+1 at t=0); fewer only if this (shared) machine stalls the loop.
    assert 4 <= len(result.records) <= 11
    assert time.perf_counter() - started < 5.0
    assert server.requests[0][1]["ignore_eos"] is True
    sends = [r.send_s for r in result.records]
    assert sends == sorted(sends) and max(sends) < 0.5 + 0.3


async def test_bursts_and_max_concurrency_cap() -> None:
    server = FakeOpenAIServer(ttft_s=0.05)
    result = await run_load(config(arrival=BurstArrivals(6, 10.0), num_requests=6, max_concurrency=2),
                            transport=server.transport())
    assert len(result.records) == 6 and server.max_in_flight == 2
    # Requests wait for a slot; their clocks start when they are sent, so TTFT stays ~ the server's.
    assert max(r.content_times_s[0] for r in result.records) < 0.5
    assert max(r.send_s for r in result.records) > 0.1


async def test_poisson_open_loop_runs() -> None:
    server = FakeOpenAIServer()
    result = await run_load(config(arrival=PoissonArrivals(50.0), num_requests=10, seed=3),
                            transport=server.transport())
    assert [r.status for r in result.records] == ["ok"] * 10


async def test_429_errors_and_cancellations_are_counted_apart() -> None:
    server = FakeOpenAIServer(ttft_s=0.01, gap_s=0.05)
    tenants = [
        TenantConfig("ok", "sk-ok", {"synthetic": 1.0}),
        TenantConfig("limited", "sk-429", {"synthetic": 1.0}),
        TenantConfig("broken", "sk-500", {"synthetic": 1.0}),
    ]
    result = await run_load(
        config(tenants=tenants, arrival=FixedConcurrency(4), num_requests=30, cancel_fraction=0.3,
               cancel_after_s=0.1),
        transport=server.transport(),
    )
    by_tenant = {t: [r for r in result.records if r.tenant == t] for t in ("ok", "limited", "broken")}
    assert all(r.status == "rate_limited" and r.retry_after_s == 2.0 for r in by_tenant["limited"])
    assert all(r.status == "error" and r.http_status == 500 for r in by_tenant["broken"])
    statuses = {r.status for r in by_tenant["ok"]}
    assert statuses == {"ok", "cancelled"}
    cancelled = [r for r in by_tenant["ok"] if r.status == "cancelled"]
    assert all(r.cancel_after_s == 0.1 and 0.09 <= (r.end_s or 0) < 0.2 for r in cancelled)
    assert server.num_disconnected == len(cancelled)  # the server saw the client go
    s = summarize(result.records, result.duration_s)
    assert s["num_rate_limited"] == len(by_tenant["limited"]) > 0
    assert s["num_errors"] == len(by_tenant["broken"]) > 0
    assert s["num_cancelled"] == len(cancelled) > 0
    assert s["num_ok"] == len(by_tenant["ok"]) - len(cancelled)


async def test_chat_sessions_send_growing_history() -> None:
    server = FakeOpenAIServer()
    opts = WorkloadOptions(output_tokens=LengthDist.parse("3"), chat_turns=LengthDist.parse("4"),
                           chat_max_sessions=1)
    await run_load(config(tenants=[TenantConfig("a", "k", {"chat": 1.0})], workload=opts,
                          arrival=FixedConcurrency(1), num_requests=4), transport=server.transport())
    lengths = [len(body["messages"]) for _, body in server.requests]
    assert lengths == [2, 4, 6, 8]
    # The assistant turns are the answers the server streamed.
    assert server.requests[1][1]["messages"][2] == {"role": "assistant", "content": " t0 t1 t2"}


def test_a_run_needs_a_bound() -> None:
    with pytest.raises(ValueError):
        config(num_requests=None, duration_s=None)
