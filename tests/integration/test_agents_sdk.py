"""The ``openai-agents`` SDK runs an agent with one function tool against Tandem, on the real stack (real
vLLM engines, router, gateway): through the Responses API (``OpenAIResponsesModel``) and through chat
completions (``OpenAIChatCompletionsModel``). Tool use is forced through the agent's model settings
(``tool_choice="required"``); the tool is called with arguments that match its schema; its result goes back
to the model in a second call, which the SDK sends with the tools and ``tool_choice`` reset to ``auto``
(served by the default model's tool chat template); and the agent finishes with a final text output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from agents import (
    Agent,
    FunctionTool,
    MessageOutputItem,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)

from tandem.local.stack import LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

#: Model calls the agent may make before it must have answered.
MAX_TURNS = 6
#: Where the tool's result is easy to find again in what the SDK sends back.
FORECAST = "Sonnig, 22 °C ☀️ 晴れ"


@pytest.fixture(autouse=True)
def _no_tracing() -> Iterator[None]:
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    yield
    set_tracing_disabled(False)


def _agent(model: Model) -> tuple[Agent[Any], list[dict[str, Any]], FunctionTool]:
    received: list[dict[str, Any]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather forecast for a city.

        Args:
            city: The city's name.
        """
        received.append({"city": city})
        return f"{FORECAST} in {city}"

    agent = Agent(
        name="Wetterfrosch 🐸",
        instructions="You answer questions about the weather. Use the get_weather tool, then answer briefly.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200),
    )
    return agent, received, get_weather


def _client(stack: LocalStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{stack.config.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=300
    )


async def _run_and_check(agent: Agent[Any], received: list[dict[str, Any]], tool: FunctionTool) -> None:
    assert agent.reset_tool_choice  # the SDK's default: the call after a tool call is tool_choice "auto"
    result = await Runner.run(agent, "What is the weather in Zürich today?", max_turns=MAX_TURNS)
    # The tool was called, each time with arguments that match its schema, and each result went back. The
    # first model call must call it (one call: parallel_tool_calls false); the next ones are sent with
    # tool_choice "auto", where the model may call again before it answers.
    assert received, "the tool was never called"
    for arguments in received:
        jsonschema.validate(arguments, tool.params_json_schema)
    calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert len(calls) == len(outputs) == len(received)
    assert all(FORECAST in str(output.output) for output in outputs)
    first, *later = result.raw_responses
    assert [item.type for item in first.output] == ["function_call"]
    # At least one call after the tool's result went back, the last one answering in text alone.
    assert later and [item.type for item in later[-1].output] == ["message"]
    assert isinstance(result.new_items[-1], MessageOutputItem)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    print(f"agent: {len(result.raw_responses)} model calls, tool calls {received}, answer {result.final_output!r}")


async def test_an_agent_calls_its_tool_and_finishes_through_the_responses_api(stack: LocalStack) -> None:
    async with _client(stack) as client:
        model = OpenAIResponsesModel(model=stack.config.served_model_name, openai_client=client)
        agent, received, tool = _agent(model)
        await _run_and_check(agent, received, tool)


async def test_an_agent_calls_its_tool_and_finishes_through_chat_completions(stack: LocalStack) -> None:
    async with _client(stack) as client:
        model = OpenAIChatCompletionsModel(model=stack.config.served_model_name, openai_client=client)
        agent, received, tool = _agent(model)
        await _run_and_check(agent, received, tool)
