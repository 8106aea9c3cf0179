"""``POST /v1/responses`` (OpenAI Responses, ``store: false``; stored ones: test_response_chains.py) on the
gateway with fake router and workers: the translation into the chat request (same prompt tokens and
sampling as ``/v1/chat/completions``), the response object and its typed stream events as the ``openai``
SDK's types parse them, function tools, errors in OpenAI's shape, and the real ``openai`` SDK against a
real uvicorn."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tandem.common.errors import NoCapacityError
from tests.kit.gateway import MODEL
from tests.unit.gateway.test_anthropic_messages import HOSTILE, SYSTEM, TEXT, events_of
from tests.unit.gateway.test_anthropic_messages import chat_body as anthropic_chat_body
from tests.unit.gateway.test_anthropic_tools import named_answer, required_answer, script

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Wetter für eine Stadt ☀️", "parameters": SCHEMA}


def responses_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "store": False,
        "instructions": SYSTEM,
        "input": [
            {"role": "user", "content": "hello world"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": TEXT}, {"type": "input_text", "text": " café"}],
            },
        ],
        "max_output_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"k": "v"},
    }
    body.update(overrides)
    return body


def chat_body(**overrides: Any) -> dict[str, Any]:
    """The same conversation and sampling as :func:`responses_body`, in chat completions' words (the
    Anthropic test's, without the sampling fields this API has not)."""
    body = {k: v for k, v in anthropic_chat_body().items() if k not in ("top_k", "stop")}
    body.update(overrides)
    return body


async def same_prefill_as_chat(stack: Any, response_body: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """Posts both; asserts they reach the prefill worker as the same prompt and sampling; the response's JSON."""
    response = await stack.client.post("/v1/responses", json=response_body)
    assert response.status_code == 200, response.text
    ours = stack.prefill.prefill_requests[-1]
    answer = await stack.client.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text
    theirs = stack.prefill.prefill_requests[-1]
    assert list(ours.prompt_token_ids) == list(theirs.prompt_token_ids)
    assert ours.sampling == theirs.sampling
    result: dict[str, Any] = response.json()
    return result


async def test_response_translates_exactly_into_the_chat_request(stack: Any) -> None:
    response = await same_prefill_as_chat(stack, responses_body(), chat_body())
    prefill = stack.prefill.prefill_requests[-2]
    # <|im_start|> (id 1) opens the template's four turns (system, user, assistant, user) and the answer's.
    assert list(prefill.prompt_token_ids).count(1) == 5
    num_prompt_tokens = len(prefill.prompt_token_ids)
    Response.model_validate(response)  # every field the SDK's type requires, typed as it wants
    rid = response["id"]
    assert rid.startswith("resp_") and prefill.request_id == rid
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["incomplete_details"] is None and response["error"] is None
    assert response["model"] == MODEL and isinstance(response["created_at"], int)
    assert response["output"] == [
        {
            "id": "msg_" + rid.removeprefix("resp_"),
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello world!", "annotations": [], "logprobs": []}],
        }
    ]
    assert response["usage"] == {
        "input_tokens": num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt_tokens + 4,
    }
    assert (response["temperature"], response["top_p"], response["max_output_tokens"]) == (0.5, 0.9, 8)
    assert response["store"] is False and response["tools"] == [] and response["text"] == {"format": {"type": "text"}}
    assert response["instructions"] == SYSTEM  # repeated as sent, as OpenAI's API does


async def test_string_input_and_developer_role(stack: Any) -> None:
    await same_prefill_as_chat(
        stack,
        {"model": MODEL, "store": False, "input": TEXT, "max_output_tokens": 8},
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": TEXT}]},
    )
    developer = {"role": "developer", "content": [{"type": "input_text", "text": "sei kurz ✓"}]}
    await same_prefill_as_chat(
        stack,
        responses_body(instructions=None, input=[developer, {"role": "user", "content": TEXT}]),
        chat_body(messages=[{"role": "developer", "content": "sei kurz ✓"}, {"role": "user", "content": TEXT}]),
    )


async def test_text_format_json_schema_is_chat_structured_output(stack: Any) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    response = await same_prefill_as_chat(
        stack,
        responses_body(text={"format": fmt}),
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}),
    )
    constrained = stack.prefill.prefill_requests[-1].sampling
    assert (await stack.client.post("/v1/responses", json=responses_body())).status_code == 200
    assert constrained != stack.prefill.prefill_requests[-1].sampling
    assert response["text"] == {"format": fmt}


