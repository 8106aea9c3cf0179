"""The official ``openai`` SDK against the gateway on a real uvicorn (fake router and workers)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

MODEL = "SmolLM2-135M-Instruct"
MESSAGES: Any = [{"role": "system", "content": "hi"}, {"role": "user", "content": "hello world"}]


async def test_openai_chat_non_stream(stack: Any, live_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{live_url}/v1", api_key="sk-test", max_retries=0) as client:
        completion = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    assert completion.choices[0].message.content == "Hello world!"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (11, 4)
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 2


async def test_openai_chat_stream(stack: Any, live_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{live_url}/v1", api_key="sk-test", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world!"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


async def test_openai_completions_and_models(stack: Any, live_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{live_url}/v1", api_key="sk-test", max_retries=0) as client:
        completion = await client.completions.create(model=MODEL, prompt="one two", max_tokens=4)
        assert completion.choices[0].text == "Hello world!"
        stream = await client.completions.create(model=MODEL, prompt="one two", max_tokens=4, stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == "Hello world!"
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_openai_errors_map_to_sdk_exceptions(stack: Any, live_url: str) -> None:
    from tandem.common.errors import NoCapacityError

    async with openai.AsyncOpenAI(base_url=f"{live_url}/v1", api_key="sk-test", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as not_found:
            await client.chat.completions.create(model="nope", messages=MESSAGES)
        assert not_found.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10_000)
        assert bad.value.code == "context_length_exceeded"
        stack.router.error = NoCapacityError("busy")
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        assert unavailable.value.status_code == 503
