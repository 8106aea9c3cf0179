"""``/v1/responses`` on the real stack with the real ``openai`` SDK: at temperature 0 the answer, created and
streamed, is the chat completions answer to the same conversation through the same gateway (text and token
counts), every streamed event parses into the SDK's types, a function tool with ``tool_choice``
``"required"`` is called as chat calls it, and a ``previous_response_id`` chain sending only new input reads
at least 90 % of the previous context from the cache from turn 2 on; retrieve and delete. The text carries
emoji, CJK, accents and the chat template's own control tokens (which stay text)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.responses import FunctionToolParam, ResponseStreamEvent
from pydantic import TypeAdapter

from tandem.local.stack import LocalStack, StackConfig
from tests.integration.test_anthropic_messages import QUESTION, TOOL_MAX_TOKENS, WEATHER_SCHEMA
from tests.integration.test_anthropic_messages import SYSTEM as INSTRUCTIONS

pytestmark = pytest.mark.integration

MAX_TOKENS = 16
STATUSES = {"stop": "completed", "length": "incomplete"}
EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.config.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def test_openai_sdk_responses_answer_exactly_as_chat_completions(stack: LocalStack) -> None:
    model = stack.config.served_model_name
    client = _client(stack)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    expected = chat.choices[0].message.content
    assert expected and chat.usage is not None
    request = {
        "model": model,
        "instructions": INSTRUCTIONS,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "store": False,
    }
    created = client.responses.create(**request)  # type: ignore[call-overload]
    assert created.id.startswith("resp_") and created.model == model
    assert created.output_text == expected and created.status == STATUSES[chat.choices[0].finish_reason]
    assert created.usage is not None
    assert created.usage.input_tokens == chat.usage.prompt_tokens
    assert created.usage.output_tokens == chat.usage.completion_tokens
    assert created.usage.input_tokens_details.cached_tokens <= created.usage.input_tokens

    events = []
    with client.responses.stream(**request) as stream:  # type: ignore[call-overload]
        for event in stream:
            events.append(event)
    # The SDK's get_final_response() wants response.completed; an answer cut at max_output_tokens ends with
    # response.incomplete (as OpenAI's does), which holds the whole response too.
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    final = last.response
    for event in events:  # every event, as it came, is one of the SDK's event types
        EVENTS.validate_python(event.model_dump(mode="json", exclude_unset=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected and len(deltas) > 1
    assert events[0].type == "response.created" and last.type == f"response.{final.status}"
    assert final.status == created.status
    assert final.output_text == expected and final.id != created.id and final.usage is not None
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert final.usage.output_tokens == chat.usage.completion_tokens


def test_openai_sdk_responses_call_a_required_function(stack: LocalStack) -> None:
    model = stack.config.served_model_name
    client = _client(stack)
    question = "Quel temps fait-il à Paris ? 🌦 パリの天気は？"
    description = "Das Wetter einer Stadt ☀️ 天気"
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        tools=[
            {
                "type": "function",
                "function": {"name": "get_weather", "description": description, "parameters": WEATHER_SCHEMA},
            }
        ],
        tool_choice="required",
        max_tokens=TOOL_MAX_TOKENS,
        temperature=0,
    )
    assert chat.choices[0].message.tool_calls and chat.choices[0].finish_reason == "tool_calls"
    expected = json.loads(chat.choices[0].message.tool_calls[0].function.arguments)  # type: ignore[union-attr]

    tool: FunctionToolParam = {
        "type": "function",
        "name": "get_weather",
        "description": description,
        "parameters": WEATHER_SCHEMA,
        "strict": None,
    }
    response = client.responses.create(
        model=model,
        input=question,
        tools=[tool],
        tool_choice="required",
        max_output_tokens=TOOL_MAX_TOKENS,
        temperature=0,
        store=False,
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == expected and call.call_id.startswith("call_")

    # The result goes back as a function_call_output item; with the tools constraining nothing the model
    # answers in text.
    answer = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": question},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 °C, sonnig ☀️"},
        ],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        store=False,
    )
    assert answer.output[0].type == "message" and answer.output_text


#: Turns of the chain test, as issue 41's proof asks: each turn adds its question (~25 tokens with the
#: chat template's markers) and an answer of at most CHAIN_MAX_TOKENS to a context that starts at ~1,550
#: tokens, so the 20th prompt is ~2,300 tokens, well under the stack's max_model_len (4,096).
NUM_CHAIN_TURNS = 20
CHAIN_MAX_TOKENS = 8
#: An agent's long instructions (~1,500 tokens). The engines cache whole KV blocks only (vLLM's CPU block
#: is 128 tokens), so a turn can read at most the previous context less its last partial block from the
#: cache: 90 % of it needs a context of about 1,350 tokens or more.
AGENT_INSTRUCTIONS = " ".join(
    f"Règle {i}: réponds en une ligne, cite la ville 🏙 et son pays; 规则 {i}: 简短回答; Regel {i}: sei kurz."
    for i in range(26)
)


@pytest.fixture(scope="module")
def chain_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A stack at the router's default handoff threshold (DISAGGREGATION__MIN_UNCACHED_TOKENS, 128 tokens),
    not the session stack's 16, which sends nearly every prompt through the handoff to test that path.

    A chain's previous turn is whole (prompt and answer) only on the decode worker that finished it; a
    prefill worker holds at most the prompts it prefilled. The router hands a turn off only when the
    decode worker's uncached tokens reach the threshold plus those the prefill worker would compute again
    (tandem.router.placement), so at 16 a turn can go to a prefill worker a block behind: on the session
    stack this chain's 15th turn did (1,792 of 2,037 cached, 0.88), three turns after the chain had gone
    local. Moving the decode worker's newer blocks to the prefill worker is not done yet."""
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-it-chain-{uuid.uuid4().hex[:8]}",
        log_dir=Path(tmp_path_factory.mktemp("chain-stack-logs")),
    )
    with LocalStack(config, progress=lambda msg: print(f"[chain stack] {msg}", flush=True)) as stack:
        yield stack


