"""``tool_choice: "auto"`` on a model with a tool chat template (the gateway's default: Tandem's for the
default model), with the fake workers: the prompt is rendered with that template and nothing constrains the
answer; the answer's text and ``<tool_call>`` blocks come back as content and calls on
``/v1/chat/completions`` (whole, and streamed through the real ``openai`` SDK), ``/v1/responses`` (items
and typed events validated into the SDK's types) and ``/v1/messages`` (the real ``anthropic`` SDK)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.settings import LLAMA31_JSON_TOOL_TEMPLATE, SMOLLM2_TOOL_TEMPLATE
from tests.kit.gateway import MODEL, DecodeStep, FakeRouter
from tests.kit.net import serving
from tests.unit.gateway.conftest import Stack, gateway_settings, running_stack

pytestmark = [pytest.mark.timeout(30)]  # asyncio_mode is auto

USER: Any = [{"role": "user", "content": "Wetter in Zürich? 東京?"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter für eine Stadt ☀️",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ARGUMENTS = {"city": 'Zürich 東京 "q" \\ 🦜'}
CALL_TEXT = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGUMENTS}, ensure_ascii=False)
TEXT_AND_CALL = "Ich schaue nach.\n" + CALL_TEXT + "\n</tool_call>"


@pytest_asyncio.fixture
async def stack(
    start_worker: Callable[..., Any], fake_router: FakeRouter, prompt_tokenizer: HfPromptTokenizer
) -> AsyncIterator[Stack]:
    """The unit stack, its model served with Tandem's tool chat template (``conftest.stack`` has none)."""
    tool_tokenizer = prompt_tokenizer.with_chat_template(SMOLLM2_TOOL_TEMPLATE.read_text(encoding="utf-8"))
    async with running_stack(
        start_worker,
        fake_router,
        prompt_tokenizer,
        gateway_settings(max_model_len=2048),  # the tools' text is long in the test tokenizer's <unk>s
        tool_tokenizers={MODEL: tool_tokenizer},
    ) as unit_stack:
        yield unit_stack


def script(stack: Stack, text: str, finish: str = "stop") -> None:
    """The workers generate ``text``, a few characters per step (cuts fall inside the tags and the JSON)."""
    stack.prefill.first_text = text[0]
    rest = text[1:]
    pieces = [rest[i : i + 4] for i in range(0, len(rest), 4)]
    stack.decode.decode_steps = [DecodeStep(piece, [110 + i]) for i, piece in enumerate(pieces)]
    stack.decode.decode_steps[-1].finish_reason = finish


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 16, "tools": [WEATHER], **fields}


async def test_auto_renders_the_tool_template_and_constrains_nothing(stack: Stack) -> None:
    script(stack, "Sonnig.")
    plain = await stack.client.post("/v1/chat/completions", json={**chat(), "tools": None})
    assert plain.status_code == 200, plain.text
    response = await stack.client.post("/v1/chat/completions", json=chat())  # auto by default
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Sonnig."} and choice["finish_reason"] == "stop"
    without, with_tools = stack.prefill.prefill_requests
    assert not with_tools.sampling.HasField("structured_output")
    # The tools are in the prompt (the test tokenizer's words are few: the template's text is mostly <unk>).
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids) + 20


async def test_a_call_and_its_text_come_back_whole(stack: Stack) -> None:
    script(stack, TEXT_AND_CALL)
    response = await stack.client.post("/v1/chat/completions", json=chat(tool_choice="auto"))
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Ich schaue nach.\n"
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS


async def test_a_block_for_no_declared_tool_stays_text(stack: Stack) -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
    script(stack, text)
    response = await stack.client.post("/v1/chat/completions", json=chat())
    (choice,) = response.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"


