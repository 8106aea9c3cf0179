"""Stream and non-stream responses of both endpoints, exactly as OpenAI shapes them."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

MODEL = "SmolLM2-135M-Instruct"


def sse_events(body: bytes) -> list[Any]:
    """Split an SSE body into decoded ``data:`` payloads; [DONE] stays a string. Strict about framing."""
    assert body.endswith(b"\n\n"), body[-40:]
    events: list[Any] = []
    for block in body.decode().split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        assert "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], **extra}


async def test_chat_stream_has_openai_shape(stack: Any, wait: Any) -> None:
    response = await stack.client.post(
        "/v1/chat/completions",
        json=chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=10, temperature=0.5, seed=7),
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    events = sse_events(response.content)

    role, *deltas, finish, usage, done = events
    request_id = role["id"]
    assert request_id.startswith("chatcmpl-")
    assert role == {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": role["created"],
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,
    }
    assert list(role) == ["id", "object", "created", "model", "choices", "usage"]
    # The first token's text comes from prefill, the rest from decode; the empty-text token is skipped.
    assert [d["choices"][0]["delta"] for d in deltas] == [
        {"content": "Hello"},
        {"content": " world"},
        {"content": "!"},
    ]
    assert all(d["id"] == request_id and d["choices"][0]["finish_reason"] is None for d in deltas)
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 4,  # the prefill's token + three decoded tokens
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert done == "[DONE]"

    # What the workers were asked.
    (prefill_request,) = stack.prefill.prefill_requests
    (decode_request,) = stack.decode.decode_requests
    assert prefill_request.request_id == decode_request.request_id == request_id
    # "<|im_start|> user hello world <|im_end|> <|im_start|> assistant " in the test vocabulary.
    assert list(prefill_request.prompt_token_ids) == [1, 4, 7, 8, 2, 1, 5]
    assert prefill_request.keep_kv is True
    assert prefill_request.sampling.max_tokens == 10
    assert prefill_request.sampling.temperature == pytest.approx(0.5)
    assert prefill_request.sampling.seed == 7
    assert not prefill_request.sampling.HasField("top_p")
    assert list(decode_request.prompt_token_ids) == list(prefill_request.prompt_token_ids)
    assert decode_request.first_token_id == 101
    assert decode_request.sampling.max_tokens == 10  # the first token counts: decode replays it
    assert list(decode_request.kv_handle.block_ids) == [7, 8]
    assert stack.router.schedule_calls[0]["max_tokens"] == 10
    await wait(stack.router.released_event)
    assert stack.router.released == [request_id]
    assert stack.prefill.aborted == [] and stack.decode.aborted == []


async def test_chat_stream_without_usage_option_sends_no_usage(stack: Any) -> None:
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in e for e in events[:-1])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


async def test_chat_non_stream(stack: Any) -> None:
    response = await stack.client.post("/v1/chat/completions", json=chat_body(max_tokens=5))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world!"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 4,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert response.headers["x-request-id"] == body["id"]


async def test_default_max_tokens_is_capped_by_remaining_context(stack: Any) -> None:
    # max_model_len 64, default_max_tokens 16: a short prompt gets 16.
    await stack.client.post("/v1/chat/completions", json=chat_body())
    assert stack.router.schedule_calls[-1]["max_tokens"] == 16
    # A 55-token prompt leaves 9.
    prompt = " ".join(["one"] * 55)
    await stack.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert stack.router.schedule_calls[-1]["max_tokens"] == 9


async def test_completions_stream(stack: Any) -> None:
    response = await stack.client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "one two three",
            "stream": True,
            "max_tokens": 4,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    *texts, finish, usage, done = sse_events(response.content)
    assert all(t["object"] == "text_completion" and t["id"].startswith("cmpl-") for t in texts)
    assert [t["choices"] for t in texts] == [
        [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": " world", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "!", "logprobs": None, "finish_reason": None}],
    ]
    assert finish["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 3
    assert usage["usage"]["completion_tokens"] == 4
    assert done == "[DONE]"
    assert list(stack.prefill.prefill_requests[0].prompt_token_ids) == [14, 15, 16]


async def test_completions_non_stream_with_token_ids(stack: Any) -> None:
    response = await stack.client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello world!", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["prompt_tokens"] == 3
    assert list(stack.prefill.prefill_requests[0].prompt_token_ids) == [5, 6, 7]


async def test_prefill_that_finishes_skips_decode(stack: Any, wait: Any) -> None:
    stack.prefill.prefill_finish_reason = "stop"
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = sse_events(response.content)
    assert [e["choices"][0]["delta"] for e in events[1:3]] == [{"content": "Hello"}, {}]
    assert events[2]["choices"][0]["finish_reason"] == "stop"
    assert stack.decode.decode_requests == []
    await wait(stack.router.released_event)
    assert stack.prefill.aborted == []


async def test_one_token_request_does_not_keep_kv(stack: Any) -> None:
    stack.prefill.prefill_finish_reason = "length"
    response = await stack.client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 1
    assert stack.prefill.prefill_requests[0].keep_kv is False
    assert stack.decode.decode_requests == []


async def test_models_health(stack: Any) -> None:
    models = (await stack.client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (await stack.client.get(f"/v1/models/{MODEL}")).status_code == 200
    assert (await stack.client.get("/v1/models/other")).json()["error"]["code"] == "model_not_found"
    assert (await stack.client.get("/healthz")).json() == {"status": "ok"}
