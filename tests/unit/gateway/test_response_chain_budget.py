"""A stored response's chain and the tenant's storage byte budget (gateway with auth on, real Redis, fake
workers): the budget check before any token counts the response object too (its echoed ``instructions``
and tools), so a response that could not be stored whole is refused with 413 rather than answered and
then stored without its oldest turns; and an answer longer than the admission's estimate, which can
only be found once it is generated, makes the chain forget its oldest turns in whole exchanges (the
kept chain starts with a user turn), counted in ``tandem_gateway_stored_turns_forgotten_total``."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tandem.gateway.api.response_chains import history_of, read_response
from tests.kit.gateway import MODEL
from tests.unit.gateway.test_response_chains import bearer, create, stored_bytes

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

#: ~2,400 bytes of instructions, which every stored response repeats in its object.
LONG_INSTRUCTIONS = 'Règle ✓: réponds brièvement, 简短回答, <b>"quoted"</b> 🚀. ' * 40


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    """A context that holds the long instructions and a chain of ~600-byte turns."""
    return {"max_model_len": 2048}


async def forgotten(edge: Any) -> float:
    text = (await edge.client.get("/metrics")).text
    found = re.search(r'^tandem_gateway_stored_turns_forgotten_total\{store="response"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_a_response_whose_object_would_be_over_the_budget_is_refused_before_any_token(edge: Any) -> None:
    """The turns of this chain are ~200 bytes; its object, repeating the instructions, ~3,500."""
    key = await edge.tenant("small", max_stored_bytes=2000)
    num_prefills = len(edge.prefill.prefill_requests)
    for stream in (False, True):
        refused = await edge.client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "Bonjour ☕ 你好", "instructions": LONG_INSTRUCTIONS, "stream": stream},
            headers=bearer(key),
        )
        assert refused.status_code == 413, refused.text
        assert refused.headers["content-type"].startswith("application/json")  # before any event
        error = refused.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "storage_quota_exceeded",
            "store",
            "invalid_request_error",
        )
        assert "2000 bytes" in error["message"]
    await edge.settled()
    assert len(edge.prefill.prefill_requests) == num_prefills  # nothing generated
    assert await stored_bytes(edge, "small") == 0
    # Not stored, it fits: the budget is for what is kept.
    unstored = await create(edge, key, input="Bonjour ☕ 你好", instructions=LONG_INSTRUCTIONS, store=False)
    assert unstored["instructions"] == LONG_INSTRUCTIONS


async def test_an_answer_longer_than_its_estimate_forgets_whole_exchanges_and_is_counted(edge: Any) -> None:
    limit_bytes = 8000
    key = await edge.tenant("tight", max_stored_bytes=limit_bytes)
    inputs = [f"Tour {k} ✓ " + "é东" * 120 for k in range(8)]  # ~600 bytes each
    previous_id = None
    for text in inputs[:6]:
        answer = await create(edge, key, input=text, previous_response_id=previous_id)
        previous_id = answer["id"]
    before = await forgotten(edge)
    # One token of ~2,000 bytes: the admission estimated 4 bytes a token of max_output_tokens (8), in the
    # answer's turn and again in the response object.
    edge.prefill.first_text = "ü" * 1000
    long = await create(edge, key, input=inputs[6], previous_response_id=previous_id)
    assert long["output"][0]["content"][0]["text"].startswith("ü" * 1000)
    await edge.settled()
    num_forgotten = await forgotten(edge) - before
    assert num_forgotten >= 2 and num_forgotten % 2 == 0  # whole exchanges: a question and its answer
    assert await stored_bytes(edge, "tight") <= limit_bytes

    store = edge.app.state.services.conversations
    turns = history_of(await read_response(store, "tight", long["id"]))
    kept = int(num_forgotten) // 2
    assert turns[0] == {"role": "user", "content": inputs[kept]}  # a contiguous suffix, from a question
    assert [t["content"] for t in turns[::2]] == inputs[kept:7]
    assert all(t["role"] == "assistant" for t in turns[1::2])
    assert turns[-1]["content"] == long["output"][0]["content"][0]["text"]

    # The chain goes on from what was kept.
    edge.prefill.first_text = "Hello"
    after = await create(edge, key, input=inputs[7], previous_response_id=long["id"])
    assert after["previous_response_id"] == long["id"]
    turns = history_of(await read_response(store, "tight", after["id"]))
    assert [t["content"] for t in turns[::2]] == inputs[kept:8]
