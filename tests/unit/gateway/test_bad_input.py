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
    pytest.param(chat(top_logprobs=2), 400, None, "invalid_value", id="top-logprobs-without-logprobs"),
    pytest.param(chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value", id="top-logprobs-21"),
    pytest.param(
        chat(tools=[{"type": "function"}], tool_choice="required"),
        400,
        "tools.0.function",
        "missing_required_parameter",
        id="tools",
    ),
    pytest.param(chat(tool_choice="auto"), 400, "tool_choice", "invalid_value", id="tool-choice-without-tools"),
    pytest.param(chat(functions=[{"name": "f"}]), 400, "functions", "unsupported_parameter", id="functions"),
    pytest.param(chat(function_call="auto"), 400, "function_call", "unsupported_parameter", id="function-call"),
    pytest.param(chat(parallel_tool_calls=1), 400, "parallel_tool_calls", "invalid_value", id="ptc"),
    pytest.param(
        chat(messages=[{"role": "tool", "content": "42"}]),
        400,
        "messages.0",
        "invalid_value",
        id="tool-message-without-call-id",
    ),
    pytest.param(
        chat(messages=[{"role": "user", "content": "hi", "name": "ann"}]),
        400,
        "messages.0.name",
        "unsupported_parameter",
        id="message-name",
    ),
    pytest.param(
        chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]),
        400,
        "messages.0.tool_calls.0.type",
        "missing_required_parameter",
        id="assistant-tool-call-without-type",
    ),
    pytest.param(chat(guided_json={"type": "object"}), 400, "guided_json", "unsupported_parameter", id="guided"),
    pytest.param(chat(prompt_logprobs=1), 400, "prompt_logprobs", "unsupported_parameter", id="prompt-logprobs"),
    pytest.param(chat(use_beam_search=True), 400, "use_beam_search", "unsupported_parameter", id="beam"),
    pytest.param(chat(cache_salt="x"), 400, "cache_salt", "unsupported_parameter", id="cache-salt"),
    pytest.param(chat(logit_bias={"abc": 1}), 400, "logit_bias", "invalid_value", id="logit-bias-key"),
    pytest.param(chat(logit_bias={"5": 101}), 400, "logit_bias", "invalid_value", id="logit-bias-range"),
    pytest.param(
        chat(response_format={"type": "json_schema"}), 400, "response_format", "invalid_value", id="schema-missing"
    ),
    pytest.param(chat(response_format={"type": "xml"}), 400, "response_format.type", "invalid_value", id="rf-type"),
    pytest.param(
        chat(structured_outputs={"regex": "a+", "choice": ["a"]}),
        400,
        "structured_outputs",
        "invalid_value",
        id="structured-two-kinds",
    ),
    pytest.param(
        chat(structured_outputs={"json": "{not json"}), 400, "structured_outputs", "invalid_value", id="bad-json"
    ),
    pytest.param(
        chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        400,
        "structured_outputs",
        "invalid_value",
        id="both-formats",
    ),
    pytest.param(chat(min_p=1.5), 400, "min_p", "invalid_value", id="min-p"),
    pytest.param(chat(repetition_penalty=0), 400, "repetition_penalty", "invalid_value", id="rep-penalty"),
    pytest.param(chat(min_tokens=-1), 400, "min_tokens", "invalid_value", id="min-tokens"),
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
    assert stack.router.schedule_calls == []
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
    pytest.param({"model": MODEL, "prompt": "hi", "echo": True}, "echo", "unsupported_parameter", id="echo"),
    pytest.param({"model": MODEL, "prompt": "hi", "suffix": "x"}, "suffix", "unsupported_parameter", id="suffix"),
    pytest.param({"model": MODEL, "prompt": "hi", "best_of": 2}, "best_of", "unsupported_parameter", id="best-of"),
    pytest.param({"model": MODEL, "prompt": "hi", "logprobs": 6}, "logprobs", "invalid_value", id="logprobs-6"),
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
    assert stack.router.schedule_calls == []


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
