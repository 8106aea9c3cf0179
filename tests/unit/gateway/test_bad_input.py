"""Client input errors: always an OpenAI error body with a 4xx, never a 500, and nothing scheduled."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


CHAT_CASES = [
    pytest.param(b"{not json", 400, None, "invalid_json", id="invalid-json"),
    pytest.param(b"[1, 2]", 400, None, "invalid_body", id="body-not-object"),
    pytest.param(b"", 400, None, "invalid_json", id="empty-body"),
    pytest.param({"model": MODEL}, 400, "messages", "missing_required_parameter", id="missing-messages"),
    pytest.param({"messages": USER}, 400, "model", "missing_required_parameter", id="missing-model"),
    pytest.param(chat(messages=[]), 400, "messages", "invalid_value", id="empty-messages"),
    pytest.param(chat(messages="hello"), 400, "messages", "invalid_value", id="messages-not-list"),
    pytest.param(
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages.0.role",
        "invalid_value",
        id="unknown-role",
    ),
    pytest.param(
        chat(messages=[{"content": "hi"}]),
        400,
        "messages.0.role",
        "missing_required_parameter",
        id="missing-role",
    ),
    pytest.param(
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages.0.content",
        "invalid_value",
        id="content-number",
    ),
    pytest.param(chat(messages=["hello"]), 400, "messages.0", "invalid_value", id="message-not-object"),
    pytest.param(chat(max_tokens="10"), 400, "max_tokens", "invalid_value", id="max-tokens-string"),
    pytest.param(chat(max_tokens=0), 400, "max_tokens", "invalid_value", id="max-tokens-zero"),
    pytest.param(chat(max_tokens=True), 400, "max_tokens", "invalid_value", id="max-tokens-bool"),
    pytest.param(chat(temperature=3), 400, "temperature", "invalid_value", id="temperature-high"),
    pytest.param(chat(temperature=-0.1), 400, "temperature", "invalid_value", id="temperature-negative"),
    pytest.param(chat(temperature="hot"), 400, "temperature", "invalid_value", id="temperature-string"),
    pytest.param(chat(top_p=0), 400, "top_p", "invalid_value", id="top-p-zero"),
    pytest.param(chat(stream="yes"), 400, "stream", "invalid_value", id="stream-string"),
    pytest.param(chat(n=2), 400, "n", "unsupported_value", id="n-2"),
    pytest.param(
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "invalid_value",
        id="stream-options-without-stream",
    ),
    pytest.param(chat(stop=[1]), 400, "stop.0", "invalid_value", id="stop-not-strings"),
    pytest.param(chat(logprobs=True), 400, "logprobs", "unsupported_value", id="logprobs"),
    pytest.param(chat(tools=[{"type": "function"}]), 400, "tools", "unsupported_value", id="tools"),
    pytest.param(chat(max_tokens=60), 400, "messages", "context_length_exceeded", id="max-tokens-beyond-context"),
    pytest.param(
        chat(messages=[{"role": "user", "content": "hi " * 70}]),
        400,
        "messages",
        "context_length_exceeded",
        id="prompt-beyond-context",
    ),
    pytest.param(chat(model="gpt-4"), 404, "model", "model_not_found", id="unknown-model"),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), CHAT_CASES)
async def test_chat_bad_input(stack: Any, body: Any, status: int, param: str | None, code: str) -> None:
    if isinstance(body, bytes):
        response = await stack.client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    else:
        response = await stack.client.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code
    assert error["message"]
    assert stack.scheduler.schedule_calls == []
    sample = stack.metrics.registry.get_sample_value(
        "tandem_gateway_requests_total", {"endpoint": "/v1/chat/completions", "status": str(status)}
    )
    assert sample == 1.0


COMPLETION_CASES = [
    pytest.param({"model": MODEL}, "prompt", "missing_required_parameter", id="missing-prompt"),
    pytest.param({"model": MODEL, "prompt": 5}, "prompt", "invalid_value", id="prompt-number"),
    pytest.param({"model": MODEL, "prompt": ["a", "b"]}, "prompt", "unsupported_value", id="batch-prompt"),
    pytest.param({"model": MODEL, "prompt": [1, -2]}, "prompt.1", "invalid_value", id="negative-token-id"),
    pytest.param({"model": MODEL, "prompt": ""}, "prompt", "invalid_value", id="empty-prompt"),
    pytest.param({"model": MODEL, "prompt": "hi", "echo": True}, "echo", "unsupported_value", id="echo"),
    pytest.param(
        {"model": MODEL, "prompt": "hi", "max_tokens": 64},
        "prompt",
        "context_length_exceeded",
        id="beyond-context",
    ),
]


@pytest.mark.parametrize(("body", "param", "code"), COMPLETION_CASES)
async def test_completions_bad_input(stack: Any, body: Any, param: str, code: str) -> None:
    response = await stack.client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert stack.scheduler.schedule_calls == []


async def test_wrong_method_is_405(stack: Any) -> None:
    response = await stack.client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in response.headers["allow"]


async def test_unknown_path_is_404(stack: Any) -> None:
    response = await stack.client.post("/v1/embeddings", json={})
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "Unknown path /v1/embeddings.",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }


async def test_body_over_limit_is_413(stack: Any) -> None:
    big = chat(messages=[{"role": "user", "content": "hello " * 20_000}])  # ~120 KB > 64 KiB test limit
    response = await stack.client.post("/v1/chat/completions", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


async def test_body_over_limit_without_content_length_is_413(stack: Any) -> None:
    async def chunks() -> Any:
        for _ in range(100):
            yield b"x" * 1024

    response = await stack.client.post("/v1/chat/completions", content=chunks())
    assert response.status_code == 413


async def test_developer_role_and_text_parts_are_accepted(stack: Any) -> None:
    messages = [
        {"role": "developer", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": " world"}]},
    ]
    response = await stack.client.post("/v1/chat/completions", json=chat(messages=messages, max_tokens=3))
    assert response.status_code == 200, response.text
    # developer is rendered as system; the parts are joined.
    assert list(stack.prefill.prefill_requests[0].prompt_token_ids) == [1, 3, 9, 2, 1, 4, 7, 8, 2, 1, 5]
