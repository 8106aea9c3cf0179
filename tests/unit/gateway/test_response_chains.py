"""Stored responses (``store: true``, the default) and ``previous_response_id`` chains on the gateway with
auth on, real Redis and fake workers: GET returns what create returned, DELETE and cancel, another tenant's
id is 404, ``store: false`` is never readable, the storage account counts and frees the bytes, and each
turn of a chain, sending only its new input, has the previous turn's prompt and answer as an exact prefix
(the same prompt as chat completions given the whole conversation); function calls in a chain."""

from __future__ import annotations

import itertools
import json
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from tandem.common.errors import BackendUnavailableError
from tests.kit.gateway import MODEL
from tests.unit.gateway.test_anthropic_messages import TEXT, events_of
from tests.unit.gateway.test_anthropic_tools import required_answer
from tests.unit.gateway.test_responses import TOOL

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

INSTRUCTIONS = "Sei kurz ✓ 简短"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def create(edge: Any, key: str, **body: Any) -> dict[str, Any]:
    request = {"model": MODEL, "max_output_tokens": 8, **body}
    response = await edge.client.post("/v1/responses", json=request, headers=bearer(key))
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def stored_bytes(edge: Any, tenant_id: str) -> int:
    num_bytes, _ = await edge.app.state.services.conversations.stored(tenant_id)
    return int(num_bytes)


async def test_stored_response_is_read_deleted_and_private(edge: Any) -> None:
    key = await edge.tenant("acme")
    other = await edge.tenant("rival")
    created = await create(edge, key, input=TEXT, instructions=INSTRUCTIONS)
    assert created["store"] is True and created["previous_response_id"] is None
    rid = created["id"]
    got = await edge.client.get(f"/v1/responses/{rid}", headers=bearer(key))
    assert got.status_code == 200 and got.json() == created
    Response.model_validate(got.json())
    assert await stored_bytes(edge, "acme") > len(json.dumps(created))

    for method, path in (("GET", rid), ("DELETE", rid), ("POST", f"{rid}/cancel")):
        refused = await edge.client.request(method, f"/v1/responses/{path}", headers=bearer(other))
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "response_not_found"
    cancel = await edge.client.post(f"/v1/responses/{rid}/cancel", headers=bearer(key))
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    unauthenticated = await edge.client.get(f"/v1/responses/{rid}")
    assert unauthenticated.status_code == 401

    deleted = await edge.client.delete(f"/v1/responses/{rid}", headers=bearer(key))
    assert deleted.status_code == 200 and deleted.json() == {"id": rid, "object": "response", "deleted": True}
    assert (await edge.client.get(f"/v1/responses/{rid}", headers=bearer(key))).status_code == 404
    assert (await edge.client.delete(f"/v1/responses/{rid}", headers=bearer(key))).status_code == 404
    assert await stored_bytes(edge, "acme") == 0

    unstored = await create(edge, key, input=TEXT, store=False)
    assert unstored["store"] is False
    assert (await edge.client.get(f"/v1/responses/{unstored['id']}", headers=bearer(key))).status_code == 404
    followed = await edge.client.post(
        "/v1/responses",
        json={"model": MODEL, "input": "more", "previous_response_id": unstored["id"]},
        headers=bearer(key),
    )
    assert followed.status_code == 404 and followed.json()["error"]["param"] == "previous_response_id"
    assert await stored_bytes(edge, "acme") == 0


