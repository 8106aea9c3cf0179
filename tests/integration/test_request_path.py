"""The disaggregated request path end to end on real vLLM engines: prefill on
one worker, KV over gRPC, decode on another, SSE through the gateway."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tandem.local.stack import LocalStack
from tests.probes import gauge, kv_stats, load, read_sse

pytestmark = pytest.mark.integration

QUESTION = "What is the capital of France?"


def _chat(stack: LocalStack, **overrides: object) -> dict[str, object]:
    body: dict[str, object] = {
        "model": stack.config.served_model_name,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 40,
    }
    body.update(overrides)
    return body


def test_streamed_answer_is_paris_and_kv_came_over_grpc(stack: LocalStack) -> None:
    prefill_before, decode_before = load(stack, "prefill"), load(stack, "decode")
    prefetches_before = kv_stats(stack, "decode")
    with httpx.Client(base_url=stack.config.gateway_url, timeout=120, headers=stack.auth_headers) as client:
        with client.stream(
            "POST", "/v1/chat/completions", json=_chat(stack, stream=True, stream_options={"include_usage": True})
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers["cache-control"] == "no-cache"
            assert resp.headers["x-accel-buffering"] == "no"
            raw = "".join(resp.iter_text())
    sse = read_sse(raw.splitlines())
    assert sse.done, raw[-500:]
    first = sse.events[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert "Paris" in sse.text, sse.text
    finishes = [c["finish_reason"] for e in sse.events for c in e["choices"] if c.get("finish_reason")]
    assert finishes in (["stop"], ["length"])
    usage = sse.events[-1]["usage"]
    assert sse.events[-1]["choices"] == []
    num_prompt = usage["prompt_tokens"]
    assert num_prompt > 10 and usage["completion_tokens"] >= 2

    prefill_after, decode_after = load(stack, "prefill"), load(stack, "decode")
    loaded = decode_after.kv_tokens_loaded_total - decode_before.kv_tokens_loaded_total
    computed = decode_after.prompt_tokens_computed_total - decode_before.prompt_tokens_computed_total
    received = decode_after.kv_bytes_received_total - decode_before.kv_bytes_received_total
    sent = prefill_after.kv_bytes_sent_total - prefill_before.kv_bytes_sent_total
    block_size = kv_stats(stack, "decode").layout.block_size_tokens
    # Greedy, no stop string: decode takes prefill's first token as its last prompt token
    # (tandem.worker.continuation), so it computes none of the prompt and loads all of it over gRPC
    # from the prefill engine (a replayed first token would leave the last prompt position to compute).
    assert computed == 0 and loaded == num_prompt, (computed, loaded, num_prompt, block_size)
    assert received > 0 and received == sent
    # The decode worker streamed the KV while the prefill ran (PrefetchKV, StreamBlockBytes), and its
    # load copied it from staging: the bytes above are the stream's, none was pulled after.
    prefetches = kv_stats(stack, "decode")
    assert prefetches.prefetches_started_total == prefetches_before.prefetches_started_total + 1
    assert prefetches.prefetches_used_total == prefetches_before.prefetches_used_total + 1
    assert prefetches.prefetches_wasted_total == prefetches_before.prefetches_wasted_total
    assert prefetches.staged_bytes == 0
    assert gauge(stack, "decode", "tandem_kv_prefetches_total") >= 1  # its /metrics says so too
    # Nothing stays held once the decode side released the blocks.
    assert kv_stats(stack, "prefill").num_held_blocks == 0


def test_non_stream_chat_and_completions(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.config.gateway_url, timeout=120, headers=stack.auth_headers) as client:
        chat = client.post("/v1/chat/completions", json=_chat(stack)).json()
        assert chat["object"] == "chat.completion"
        assert "Paris" in chat["choices"][0]["message"]["content"]
        assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"]
        text = client.post(
            "/v1/completions",
            json={
                "model": stack.config.served_model_name,
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0,
            },
        ).json()
        assert text["object"] == "text_completion"
        assert text["choices"][0]["text"].strip()
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [stack.config.served_model_name]


def test_openai_client_streams_and_non_streams(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.config.gateway_url}/v1", api_key=stack.api_key or "unused", timeout=120)
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(
        model=stack.config.served_model_name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=30,
        temperature=0,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    stream = client.chat.completions.create(
        model=stack.config.served_model_name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "Paris" in "".join(pieces)
    assert usage is not None and usage.completion_tokens >= 2


def test_disconnect_frees_requests_and_kv_on_both_workers(stack: LocalStack) -> None:
    body = _chat(
        stack,
        stream=True,
        max_tokens=1500,
        temperature=0.7,
        ignore_eos=True,
        messages=[{"role": "user", "content": "Write a very long story about a dragon and a city."}],
    )
    with httpx.Client(base_url=stack.config.gateway_url, timeout=120, headers=stack.auth_headers) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            # Keep the line iterator referenced: dropping it (as `break` would) closes the connection.
            lines = resp.iter_lines()
            events = [line for line in (next(lines) for _ in range(40)) if line.startswith("data:")]
            assert len(events) >= 6, events
            # Mid-stream: the decode engine is generating for us right now.
            assert load(stack, "decode").num_running_requests == 1, events
            assert gauge(stack, "decode", "vllm:num_requests_running") == 1
        # Leaving the block closes the connection: a client disconnect.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        busy = [
            load(stack, "decode").num_running_requests,
            gauge(stack, "decode", "vllm:num_requests_running"),
            gauge(stack, "prefill", "vllm:num_requests_running"),
            gauge(stack, "decode", "vllm:kv_cache_usage_perc"),
            gauge(stack, "prefill", "vllm:kv_cache_usage_perc"),
            kv_stats(stack, "prefill").num_held_blocks,
        ]
        if not any(busy):
            break
        time.sleep(0.2)
    assert not any(busy), busy


@pytest.mark.parametrize(
    ("body", "status", "code_or_type"),
    [
        (b"{not json", 400, "invalid_request_error"),
        (json.dumps({"model": "SmolLM2-135M-Instruct", "messages": []}).encode(), 400, "invalid_request_error"),
        (json.dumps({"model": "SmolLM2-135M-Instruct"}).encode(), 400, "invalid_request_error"),
        (
            json.dumps({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps(
                {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}
            ).encode(),
            400,
            "invalid_request_error",
        ),
        (json.dumps({"model": "SmolLM2-135M-Instruct", "messages": "hi"}).encode(), 400, "invalid_request_error"),
        (
            json.dumps(
                {
                    "model": "SmolLM2-135M-Instruct",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 10_000_000,
                }
            ).encode(),
            400,
            "context_length_exceeded",
        ),
        (
            json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
            "model_not_found",
        ),
    ],
)
def test_bad_input_gets_openai_error(stack: LocalStack, body: bytes, status: int, code_or_type: str) -> None:
    resp = httpx.post(
        f"{stack.config.gateway_url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json", **stack.auth_headers},
        timeout=30,
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert code_or_type in (error["type"], error["code"]), error
    assert error["message"]


def test_health_readiness_and_latency_histograms(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.config.gateway_url, timeout=30, headers=stack.auth_headers) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        metrics = client.get("/metrics").text
    for name in (
        "tandem_gateway_time_to_first_token_seconds",
        "tandem_gateway_inter_token_latency_seconds",
        "tandem_gateway_e2e_request_latency_seconds",
    ):
        counts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "_count")]
        assert counts and sum(counts) > 0, name