@pytest.mark.timeout(900)  # a stack start of its own (two minutes and more on a loaded host)
def test_openai_sdk_chain_sends_only_new_input_and_hits_the_cache(chain_stack: LocalStack) -> None:
    stack = chain_stack
    model = stack.config.served_model_name
    client = _client(stack)
    previous = None
    for turn in range(NUM_CHAIN_TURNS):
        question = f"Tour {turn + 1}: nomme une ville 🏙 ({'東京' if turn % 2 else 'Zürich'})."
        response = client.responses.create(
            model=model,
            instructions=AGENT_INSTRUCTIONS,
            input=question,
            previous_response_id=previous.id if previous is not None else None,
            max_output_tokens=CHAIN_MAX_TOKENS,
            temperature=0,
        )
        assert response.usage is not None and response.previous_response_id == (previous.id if previous else None)
        # The whole chain fits: nothing was trimmed to make room (which would change the prompt's prefix).
        assert response.usage.input_tokens + CHAIN_MAX_TOKENS <= stack.config.max_model_len
        if previous is not None:
            assert previous.usage is not None
            previous_context = previous.usage.input_tokens + previous.usage.output_tokens
            # The prompt grew by the previous answer and this question only: the chain was read, not resent.
            assert response.usage.input_tokens > previous_context
            cached = response.usage.input_tokens_details.cached_tokens
            print(f"turn {turn + 1}: cached {cached} of the previous context {previous_context}")
            assert cached >= 0.9 * previous_context, (turn + 1, cached, previous_context)
        previous = response
    assert previous is not None
    retrieved = client.responses.retrieve(previous.id)
    assert retrieved.id == previous.id and retrieved.output_text == previous.output_text
    client.responses.delete(previous.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous.id)