async def test_chat_cannot_name_a_stored_response_as_its_conversation(edge: Any) -> None:
    key = await edge.tenant("acme")
    created = await create(edge, key, input=TEXT)
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    refused = await edge.client.post(
        "/v1/chat/completions", json={**chat, "conversation_id": created["id"]}, headers=bearer(key)
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "conversation_id"
    assert "previous_response_id" in refused.json()["error"]["message"]
    got = await edge.client.get(f"/v1/responses/{created['id']}", headers=bearer(key))
    assert got.status_code == 200 and got.json() == created


async def test_streamed_response_is_stored_before_its_last_event(edge: Any) -> None:
    key = await edge.tenant("acme")
    response = await edge.client.post(
        "/v1/responses", json={"model": MODEL, "input": TEXT, "stream": True}, headers=bearer(key)
    )
    assert response.status_code == 200, response.text
    final = events_of(response.text)[-1][1]["response"]
    got = await edge.client.get(f"/v1/responses/{final['id']}", headers=bearer(key))
    assert got.status_code == 200 and got.json() == final


async def test_redis_failing_at_store_time_still_answers(edge: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store is written before the answer's last bytes; when Redis refuses it, the client still gets
    its answer (logged, not stored: a later GET or continuation is 404), never a half-written stream."""
    key = await edge.tenant("acme")
    conversations = edge.app.state.services.conversations

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise BackendUnavailableError("redis at 10.0.0.9:6379 refused the write")

    monkeypatch.setattr(conversations, "append", refuse)
    answer = await create(edge, key, input=TEXT)
    assert answer["status"] == "completed" and answer["output"][0]["content"][0]["text"] == "Hello world!"
    streamed = await edge.client.post(
        "/v1/responses", json={"model": MODEL, "input": TEXT, "stream": True}, headers=bearer(key)
    )
    assert events_of(streamed.text)[-1][0] == "response.completed"
    monkeypatch.undo()
    assert (await edge.client.get(f"/v1/responses/{answer['id']}", headers=bearer(key))).status_code == 404


async def test_chain_turn_extends_the_previous_prompt_exactly(edge: Any) -> None:
    key = await edge.tenant("acme")
    questions = ["première question ☕", "二番目の質問", "third <b>question</b> 🚀"]
    previous_id = None
    prompts: list[list[int]] = []
    for question in questions:
        body: dict[str, Any] = {"input": question, "instructions": INSTRUCTIONS}
        if previous_id is not None:
            body["previous_response_id"] = previous_id
        answer = await create(edge, key, **body)
        assert answer["previous_response_id"] == previous_id
        previous_id = answer["id"]
        prompts.append(list(edge.prefill.prefill_requests[-1].prompt_token_ids))
    for before, after in itertools.pairwise(prompts):
        assert after[: len(before)] == before and len(after) > len(before)
    # The last turn's prompt is chat's for the whole conversation, with the instructions sent again.
    history = [{"role": "system", "content": INSTRUCTIONS}]
    for question in questions[:-1]:
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": "Hello world!"}]
    chat = {"model": MODEL, "max_tokens": 8, "messages": [*history, {"role": "user", "content": questions[-1]}]}
    assert (await edge.client.post("/v1/chat/completions", json=chat, headers=bearer(key))).status_code == 200
    assert list(edge.prefill.prefill_requests[-1].prompt_token_ids) == prompts[-1]


async def test_function_call_chain_sends_only_the_output(edge: Any) -> None:
    key = await edge.tenant("acme")
    required_answer(edge)
    called = await create(edge, key, input="weather in Paris?", tools=[TOOL], tool_choice="required")
    (call,) = called["output"]
    assert call["type"] == "function_call" and call["call_id"].startswith("call_")
    got = await edge.client.get(f"/v1/responses/{called['id']}", headers=bearer(key))
    assert got.json() == called  # the same call ids as the answer had
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sonnig ☀️ 18 °C"}
    await create(edge, key, input=[output], previous_response_id=called["id"], tools=[TOOL], tool_choice="none")
    chained = list(edge.prefill.prefill_requests[-1].prompt_token_ids)
    tool_call = {
        "id": call["call_id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": call["arguments"]},
    }
    chat = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": call["call_id"], "content": "sonnig ☀️ 18 °C"},
        ],
        "tools": [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
        "tool_choice": "none",
    }
    assert (await edge.client.post("/v1/chat/completions", json=chat, headers=bearer(key))).status_code == 200
    assert list(edge.prefill.prefill_requests[-1].prompt_token_ids) == chained


async def test_sdk_retrieve_chain_and_delete(edge: Any, edge_url: str) -> None:
    key = await edge.tenant("acme")
    async with openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0) as client:
        first = await client.responses.create(model=MODEL, input=TEXT, max_output_tokens=8)
        second = await client.responses.create(
            model=MODEL, input="encore ✨", previous_response_id=first.id, max_output_tokens=8
        )
        assert second.previous_response_id == first.id
        retrieved = await client.responses.retrieve(second.id)
        assert retrieved.id == second.id and retrieved.output_text == second.output_text
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        assert (await client.responses.retrieve(second.id)).id == second.id  # its own chain stays whole


async def test_another_gateway_replica_reads_and_continues_a_stored_chain(edge: Any, prompt_tokenizer: Any) -> None:
    """Issue 41: a stored response is readable through any gateway replica and survives a restart, because it
    lives in Redis only. A second app over the same Redis prefix (a replica, or the first one restarted)
    reads what the first stored and continues its chain with the exact prompt prefix."""

    from tests.unit.gateway.conftest import second_replica

    key = await edge.tenant("acme")
    first = await create(edge, key, input="première question ☕", instructions=INSTRUCTIONS)
    first_prompt = list(edge.prefill.prefill_requests[-1].prompt_token_ids)
    async with second_replica(edge, prompt_tokenizer) as client:
        got = await client.get(f"/v1/responses/{first['id']}", headers=bearer(key))
        assert got.status_code == 200 and got.json() == first
        turn = await client.post(
            "/v1/responses",
            json={
                "model": MODEL,
                "max_output_tokens": 8,
                "input": "二番目の質問",
                "previous_response_id": first["id"],
                # Sent again, as clients do: a turn's instructions are its own (not the chain's), and the
                # prompt keeps its prefix only when they are the same.
                "instructions": INSTRUCTIONS,
            },
            headers=bearer(key),
        )
        assert turn.status_code == 200, turn.text
        second_prompt = list(edge.prefill.prefill_requests[-1].prompt_token_ids)
        assert second_prompt[: len(first_prompt)] == first_prompt and len(second_prompt) > len(first_prompt)
    # And back on the first: the replica's turn is there too.
    again = await edge.client.get(f"/v1/responses/{turn.json()['id']}", headers=bearer(key))
    assert again.status_code == 200 and again.json()["previous_response_id"] == first["id"]
