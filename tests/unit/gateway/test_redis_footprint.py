"""What the gateway leaves in Redis per request and per conversation turn, under load: 10,000 requests
of 10 tenants with quotas (concurrently, 32 at a time) through the real app and the real Redis
(workers and router are the unit tests' fakes: they store nothing in Redis), measured with Redis's
own ``MEMORY USAGE`` of every key of the run.

Ceilings (docs/tenancy.md, "Retention"):

* per request, with no conversation: ``BYTES_PER_REQUEST_CEILING``. What stays is the request id's
  "usage recorded" marker (1 h, so that a retried record is not counted twice); quota markers, stream
  slots and open usage records are gone once the request settled. Before issue 14 a request left a
  ~150-byte marker for 24 h.
* per conversation turn: ``BYTES_PER_TURN_CEILING`` plus the turn's own text, and a conversation
  never holds more than what fits the context (test_conversation_bounds.py).

Prints ``redis-footprint: …`` for the closing note.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 10_000
NUM_TENANTS = 10
CONCURRENCY = 32
NUM_CONVERSATION_TURNS = 1_000
BYTES_PER_REQUEST_CEILING = 160
#: Overhead of a stored turn beyond its text (JSON framing, list entry, the tenant's index).
BYTES_PER_TURN_CEILING = 120

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    """This test measures bytes, not latency: 32 requests at once on a loaded 2-core CI host can stall
    a Redis round trip past the request path's 0.5 s deadline (one CI run failed so, once), which
    would fail a request and measure nothing."""
    return {"tenancy": {"redis_timeout_s": 5.0}}


async def _footprint_bytes(edge: Any) -> int:
    total = 0
    async for key in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:*", count=1000):
        if key.startswith(f"{edge.key_prefix}:gw:tenant") or key.startswith(f"{edge.key_prefix}:gw:key"):
            continue  # tenants and keys: made before the run, not by requests
        total += int(await edge.redis.memory_usage(key, samples=0) or 0)
    return total


async def _run(edge: Any, bodies: list[tuple[str, dict[str, Any]]]) -> None:
    queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)

    async def client() -> None:
        while not queue.empty():
            key, body = queue.get_nowait()
            response = await edge.client.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert response.status_code == 200, response.text

    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    await edge.settled(timeout_s=60)


async def test_redis_bytes_per_request_and_per_turn_stay_under_their_ceilings(edge: Any) -> None:
    keys = [
        await edge.tenant(
            f"tenant-{i}",
            input_tokens_per_minute=10**9,
            output_tokens_per_minute=10**9,
            max_concurrent_streams=CONCURRENCY,
        )
        for i in range(NUM_TENANTS)
    ]
    before = await _footprint_bytes(edge)
    started = time.monotonic()
    plain = [
        (keys[i % NUM_TENANTS], {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"hi {i}"}]})
        for i in range(NUM_REQUESTS)
    ]
    await _run(edge, plain)
    elapsed_s = time.monotonic() - started
    after_requests = await _footprint_bytes(edge)
    per_request = (after_requests - before) / NUM_REQUESTS
    recorded = [k async for k in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:usage:_recorded:*", count=1000)]
    left_open = [k async for k in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:usage:_open:*", count=1000)]
    admitted = [k async for k in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:quota:*:admitted:*", count=1000)]

    # Conversation turns: 100 conversations (10 per tenant) of 10 turns each, in order within each one.
    turn_text = "Tell me about Kyōto 東京 🙂"  # what the client sends each turn, bytes below
    conversations = [(keys[c % NUM_TENANTS], f"conv-{c}") for c in range(NUM_CONVERSATION_TURNS // 10)]
    for turn in range(10):
        await _run(
            edge,
            [
                (
                    key,
                    {
                        "model": MODEL,
                        "max_tokens": 4,
                        "conversation_id": cid,
                        "messages": [{"role": "user", "content": f"{turn_text} {turn}"}],
                    },
                )
                for key, cid in conversations
            ],
        )
    after_turns = await _footprint_bytes(edge)
    stored = 0
    for key, cid in conversations:
        tenant = f"tenant-{keys.index(key)}"
        stored += sum(
            len(raw.encode()) for raw in await edge.redis.lrange(f"{edge.key_prefix}:gw:conv:{tenant}:{cid}", 0, -1)
        )
    num_turns = len(conversations) * 10
    per_turn = (after_turns - after_requests) / num_turns  # each turn is a request too: its marker is in
    text_per_turn = stored / num_turns
    print(
        f"redis-footprint: requests={NUM_REQUESTS} tenants={NUM_TENANTS} concurrency={CONCURRENCY} "
        f"elapsed_s={elapsed_s:.0f} bytes_per_request={per_request:.1f} "
        f"bytes_per_conversation_turn={per_turn:.1f} (of which stored message JSON {text_per_turn:.1f})"
    )
    assert not left_open and not admitted, (len(left_open), len(admitted))
    assert len(recorded) == NUM_REQUESTS
    assert per_request <= BYTES_PER_REQUEST_CEILING, per_request
    assert per_turn - text_per_turn <= BYTES_PER_TURN_CEILING + BYTES_PER_REQUEST_CEILING, (per_turn, text_per_turn)
