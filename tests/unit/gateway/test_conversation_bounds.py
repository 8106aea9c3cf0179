"""A conversation keeps only what can go into a prompt: turns trimmed away to fit the context are
not stored (once 49.5 KB were kept for a request charged 6 prompt tokens), and stored turns that
no longer fit are forgotten when the conversation moves on."""

from __future__ import annotations

import json
from typing import Any

MODEL = "SmolLM2-135M-Instruct"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _stored(edge: Any, tenant: str, conversation: str) -> list[dict[str, str]]:
    raws = await edge.redis.lrange(f"{edge.key_prefix}:gw:conv:{tenant}:{conversation}", 0, -1)
    return [json.loads(r) for r in raws]


async def test_turns_trimmed_to_fit_the_context_are_not_stored(edge: Any) -> None:
    key = await edge.tenant("acme")
    long_turn = "Ünïcödé 東京 🙂 " * 60  # far more than the test gateway's 64-token context
    body = {
        "model": MODEL,
        "conversation_id": "c1",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": long_turn},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "hi"},
        ],
    }
    response = await edge.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    await edge.settled()
    stored = await _stored(edge, "acme", "c1")
    assert all(m["content"] != long_turn for m in stored), stored
    assert stored[-2] == {"role": "user", "content": "hi"} and stored[-1]["role"] == "assistant"
    assert sum(len(m["content"].encode()) for m in stored) < 500

    # The next turns push the oldest stored ones out once they no longer fit: the list stays bounded.
    for i in range(12):
        turn = {
            "model": MODEL,
            "conversation_id": "c1",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"question {i} about Kyōto"}],
        }
        assert (await edge.client.post("/v1/chat/completions", json=turn, headers=bearer(key))).status_code == 200
        await edge.settled()
    stored = await _stored(edge, "acme", "c1")
    assert stored[-2]["content"] == "question 11 about Kyōto"
    assert len(stored) < 12  # what fits a 64-token context, not every turn ever sent
