"""A placement with ``local_prefill``: the decode worker runs the whole request (no Prefill call,
no KV handle), streams every token from the first, and is cleaned up like any decode."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tandem.v1 import router_pb2
from tests.kit.gateway import DecodeStep

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

MODEL = "SmolLM2-135M-Instruct"
STEPS = [DecodeStep("Bon", [201]), DecodeStep("jour 🌍", [202, 203]), DecodeStep(" 世界", [204], "stop")]


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "salut"}], "max_tokens": 8, **extra}


def local_placement(stack: Any) -> router_pb2.Placement:
    return router_pb2.Placement(decode=stack.decode.ref("decode"), lease_s=30.0, local_prefill=True)


async def test_the_decode_worker_streams_every_token_and_no_prefill_runs(stack: Any, wait: Any) -> None:
    stack.router.placements[:] = [local_placement(stack)]
    stack.decode.decode_steps = STEPS
    stack.decode.num_decode_cached_tokens = 128
    response = await stack.client.post(
        "/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True})
    )
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "Bonjour 🌍 世界"
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    # Every token came from the decode worker: none from a prefill worker to add.
    assert usage["completion_tokens"] == 4
    assert usage["prompt_tokens_details"]["cached_tokens"] == 128
    assert stack.prefill.prefill_requests == []
    (decode_request,) = stack.decode.decode_requests
    assert decode_request.local_prefill
    assert not decode_request.HasField("kv_handle")
    assert decode_request.first_token_id == 0 and decode_request.first_text == ""
    assert decode_request.sampling.max_tokens == 8
    await wait(stack.router.released_event)
    assert stack.decode.aborted == []  # completed: nothing to abort


async def test_a_complete_answer_counts_the_same_tokens(stack: Any) -> None:
    stack.router.placements[:] = [local_placement(stack)]
    stack.decode.decode_steps = STEPS
    response = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "Bonjour 🌍 世界"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4


async def test_a_dead_decode_worker_is_replaced_and_the_prefill_stays_local(
    stack: Any, free_dead_address: str, wait: Any
) -> None:
    """Nothing was streamed yet: the second Schedule asks for a local prefill only (no prefill worker
    holds KV, so it is not decode-only, and no prefill budget may be booked); it replaces the first
    one's reservation, with no Release between the two. The scripted router still answers with a pair
    (as a router of the version before would): the new decode worker prefills alone all the same, no
    handoff starts."""
    dead = router_pb2.WorkerRef(worker_id="decode-dead", role="decode", address=free_dead_address)
    stack.router.placements[:] = [
        router_pb2.Placement(decode=dead, lease_s=30.0, local_prefill=True),
        router_pb2.Placement(prefill=stack.prefill.ref("prefill"), decode=stack.decode.ref("decode"), lease_s=30.0),
    ]
    stack.decode.decode_steps = STEPS
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200
    assert '"error"' not in response.text and response.text.endswith("data: [DONE]\n\n")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == "Bonjour 🌍 世界"
    first, second = stack.router.schedule_calls
    assert second["exclude_worker_ids"] == ["decode-dead"]
    assert second["prefill_done_on_worker_id"] == "" and second["local_prefill_only"] is True
    assert first["local_prefill_only"] is False
    assert second["prompt_block_hashes"] == first["prompt_block_hashes"]
    assert stack.hasher.num_hashed == 1
    assert stack.prefill.prefill_requests == []
    (decode_request,) = stack.decode.decode_requests
    assert decode_request.local_prefill and not decode_request.HasField("kv_handle")
    await wait(stack.router.released_event)
    await asyncio.sleep(0.05)
    request_id = first["request_id"]
    assert stack.router.calls == [("schedule", request_id), ("schedule", request_id), ("release", request_id)]
    assert stack.metrics.registry.get_sample_value("tandem_gateway_worker_retries_total", {"role": "decode"}) == 1


async def test_a_client_gone_mid_stream_aborts_the_decode_worker_only(stack: Any, live_url: str, wait: Any) -> None:
    import httpx

    stack.router.placements[:] = [local_placement(stack)]
    stack.decode.decode_steps = STEPS
    stack.decode.decode_hang_after = 1
    async with httpx.AsyncClient(base_url=live_url, timeout=10) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and "Bon" in line:
                    break
    await wait(stack.decode.decode_cancelled, 2.0)
    await wait(stack.decode.aborted_event)
    await wait(stack.router.released_event)
    request_id = stack.decode.decode_requests[0].request_id
    assert stack.decode.aborted == [request_id]
    assert stack.prefill.aborted == []
    assert stack.router.released == [request_id]
