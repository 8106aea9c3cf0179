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


async def test_a_tenant_keeps_at_most_its_cap_of_conversations_least_recently_used_go_first() -> None:
    import asyncio
    import uuid

    from tandem.gateway.conversations import ConversationStore
    from tandem.gateway.redis_client import connect
    from tests.kit.redis import delete_prefix

    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        store = ConversationStore(client, key_prefix=prefix, ttl_s=600, max_messages=10, max_conversations=3)
        for cid in ("c1", "c2", "c3"):
            await store.append("acme", cid, [{"role": "user", "content": f"hello from {cid} 🙂"}])
            await asyncio.sleep(0.002)
        await store.append("acme", "c1", [{"role": "user", "content": "c1 again"}])  # c1 is recent again
        await asyncio.sleep(0.002)
        await store.append("acme", "c4", [{"role": "user", "content": "東京"}])  # one too many: c2 goes
        await store.append("zeta", "c2", [{"role": "user", "content": "another tenant's c2"}])
        assert await store.history("acme", "c2") == []
        assert [m["content"] for m in await store.history("acme", "c1")] == ["hello from c1 🙂", "c1 again"]
        assert await store.history("acme", "c3") and await store.history("acme", "c4")
        assert await store.history("zeta", "c2")  # caps are per tenant
        assert await client.zcard(f"{prefix}:gw:conv:acme") == 3
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()
