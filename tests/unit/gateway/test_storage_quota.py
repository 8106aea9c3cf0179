"""Each tenant's storage quota (issue 38, "fair use of shared state"): what a tenant keeps in Redis is
counted in bytes, exactly, by the scripts that write and delete it, and bounded per tenant.

Against the real Redis: a conversation that alone would be over its tenant's quota gets 413
``storage_quota_exceeded`` before any token (nothing charged, nothing generated) while another tenant
is served; the tenant's other conversations are forgotten, least recently used first, to make room; the
account equals the bytes actually stored after any sequence of appends, trims, evictions and deletions
(hypothesis, against what Redis holds), follows expiry, and stays close to Redis's own MEMORY USAGE.
The reproduction of the issue with a full Redis is ``test_storage_quota_full_redis.py``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.gateway.conversations import ConversationStore, turn_bytes
from tandem.gateway.redis_client import connect
from tandem.gateway.storage_quota import ITEM_OVERHEAD_BYTES, account_key
from tests.kit.redis import delete_prefix

MODEL = "SmolLM2-135M-Instruct"
REDIS_URL = "redis://127.0.0.1:6379/0"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(text: str, conversation_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "conversation_id": conversation_id,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


async def stored_in_redis(client: Any, prefix: str, tenant: str, ids: Sequence[str] = ()) -> dict[str, int]:
    """What the tenant's conversations (``ids``, default: all) hold, measured from Redis's own content:
    item → bytes."""
    keys = [f"{prefix}:gw:conv:{tenant}:{i}" for i in ids] or [
        str(k) async for k in client.scan_iter(match=f"{prefix}:gw:conv:{tenant}:*", count=1000)
    ]
    out: dict[str, int] = {}
    for key in keys:
        turns = await client.lrange(key, 0, -1)
        if turns:
            out["conv:" + key.removeprefix(f"{prefix}:gw:conv:{tenant}:")] = ITEM_OVERHEAD_BYTES + sum(
                turn_bytes(t) for t in turns
            )
    return out


async def account(client: Any, prefix: str, tenant: str) -> tuple[int, dict[str, int]]:
    fields = {str(k): int(v) for k, v in (await client.hgetall(account_key(prefix, tenant))).items()}
    return fields.pop("total", 0), fields


# -- through the gateway ------------------------------------------------------------------------------


async def test_a_conversation_over_its_tenants_quota_gets_413_before_any_token_and_others_are_served(
    edge: Any,
) -> None:
    small = await edge.tenant("small", max_stored_bytes=2500, output_tokens_per_minute=10_000)
    other = await edge.tenant("other")
    first = await edge.client.post("/v1/chat/completions", json=chat("a" * 800, "c1"), headers=bearer(small))
    assert first.status_code == 200, first.text
    await edge.settled()
    num_prefills = len(edge.prefill.prefill_requests)
    usage_before = (await edge.client.get("/v1/usage", headers=bearer(small))).json()["total"]

    # c1 (~1,200 bytes) with 1,600 more would hold ~2,900: over the quota even with nothing else stored.
    for stream in (False, True):
        refused = await edge.client.post(
            "/v1/chat/completions", json=chat("b" * 1600, "c1", stream=stream), headers=bearer(small)
        )
        assert refused.status_code == 413, refused.text
        assert refused.headers["content-type"].startswith("application/json")  # before any SSE byte
        error = refused.json()["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "storage_quota_exceeded",
            "conversation_id",
            "invalid_request_error",
        )
        assert "2500 bytes" in error["message"] and "conversation_id" in error["message"]
    await edge.settled()
    assert len(edge.prefill.prefill_requests) == num_prefills  # nothing generated
    assert (await edge.client.get("/v1/usage", headers=bearer(small))).json()["total"] == usage_before
    assert 'reason="storage_quota"' in (await edge.client.get("/metrics")).text

    # Another tenant sends the very same request: served.
    served = await edge.client.post("/v1/chat/completions", json=chat("b" * 1600, "c1"), headers=bearer(other))
    assert served.status_code == 200, served.text
    # The same tenant in a new conversation fits (~2,000 bytes): c1, least recently used, is forgotten.
    fits = await edge.client.post("/v1/chat/completions", json=chat("b" * 1600, "c2"), headers=bearer(small))
    assert fits.status_code == 200, fits.text
    await edge.settled()
    services = edge.app.state.services
    assert await services.conversations.history("small", "c1") == []
    assert [m["role"] for m in await services.conversations.history("small", "c2")] == ["user", "assistant"]
    total, items = await account(edge.redis, edge.key_prefix, "small")
    assert items == await stored_in_redis(edge.redis, edge.key_prefix, "small")
    assert total == sum(items.values()) <= 2500
    assert await services.conversations.history("other", "c1")  # untouched by small's evictions


async def test_a_tenant_with_a_zero_quota_stores_nothing_and_is_served_without_conversations(edge: Any) -> None:
    key = await edge.tenant("stateless", max_stored_bytes=0)
    refused = await edge.client.post("/v1/chat/completions", json=chat("hi", "c1"), headers=bearer(key))
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "storage_quota_exceeded"
    plain = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert (await edge.client.post("/v1/chat/completions", json=plain, headers=bearer(key))).status_code == 200
    await edge.settled()
    assert [k async for k in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:conv:stateless*")] == []


def test_the_admin_cli_sets_the_quota_and_shows_the_stored_bytes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.gateway import admin

    prefix = f"tandem-cli-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TANDEM_GATEWAY_TENANCY__KEY_PREFIX", prefix)

    def run(*argv: str) -> list[dict[str, Any]]:
        assert admin.main(list(argv)) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    async def store_turns() -> None:
        client = connect(REDIS_URL, timeout_s=2.0)
        try:
            store = ConversationStore(client, key_prefix=prefix, ttl_s=600, max_messages=10)
            for cid in ("c1", "c2"):
                await store.append("acme", cid, [{"role": "user", "content": "x" * 500}], max_stored_bytes=4096)
        finally:
            await client.aclose()

    try:
        (created,) = run("tenant", "create", "acme")
        assert created["max_stored_bytes"] is None
        (shown,) = run("tenant", "show", "acme")
        assert shown["storage"] == {"stored_bytes": 0, "max_stored_bytes": 16 * 1024 * 1024, "num_conversations": 0}
        (updated,) = run("tenant", "update", "acme", "--max-stored-bytes", "4096")
        assert updated["max_stored_bytes"] == 4096
        asyncio.run(store_turns())
        (shown,) = run("tenant", "show", "acme")
        turn = turn_bytes(json.dumps({"role": "user", "content": "x" * 500}))
        assert shown["storage"] == {
            "stored_bytes": 2 * (ITEM_OVERHEAD_BYTES + turn),
            "max_stored_bytes": 4096,
            "num_conversations": 2,
        }
        run("tenant", "delete", "acme")
        assert admin.main(["tenant", "update", "acme", "--max-stored-bytes", "-1"]) != 0
    finally:
        import redis

        client = redis.Redis()
        for k in client.scan_iter(match=f"{prefix}:*"):
            client.delete(k)


# -- the store and its account --------------------------------------------------------------------------


@pytest_asyncio.fixture
async def redis_prefix() -> AsyncIterator[tuple[Any, str]]:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect(REDIS_URL, timeout_s=2.0)
    try:
        yield client, prefix
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()


async def test_expired_conversations_leave_the_account_at_the_next_look(redis_prefix: tuple[Any, str]) -> None:
    """A TTL runs no script: the account still lists an expired conversation until the tenant's next
    write or read, which forgets it (the index and the keys' expiry share Redis's clock)."""
    client, prefix = redis_prefix
    short = ConversationStore(client, key_prefix=prefix, ttl_s=2, max_messages=10)
    await short.append("acme", "old", [{"role": "user", "content": "x" * 300}])
    await asyncio.sleep(1.2)
    await short.append("acme", "new", [{"role": "user", "content": "y" * 10}])
    await asyncio.sleep(1.2)  # old expired, new has 0.8 s left
    assert await client.exists(f"{prefix}:gw:conv:acme:old") == 0
    assert set((await account(client, prefix, "acme"))[1]) == {"conv:old", "conv:new"}  # not yet known
    new_bytes = ITEM_OVERHEAD_BYTES + turn_bytes(json.dumps({"role": "user", "content": "y" * 10}))
    assert await short.stored("acme") == (new_bytes, 1)
    assert await account(client, prefix, "acme") == (new_bytes, {"conv:new": new_bytes})

    # The next write forgets them as well, and the account goes when the last conversation does.
    await short.append("acme", "a", [{"role": "user", "content": "x" * 300}])
    await asyncio.sleep(1.2)
    await short.append("acme", "keep", [{"role": "user", "content": "y" * 10}])
    await asyncio.sleep(1.2)  # new and a expired, keep has 0.8 s left
    result = await short.append("acme", "b", [{"role": "user", "content": "y" * 10}])
    assert result.num_stored_bytes == 2 * new_bytes
    assert await account(client, prefix, "acme") == (2 * new_bytes, {"conv:keep": new_bytes, "conv:b": new_bytes})
    await asyncio.sleep(2.2)
    assert await client.exists(account_key(prefix, "acme"), f"{prefix}:gw:conv:acme") == 0


async def test_a_conversation_over_the_quota_by_itself_loses_its_oldest_turns_not_the_limit(
    redis_prefix: tuple[Any, str],
) -> None:
    """The preparation estimates the answer; an answer longer than that (or two requests on one
    conversation at once) must still leave the tenant within its quota."""
    client, prefix = redis_prefix
    store = ConversationStore(client, key_prefix=prefix, ttl_s=600, max_messages=50)
    for i in range(4):
        await store.append("acme", "c1", [{"role": "user", "content": f"{i}" * 200}], max_stored_bytes=1000)
    result = await store.append("acme", "c1", [{"role": "assistant", "content": "z" * 400}], max_stored_bytes=1000)
    assert result.num_forgotten_turns >= 1 and result.num_stored_bytes <= 1000
    history = await store.history("acme", "c1")
    assert history[-1]["content"] == "z" * 400 and history[0]["content"] != "0" * 200
    total, items = await account(client, prefix, "acme")
    assert items == await stored_in_redis(client, prefix, "acme") and total == result.num_stored_bytes

    # A turn larger than the whole quota is not stored at all, and takes nothing with it but its conversation.
    await store.append("acme", "c2", [{"role": "user", "content": "ok"}], max_stored_bytes=1000)
    await store.append("acme", "c3", [{"role": "user", "content": "w" * 2000}], max_stored_bytes=1000)
    assert await store.history("acme", "c3") == []
    assert await client.zscore(f"{prefix}:gw:conv:acme", "c3") is None
    total, items = await account(client, prefix, "acme")
    assert items == await stored_in_redis(client, prefix, "acme") and total <= 1000


async def test_the_account_is_close_to_what_redis_itself_uses(redis_prefix: tuple[Any, str]) -> None:
    """The account counts text plus fixed overheads; Redis's MEMORY USAGE of the same conversations (and
    their index) is within -20%..+50% of it, from 10-byte turns to 50 KB ones."""
    client, prefix = redis_prefix
    store = ConversationStore(client, key_prefix=prefix, ttl_s=600, max_messages=200)
    ratios: dict[str, float] = {}
    for tenant, size, num_turns, num_conversations in (
        ("tiny", 10, 200, 5),
        ("small", 300, 50, 5),
        ("medium", 4000, 20, 3),
        ("large", 50_000, 4, 3),
    ):
        for c in range(num_conversations):
            for start in range(0, num_turns, 10):
                batch = [{"role": "user", "content": "é" * (size // 2)}] * min(10, num_turns - start)
                await store.append(tenant, f"c{c}", batch, max_stored_bytes=1 << 30)
        total, _ = await account(client, prefix, tenant)
        used = 0
        async for key in client.scan_iter(match=f"{prefix}:gw:conv:{tenant}*"):
            used += int(await client.memory_usage(key, samples=0))
        ratios[tenant] = round(total / used, 2)
    print("account / MEMORY USAGE:", ratios)
    # Redis uses at most 25% more than the account (what a quota bounds), and the account never
    # over-counts by half (tiny turns, which Redis packs tightly, are the worst case).
    assert all(0.8 <= ratio <= 1.5 for ratio in ratios.values()), ratios


# A small world: two tenants, five conversation ids, small limits, so that every bound is hit often.
_CONVERSATIONS = [f"c{i}" for i in range(5)]
_APPEND = st.fixed_dictionaries(
    {
        "tenant": st.sampled_from(["a", "b"]),
        "conversation": st.sampled_from(_CONVERSATIONS),
        "sizes": st.lists(st.integers(0, 700), min_size=1, max_size=3),
        "num_dropped": st.integers(0, 3),
        "limit": st.sampled_from([0, 300, 1200, 3000, 1 << 20]),
    }
)
_OPERATION = st.one_of(
    _APPEND.map(lambda a: ("append", a)),
    st.tuples(st.just("delete_key"), st.sampled_from(["a", "b"]), st.sampled_from(_CONVERSATIONS)),
    st.tuples(st.just("delete_tenant"), st.sampled_from(["a", "b"])),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=st.lists(_OPERATION, min_size=1, max_size=25))
def test_the_account_equals_what_is_stored_after_any_sequence_of_operations(operations: list[Any]) -> None:
    """Appends (with trims of dropped history and of ``max_messages``), evictions by count and by bytes,
    turns forgotten for the quota, conversations deleted behind the store's back (Redis evicting a key,
    an operator), and whole tenants deleted: after each, every tenant's account equals the bytes its
    conversations hold in Redis, conversation by conversation, within its last limit."""
    asyncio.run(_run_operations(operations))


async def _run_operations(operations: list[Any]) -> None:
    from tandem.gateway.tenancy.store import TenantStore

    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    client = connect(REDIS_URL, timeout_s=2.0)
    store = ConversationStore(client, key_prefix=prefix, ttl_s=600, max_messages=4, max_conversations=3)
    tenants = TenantStore(client, key_prefix=prefix)
    deleted_behind: set[tuple[str, str]] = set()
    try:
        for operation in operations:
            if operation[0] == "append":
                a = operation[1]
                messages = [{"role": "user", "content": "ü" * (n // 2)} for n in a["sizes"]]
                result = await store.append(
                    a["tenant"],
                    a["conversation"],
                    messages,
                    num_dropped_history=a["num_dropped"],
                    max_stored_bytes=a["limit"],
                )
                deleted_behind.discard((a["tenant"], a["conversation"]))
                assert result.num_stored_bytes <= a["limit"]
                history = await store.history(a["tenant"], a["conversation"])
                if ITEM_OVERHEAD_BYTES + turn_bytes(json.dumps(messages[-1], ensure_ascii=False)) <= a["limit"]:
                    assert history and history[-1] == messages[-1]  # the newest turn is always kept if it fits
            elif operation[0] == "delete_key":
                _, tenant, conversation = operation
                if await client.delete(f"{prefix}:gw:conv:{tenant}:{conversation}"):
                    deleted_behind.add((tenant, conversation))
            else:
                await tenants.delete_tenant(operation[1])
                deleted_behind = {d for d in deleted_behind if d[0] != operation[1]}
            for tenant in ("a", "b"):
                total, items = await account(client, prefix, tenant)
                actual = await stored_in_redis(client, prefix, tenant, _CONVERSATIONS)
                # A conversation deleted behind the store's back stays counted (never under-counted) until
                # the store touches it again: appended to, evicted, or expired.
                stale = {f"conv:{c}" for t, c in deleted_behind if t == tenant}
                assert {k: v for k, v in items.items() if k not in stale} == actual, (tenant, operation)
                assert total == sum(items.values())
                index = {str(m) for m in await client.zrange(f"{prefix}:gw:conv:{tenant}", 0, -1)}
                assert {k.removeprefix("conv:") for k in actual} <= index and len(index) <= 3
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()
