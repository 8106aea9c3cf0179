"""Cheap checks before expensive ones: a request whose text is over the limit, or whose tenant has no
stream slot or quota left, is refused before the chat template is rendered or anything is tokenized
(a 4.4 MB request of 2,000 messages once cost ~9 s of gateway CPU, even for a tenant out of quota)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.timeout(120)]

MODEL = "SmolLM2-135M-Instruct"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def huge_chat(num_messages: int = 2000, chars: int = 1000) -> dict[str, Any]:
    text = "Ünïcödé 東京 🙂 and <|im_start|>system text " * (chars // 40)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {text}"} for i in range(num_messages)]
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    """The production body limit (4 MiB) and a 2,048-token context: 128 KiB of text at most; requests
    that hang end after 3 s."""
    return {"max_model_len": 2048, "max_body_bytes": 4 * 1024 * 1024, "request_timeout_s": 3.0}


@pytest.fixture
def tokenizer_calls(edge: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    tokenizer = edge.app.state.services.tokenizer
    for name in ("chat_prompt", "text_prompt_ids"):
        original = getattr(tokenizer, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, counted)
    return calls


async def test_text_over_the_limit_is_refused_before_any_tokenizing_and_costs_little_cpu(
    edge: Any, tokenizer_calls: list[str]
) -> None:
    key = await edge.tenant("acme")
    body = huge_chat()
    size = len(httpx.Request("POST", "http://x", json=body).content)
    limit = edge.app.state.services.limits.max_prompt_bytes
    assert limit < size <= edge.app.state.services.limits.max_body_bytes
    num = 5
    cpu_started = time.process_time()
    for _ in range(num):
        response = await edge.client.post("/v1/chat/completions", json=body, headers=bearer(key))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "request_too_large"
        assert response.json()["error"]["param"] == "messages"
    cpu_per_request_s = (time.process_time() - cpu_started) / num
    print(f"\n{size / 1e6:.1f} MB request refused: {cpu_per_request_s * 1000:.0f} ms of CPU (client and gateway)")
    assert tokenizer_calls == []
    assert edge.router.schedule_calls == []
    # The ceiling: parsing the JSON once, not rendering and tokenizing it (seconds) many times over.
    assert cpu_per_request_s < 0.5


async def test_a_tenant_with_no_stream_slot_is_refused_before_its_prompt_is_built(
    edge: Any, tokenizer_calls: list[str]
) -> None:
    key = await edge.tenant("busy", max_concurrent_streams=1)
    edge.decode.decode_hang_after = 1
    # httpx's ASGI transport returns a response only once the app finished it: the first stream runs in
    # a task of its own, and holds its slot while its decode stream hangs.
    first = asyncio.create_task(
        edge.client.post("/v1/chat/completions", json={**huge_chat(2, 40), "stream": True}, headers=bearer(key))
    )
    for _ in range(500):
        if edge.decode.decode_requests:
            break
        await asyncio.sleep(0.01)
    assert edge.decode.decode_requests, "the first request never reached its decode worker"
    calls_for_the_first = len(tokenizer_calls)
    blocked = await edge.client.post("/v1/chat/completions", json=huge_chat(200, 400), headers=bearer(key))
    assert blocked.status_code == 429, blocked.text
    assert blocked.headers["retry-after"] == "1"
    assert blocked.headers["x-ratelimit-remaining-streams"] == "0"
    assert len(tokenizer_calls) == calls_for_the_first  # the second prompt was never built
    assert (await first).status_code == 200  # its stream ends with an error event at the request timeout
    edge.decode.decode_hang_after = None
    await edge.settled()


async def test_a_tenant_out_of_input_quota_is_refused_from_the_texts_size_alone(
    edge: Any, tokenizer_calls: list[str]
) -> None:
    key = await edge.tenant("thrifty", input_tokens_per_minute=100)
    body = huge_chat(20, 400)  # ~8,000+ bytes: at least 125 tokens at any tokenizer's 64 bytes a token
    response = await edge.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 429, response.text
    assert tokenizer_calls == []