async def test_the_stream_through_the_openai_sdk_equals_the_whole_answer(stack: Stack, live_url: str) -> None:
    script(stack, TEXT_AND_CALL)
    async with openai.AsyncOpenAI(base_url=f"{live_url}/v1", api_key="sk-test", max_retries=0) as client:
        completion = await client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=16)
        async with client.chat.completions.stream(
            model=MODEL, messages=USER, tools=[WEATHER], tool_choice="auto", max_tokens=16
        ) as stream:
            chunks = [event.chunk async for event in stream if event.type == "chunk"]
            streamed = await stream.get_final_completion()
    whole, again = completion.choices[0], streamed.choices[0]
    assert (again.finish_reason, again.message.content) == (whole.finish_reason, whole.message.content)
    assert whole.message.tool_calls is not None and again.message.tool_calls is not None
    assert [(c.function.name, c.function.arguments) for c in again.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    # The text streamed as content before the call was whole; the call came as OpenAI's deltas.
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[:first_call]) == "Ich schaue nach.\n"
    first, arguments = deltas[first_call].tool_calls or []
    assert (first.index, first.type, first.function and first.function.name) == (0, "function", "get_weather")
    assert first.function is not None and first.function.arguments == ""
    assert arguments.function is not None and json.loads(arguments.function.arguments or "") == ARGUMENTS


async def test_responses_auto_answers_a_message_and_a_function_call(stack: Stack) -> None:
    script(stack, TEXT_AND_CALL)
    tool = {"type": "function", **WEATHER["function"]}
    body = {"model": MODEL, "input": "Wetter?", "tools": [tool], "tool_choice": "auto", "store": False}
    response = await stack.client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    answer = Response.model_validate(response.json())
    message, call = answer.output
    assert message.type == "message" and message.content[0].type == "output_text"
    assert message.content[0].text == "Ich schaue nach.\n"
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == ARGUMENTS
    assert answer.status == "completed"
    # Streamed: every event is one of the SDK's types, in order, and the last one holds the same answer.
    async with stack.client.stream("POST", "/v1/responses", json={**body, "stream": True}) as streamed:
        lines = [line[6:] async for line in streamed.aiter_lines() if line.startswith("data: ")]
    events = [TypeAdapter(ResponseStreamEvent).validate_json(line) for line in lines]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events if e.type.startswith("response.output_item")] == [
        "response.output_item.added",
        "response.output_item.done",
        "response.output_item.added",
        "response.output_item.done",
    ]
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.model_dump(exclude={"id", "call_id"}) for item in final.response.output] == [
        item.model_dump(exclude={"id", "call_id"}) for item in answer.output
    ]


async def test_messages_auto_answers_text_and_tool_use(stack: Stack, live_url: str) -> None:
    script(stack, TEXT_AND_CALL)
    tool: Any = {"name": "get_weather", "description": "Wetter ☀️", "input_schema": WEATHER["function"]["parameters"]}
    async with anthropic.AsyncAnthropic(base_url=live_url, api_key="sk-test", max_retries=0) as client:
        answer = await client.messages.create(
            model=MODEL, max_tokens=16, messages=USER, tools=[tool], tool_choice={"type": "auto"}
        )
        async with client.messages.stream(model=MODEL, max_tokens=16, messages=USER, tools=[tool]) as stream:
            streamed = await stream.get_final_message()
    assert answer.stop_reason == "tool_use" and streamed.stop_reason == "tool_use"
    for message in (answer, streamed):
        text, tool_use = message.content
        assert text.type == "text" and text.text == "Ich schaue nach.\n"
        assert tool_use.type == "tool_use" and tool_use.name == "get_weather" and tool_use.input == ARGUMENTS


# -- a model whose tool chat template is the Llama 3.1 JSON one --------------------------------------------------

LLAMA_CALL = json.dumps({"name": "get_weather", "parameters": ARGUMENTS}, ensure_ascii=False)