@pytest.mark.parametrize("where", ["instructions", "input"])
async def test_control_tokens_in_text_are_refused_as_on_chat(stack: Any, where: str) -> None:
    # The unit stack's tokenizer cannot keep the template's control tokens as text, so chat refuses them on
    # every endpoint; the real model keeps them text (tests/integration/test_responses.py).
    body = responses_body(**{where: HOSTILE})
    response = await stack.client.post("/v1/responses", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == "messages: message content may not contain the model's control tokens."
    assert stack.prefill.prefill_requests == []


async def test_tenant_prompt_policy_applies_to_instructions(edge: Any) -> None:
    key = await edge.tenant("strict", system_prompt="you are one ✓", allow_client_system_prompt=False)
    headers = {"authorization": f"Bearer {key}"}
    for body in (responses_body(), responses_body(instructions=None, input=[{"role": "developer", "content": "x"}])):
        refused = await edge.client.post("/v1/responses", json=body, headers=headers)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "system_message_not_allowed"
    assert edge.prefill.prefill_requests == []
    allowed = await edge.client.post("/v1/responses", json=responses_body(instructions=None), headers=headers)
    assert allowed.status_code == 200, allowed.text
    chat = chat_body(messages=chat_body()["messages"][1:])
    assert (await edge.client.post("/v1/chat/completions", json=chat, headers=headers)).status_code == 200
    ours, theirs = edge.prefill.prefill_requests
    assert list(ours.prompt_token_ids) == list(theirs.prompt_token_ids)  # the tenant's system prompt in both


async def test_answer_cut_at_max_output_tokens_is_incomplete(stack: Any) -> None:
    response = await stack.client.post("/v1/responses", json=responses_body(max_output_tokens=1))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["usage"]["output_tokens"] == 1 and answer["output"][0]["status"] == "incomplete"
    Response.model_validate(answer)


async def test_stream_has_typed_events_with_sequence_numbers(stack: Any) -> None:
    response = await stack.client.post("/v1/responses", json=responses_body(stream=True))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response.text)
    for name, data in events:
        assert data["type"] == name
        EVENTS.validate_python(data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert names[:4] == head and names[-4:] == [*tail, "response.completed"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert "".join(data["delta"] for name, data in events if name == "response.output_text.delta") == "Hello world!"
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["id"] == created["id"]
    assert created["instructions"] == final["instructions"] == SYSTEM
    assert final["output"][0]["content"][0]["text"] == "Hello world!"
    num_prompt_tokens = len(stack.prefill.prefill_requests[-1].prompt_token_ids)
    assert final["usage"]["input_tokens"] == num_prompt_tokens and final["usage"]["output_tokens"] == 4
    whole = await stack.client.post("/v1/responses", json=responses_body())
    assert whole.json()["output"][0]["content"] == final["output"][0]["content"]


async def test_stream_cut_ends_incomplete(stack: Any) -> None:
    response = await stack.client.post("/v1/responses", json=responses_body(stream=True, max_output_tokens=1))
    events = events_of(response.text)
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    EVENTS.validate_python(events[-1][1])


async def test_error_after_the_stream_began_is_response_failed(stack: Any) -> None:
    stack.decode.decode_fail_after = 1
    response = await stack.client.post("/v1/responses", json=responses_body(stream=True))
    assert response.status_code == 200
    events = events_of(response.text)
    for _, data in events:
        EVENTS.validate_python(data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"]["code"] == "server_error"
    assert "scripted" not in response.text and "127.0.0.1" not in response.text  # no internal detail leaks
    assert "response.completed" not in [n for n, _ in events]


async def test_no_capacity_before_the_stream_is_a_503_in_openai_shape(stack: Any) -> None:
    stack.router.error = NoCapacityError("no decode worker at 10.1.2.3:50051", retry_after_s=2.0)
    response = await stack.client.post("/v1/responses", json=responses_body(stream=True))
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["code"] == "no_capacity" and "10.1.2.3" not in response.text


# --- function tools ------------------------------------------------------------------------------------


def tool_history() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "weather in Lyon?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny ☀️"},
        {"role": "user", "content": "and Paris?"},
    ]


def chat_tool_history() -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
    return [
        {"role": "user", "content": "weather in Lyon?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny ☀️"},
        {"role": "user", "content": "and Paris?"},
    ]


async def test_named_function_call(stack: Any) -> None:
    named_answer(stack)
    choice = {"type": "function", "name": "get_weather"}
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    response = await stack.client.post(
        "/v1/responses", json=responses_body(input=tool_history(), tools=[TOOL], tool_choice=choice, instructions=None)
    )
    assert response.status_code == 200, response.text
    ours = stack.prefill.prefill_requests[-1]
    named_answer(stack)
    chat = chat_body(
        messages=chat_tool_history(),
        tools=[chat_tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert (await stack.client.post("/v1/chat/completions", json=chat)).status_code == 200
    theirs = stack.prefill.prefill_requests[-1]
    assert list(ours.prompt_token_ids) == list(theirs.prompt_token_ids) and ours.sampling == theirs.sampling
    answer = response.json()
    Response.model_validate(answer)
    (item,) = answer["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["status"] == "completed"
    assert json.loads(item["arguments"]) == {"city": "Paris 🗼"}
    assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
    assert answer["tool_choice"] == choice and answer["tools"][0]["name"] == "get_weather"


async def test_required_function_call_streams_argument_deltas(stack: Any) -> None:
    required_answer(stack)
    body = responses_body(input="weather in Paris?", tools=[TOOL], tool_choice="required", stream=True)
    response = await stack.client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    events = events_of(response.text)
    for _, data in events:
        EVENTS.validate_python(data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(names[3:-3]) == {"response.function_call_arguments.delta"}
    fragments = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    assert json.loads(fragments) == {"city": "Paris 🗼"} == json.loads(events[-3][1]["arguments"])
    added = events[2][1]["item"]
    done = events[-2][1]["item"]
    assert added["arguments"] == "" and added["call_id"] == done["call_id"] and done["status"] == "completed"
    assert events[-1][1]["response"]["output"] == [done]


async def test_answer_without_a_call_is_a_message(stack: Any) -> None:
    script(stack, ["   ", "  "])
    body = responses_body(input="weather?", tools=[TOOL], tool_choice="required")
    answer = (await stack.client.post("/v1/responses", json=body)).json()
    assert answer["output"][0]["type"] == "message"
    Response.model_validate(answer)


# --- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "status", "param", "says"),
    [
        ({"store": "yes"}, 400, "store", "store"),
        ({"previous_response_id": "resp_1"}, 404, "previous_response_id", "'resp_1' not found"),
        ({"previous_response_id": "../x"}, 404, "previous_response_id", "not found"),
        ({"background": True}, 400, "background", "background can only be used when `store` is true"),
        ({"background": "yes", "store": True}, 400, "background", "background"),
        ({"reasoning": {"effort": "high"}}, 400, "reasoning.effort", "does not reason"),
        ({"include": ["message.output_text.logprobs"]}, 400, "include", "include"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type", "built-in tools"),
        ({"tools": [TOOL]}, 400, "tool_choice", '"required"'),
        ({"tool_choice": "required"}, 400, "tool_choice", "tool_choice"),
        ({"input": []}, 400, "input", "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input.0.content.0.type",
            "'input_image' are not supported",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input.0.type", "'reasoning'"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input.0.call_id", "call_id"),
        ({"temperature": 2.5}, 400, "temperature", "temperature"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema", "schema"),
        ({"model": "nope"}, 404, "model", "nope"),
    ],
)
async def test_bad_input_is_a_clear_400(
    stack: Any, change: dict[str, Any], status: int, param: str | None, says: str
) -> None:
    body = responses_body(**change)
    response = await stack.client.post("/v1/responses", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert says in error["message"]
    if param is not None:
        assert error["param"] == param
    assert stack.prefill.prefill_requests == []


async def test_openapi_document_describes_responses(stack: Any) -> None:
    document = (await stack.client.get("/openapi.json")).json()
    schema_ref = document["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema_ref == {"$ref": "#/components/schemas/ResponsesRequest"}
    properties = document["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"model", "input", "instructions", "max_output_tokens", "tools", "tool_choice", "store"} <= set(properties)


# --- the real openai SDK on a real uvicorn -------------------------------------------------------------


async def test_sdk_create_and_stream(stack: Any, live_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{live_url}/v1", api_key="sk-test", max_retries=0) as client:
        created = await client.responses.create(
            model=MODEL, input=TEXT, instructions=SYSTEM, max_output_tokens=8, store=False
        )
        assert created.output_text == "Hello world!" and created.status == "completed"
        assert created.usage is not None and created.usage.output_tokens == 4
        seen = []
        async with client.responses.stream(model=MODEL, input=TEXT, max_output_tokens=8, store=False) as stream:
            async for event in stream:
                seen.append(event.type)
            final = await stream.get_final_response()
        assert final.output_text == "Hello world!" and seen[-1] == "response.completed"
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.create(model=MODEL, input=TEXT, store=False, background=True)
        assert raised.value.body is not None and raised.value.param == "background"
