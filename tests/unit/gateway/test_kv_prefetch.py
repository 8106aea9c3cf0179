"""The gateway asks the decode worker to prefetch a prompt's KV while the prefill runs (PrefetchKV),
without holding the Prefill up, and a refused or failed prefetch changes nothing the client sees."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from tandem.v1 import router_pb2

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

MODEL = "SmolLM2-135M-Instruct"


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "héllo 🌍 世界"}], "max_tokens": 8, **extra}


async def test_the_decode_worker_is_asked_to_prefetch_from_the_prefill_workers_kv_server(stack: Any) -> None:
    stack.router.placements[0].num_decode_cached_tokens = 128
    response = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200, response.text
    (prefill_request,) = stack.prefill.prefill_requests
    (prefetch,) = stack.decode.prefetch_requests
    assert prefetch.request_id == prefill_request.request_id == stack.decode.decode_requests[0].request_id
    assert prefetch.kv_address == stack.router.placements[0].prefill.kv_address == stack.prefill.address
    assert prefetch.num_prompt_tokens == len(prefill_request.prompt_token_ids)
    assert prefetch.num_decode_cached_tokens == 128
    started = stack.metrics.registry.get_sample_value("tandem_gateway_kv_prefetches_total", {"outcome": "started"})
    assert started == 1.0


async def test_the_decode_workers_prefix_hit_reaches_the_timings_beside_the_routers_expectation(
    stack: Any, caplog: pytest.LogCaptureFixture
) -> None:
    stack.router.placements[0].num_decode_cached_tokens = 128
    stack.decode.num_decode_cached_tokens = 64  # evicted meanwhile: the hit was smaller than expected
    caplog.set_level(logging.INFO, logger="tandem.gateway.api.generation")
    response = await stack.client.post("/v1/chat/completions", json=chat_body(), headers={"X-Tandem-Timings": "1"})
    assert response.status_code == 200, response.text
    worker = response.json()["tandem_timings"]["worker"]
    assert worker["num_router_expected_decode_cached_tokens"] == 128
    assert worker["num_decode_cached_tokens"] == 64
    # The request's log line carries the same figures, for the requests that cannot ask for them (a
    # /v1/responses or /v1/messages stream sends no timings).
    (finished,) = [r for r in caplog.records if r.getMessage() == "request finished"]
    assert vars(finished)["worker"] == worker


async def test_no_prefetch_without_a_handoff(stack: Any) -> None:
    # One token: the prefill worker keeps no KV. A local prefill: no prefill worker at all.
    response = await stack.client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
    assert response.status_code == 200, response.text
    stack.router.placements[:] = [
        router_pb2.Placement(decode=stack.decode.ref("decode"), lease_s=30.0, local_prefill=True)
    ]
    response = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200, response.text
    assert stack.decode.prefetch_requests == []


async def test_a_prefetch_that_fails_or_is_refused_changes_nothing_for_the_client(stack: Any) -> None:
    texts = []
    for refusal, error in (("staging is full", None), ("", grpc.StatusCode.UNAVAILABLE)):
        stack.decode.prefetch_refusal, stack.decode.prefetch_error = refusal, error
        response = await stack.client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["message"]["content"])
    assert texts == ["Hello world!", "Hello world!"]
    assert len(stack.decode.prefetch_requests) == 2
    registry = stack.metrics.registry
    for _ in range(100):
        if registry.get_sample_value("tandem_gateway_kv_prefetches_total", {"outcome": "failed"}):
            break
        await asyncio.sleep(0.01)
    assert registry.get_sample_value("tandem_gateway_kv_prefetches_total", {"outcome": "refused"}) == 1.0
    assert registry.get_sample_value("tandem_gateway_kv_prefetches_total", {"outcome": "failed"}) == 1.0


async def test_an_answer_that_ends_at_the_prefill_drops_the_decode_workers_prefetch(stack: Any) -> None:
    """The prefill's first token ended the answer (end of sequence, a stop string): no decode follows, so the
    decode worker is told (Abort) and frees what it staged, instead of holding it for its keep time (the fault
    suite's generated bodies found ~17 MB staged after their answers)."""
    stack.prefill.prefill_finish_reason = "stop"
    response = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    # The PrefetchKV call and the Abort are made in the background, each in a task of its own: the answer may
    # come before either arrives (CI once read no PrefetchKV yet), and they may arrive in either order.
    await asyncio.wait_for(stack.decode.aborted_event.wait(), 5)
    for _ in range(500):
        if stack.decode.prefetch_requests:
            break
        await asyncio.sleep(0.01)
    (prefetch,) = stack.decode.prefetch_requests
    assert stack.decode.aborted == [prefetch.request_id] and stack.decode.decode_requests == []
    assert stack.prefill.aborted == []  # its request ended; nothing of it is held


async def test_a_prefill_rescheduled_after_unavailable_drops_the_prefetch_of_the_placement_it_leaves(
    stack: Any,
) -> None:
    """The prefill worker was unavailable: the request is placed again, maybe with another decode worker, so
    the first placement's decode worker is told to drop what it staged (and the second's at the 503)."""
    stack.prefill.prefill_error = grpc.StatusCode.UNAVAILABLE
    response = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 503, response.text
    # Both PrefetchKV calls and both Aborts are made in the background: the 503 may come before they arrive.
    for _ in range(500):
        if len(stack.decode.prefetch_requests) >= 2 and len(stack.decode.aborted) >= 2:
            break
        await asyncio.sleep(0.01)
    first, second = stack.decode.prefetch_requests
    assert first.request_id == second.request_id
    assert stack.decode.aborted == [first.request_id, first.request_id]