@pytest_asyncio.fixture
async def llama_stack(
    start_worker: Callable[..., Any], fake_router: FakeRouter, prompt_tokenizer: HfPromptTokenizer
) -> AsyncIterator[Stack]:
    """The unit stack's model named with the ``llama3.1-json`` template (SIMULATED: the test tokenizer renders
    it; no Llama tokenizer is here): its answers are read in the Llama JSON form, not the Hermes one."""
    settings = gateway_settings(max_model_len=2048, tool_chat_template="llama3.1-json")
    (model,) = settings.models
    assert model.tool_call_format == "llama3_json"
    tool_tokenizer = prompt_tokenizer.with_chat_template(LLAMA31_JSON_TOOL_TEMPLATE.read_text(encoding="utf-8"))
    async with running_stack(
        start_worker, fake_router, prompt_tokenizer, settings, tool_tokenizers={MODEL: tool_tokenizer}
    ) as unit_stack:
        yield unit_stack


async def test_a_llama_models_json_call_comes_back_whole_and_streamed(llama_stack: Stack) -> None:
    script(llama_stack, LLAMA_CALL)
    response = await llama_stack.client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS
    async with (
        serving(llama_stack.app) as port,
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-test", max_retries=0) as client,
        client.chat.completions.stream(
            model=MODEL, messages=USER, tools=[WEATHER], tool_choice="auto", max_tokens=16
        ) as stream,
    ):
        streamed = await stream.get_final_completion()
    (again,) = streamed.choices
    assert again.finish_reason == "tool_calls" and again.message.tool_calls is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in again.message.tool_calls] == [
        ("get_weather", ARGUMENTS)
    ]


async def test_a_llama_model_reads_a_hermes_block_as_text(llama_stack: Stack) -> None:
    script(llama_stack, TEXT_AND_CALL)
    response = await llama_stack.client.post("/v1/chat/completions", json=chat())
    (choice,) = response.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": TEXT_AND_CALL} and choice["finish_reason"] == "stop"


# -- a model whose tool chat template is a file of its own, written for the Llama JSON form ----------------------


def custom_llama_template(folder: Path) -> Path:
    """A tool chat template that is no shipped one: the Llama 3.1 JSON template with its own system text."""
    path = folder / "mein_werkzeug_template.jinja"
    text = LLAMA31_JSON_TOOL_TEMPLATE.read_text(encoding="utf-8")
    assert "Environment: ipython" in text
    path.write_text(text.replace("Environment: ipython", "Environment: ipython · Werkzeuge 🛠"), encoding="utf-8")
    return path


@pytest.mark.parametrize(("call_format", "reads_a_call"), [("llama3_json", True), (None, False)])
async def test_a_custom_template_is_read_in_the_call_format_it_is_given(
    start_worker: Callable[..., Any],
    fake_router: FakeRouter,
    prompt_tokenizer: HfPromptTokenizer,
    tmp_path: Path,
    call_format: str | None,
    reads_a_call: bool,
) -> None:
    """A template file's calls are read in the format ``tool_call_parser`` names (the chart's ``toolCallParser``): given
    ``llama3_json``, the Llama JSON answer is a call; unset, a file is Hermes-style and the same answer text."""
    template = custom_llama_template(tmp_path)
    fields = {} if call_format is None else {"tool_call_parser": call_format}
    settings = gateway_settings(max_model_len=2048, tool_chat_template=str(template), **fields)
    (model,) = settings.models
    assert (model.tool_chat_template, model.tool_call_format) == (template, call_format or "hermes")
    tool_tokenizer = prompt_tokenizer.with_chat_template(template.read_text(encoding="utf-8"))
    async with running_stack(
        start_worker, fake_router, prompt_tokenizer, settings, tool_tokenizers={MODEL: tool_tokenizer}
    ) as custom:
        script(custom, LLAMA_CALL)
        response = await custom.client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    if not reads_a_call:
        assert choice["message"] == {"role": "assistant", "content": LLAMA_CALL} and choice["finish_reason"] == "stop"
        return
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS
