"""Tools on ``/v1/messages``: Anthropic's ``tools`` / ``tool_choice`` and ``tool_use`` / ``tool_result`` blocks
translated onto chat's function tools (same prompt and grammar as the chat request), and the answer read back
as ``tool_use`` blocks, whole and streamed, by the fake stack and by the real ``anthropic`` SDK on uvicorn."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from anthropic.types import ToolParam

from tests.kit.gateway import MODEL, DecodeStep
from tests.unit.gateway.test_anthropic_messages import events_of

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

SCHEMA: dict[str, object] = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL: ToolParam = {"name": "get_weather", "description": "Wetter für eine Stadt ☀️", "input_schema": SCHEMA}
ARGUMENTS = {"city": "Paris 🗼"}


def script(stack: Any, text_pieces: list[str]) -> None:
    """The fake workers answer with these pieces of text (the prefill's first token, then decode steps)."""
    stack.prefill.first_text = text_pieces[0]
    steps = [DecodeStep(piece, [102 + i]) for i, piece in enumerate(text_pieces[1:])]
    steps[-1].finish_reason = "stop"
    stack.decode.decode_steps = steps


def named_answer(stack: Any) -> None:
    script(stack, ['{"city"', ': "Par', 'is 🗼"', "}"])


def required_answer(stack: Any) -> None:
    script(stack, ['[{"name": "get_', 'weather", "parameters": {"ci', 'ty": "Paris 🗼"}', "}]"])


def body(**overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Lyon"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "and Paris?"},
                ],
            },
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    out.update(overrides)
    return out


def chat_body() -> dict[str, Any]:
    """The same conversation and tools in chat completions' words."""
    return {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": "checking",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "user", "content": "and Paris?"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": TOOL["description"], "parameters": SCHEMA},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }


async def test_tools_and_history_translate_exactly_into_the_chat_request(stack: Any) -> None:
    named_answer(stack)
    response = await stack.client.post("/v1/messages", json=body())
    assert response.status_code == 200, response.text
    messages_prefill = stack.prefill.prefill_requests[-1]
    chat = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert chat.status_code == 200, chat.text
    chat_prefill = stack.prefill.prefill_requests[-1]
    assert list(messages_prefill.prompt_token_ids) == list(chat_prefill.prompt_token_ids)
    assert messages_prefill.sampling == chat_prefill.sampling
    assert (
        messages_prefill.sampling.HasField("structured_output")
        or messages_prefill.sampling != type(messages_prefill.sampling)()
    )
    call = chat.json()["choices"][0]["message"]["tool_calls"][0]
    message = response.json()
    assert message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "tool_use", "id": message["content"][0]["id"], "name": "get_weather", "input": ARGUMENTS}
    ]
    assert json.loads(call["function"]["arguments"]) == ARGUMENTS


async def test_any_streams_tool_use_blocks(stack: Any) -> None:
    required_answer(stack)
    response = await stack.client.post("/v1/messages", json=body(tool_choice={"type": "any"}, stream=True))
    assert response.status_code == 200, response.text
    events = events_of(response.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    fragments = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(f["type"] == "input_json_delta" for f in fragments)
    assert json.loads("".join(f["partial_json"] for f in fragments)) == ARGUMENTS
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"tool_choice": {"type": "auto"}}, '{"type": "any"}'),
        ({"tool_choice": None}, '{"type": "any"}'),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "server tools"),
        ({"tools": [{**TOOL, "input_schema": {"type": "array"}}]}, "object"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "'tool_use' are not supported in user messages",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "tool_use_id",
        ),
    ],
)
async def test_bad_tools_are_anthropic_400s(stack: Any, change: dict[str, Any], says: str) -> None:
    request = {k: v for k, v in {**body(), **change}.items() if v is not None}
    response = await stack.client.post("/v1/messages", json=request)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert says in response.json()["error"]["message"]
    assert stack.prefill.prefill_requests == []


async def test_none_answers_text(stack: Any) -> None:
    response = await stack.client.post("/v1/messages", json=body(tool_choice={"type": "none"}))
    assert response.status_code == 200, response.text
    assert response.json()["content"] == [{"type": "text", "text": "Hello world!"}]
    assert response.json()["stop_reason"] == "end_turn"


async def test_sdk_create_and_stream_with_a_tool(stack: Any, live_url: str) -> None:
    async with anthropic.AsyncAnthropic(base_url=live_url, api_key="sk-test", max_retries=0) as client:
        named_answer(stack)
        message = await client.messages.create(
            model=MODEL,
            max_tokens=16,
            messages=[{"role": "user", "content": "Wetter in Paris? 🌦"}],
            tools=[TOOL],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "get_weather" and block.input == ARGUMENTS
        required_answer(stack)
        async with client.messages.stream(
            model=MODEL,
            max_tokens=16,
            messages=[{"role": "user", "content": "Wetter in Paris? 🌦"}],
            tools=[TOOL],
            tool_choice={"type": "any"},
        ) as stream:
            final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (streamed,) = final.content
    assert streamed.type == "tool_use" and streamed.name == "get_weather" and streamed.input == ARGUMENTS
