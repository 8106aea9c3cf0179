"""Tenants and keys: 401/403, isolation between tenants (usage, conversations,
prefix cache), keys never logged, the admin CLI and the admin usage view."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tandem.gateway import admin

pytestmark = [pytest.mark.timeout(60)]

MODEL = "SmolLM2-135M-Instruct"


def chat(content: str = "hello world", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_missing_unknown_and_revoked_keys_get_401_and_reach_no_backend(edge: Any) -> None:
    key = await edge.tenant("acme")
    assert (await edge.client.post("/v1/chat/completions", json=chat())).status_code == 401
    unknown = await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer("tdm_nope_nope"))
    assert unknown.status_code == 401
    assert unknown.json()["error"]["code"] == "invalid_api_key"
    assert edge.router.schedule_calls == []

    assert (await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
    (record,) = await edge.store.list_keys("acme")
    await edge.store.revoke_key(record.key_id)
    revoked = await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
    assert revoked.status_code == 401
    assert len(edge.router.schedule_calls) == 1


async def test_model_not_allowed_is_403_and_unknown_model_404(edge: Any) -> None:
    key = await edge.tenant("narrow", allowed_models=["some-other-model"])
    forbidden = await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["code"] == "model_not_allowed"
    missing = await edge.client.post("/v1/chat/completions", json={**chat(), "model": "no-such"}, headers=bearer(key))
    assert missing.status_code == 404
    models = await edge.client.get("/v1/models", headers=bearer(key))
    assert models.json()["data"] == []


async def test_tenants_are_isolated(edge: Any) -> None:
    key_a = await edge.tenant("tenant-a", priority_class="interactive")
    key_b = await edge.tenant("tenant-b", priority_class="batch")
    for key in (key_a, key_b):
        response = await edge.client.post(
            "/v1/chat/completions", json=chat(conversation_id="same-id"), headers=bearer(key)
        )
        assert response.status_code == 200
    # Prefix cache: each tenant its own salt, to both workers (the router gets salted hashes, not the
    # salt); priority class to the router.
    call_a, call_b = edge.router.schedule_calls
    assert call_a["tenant"] == "tenant-a" and call_b["tenant"] == "tenant-b"
    assert "cache_salt" not in call_a and "prompt_token_ids" not in call_a
    assert (call_a["priority"], call_b["priority"]) == ("interactive", "batch")
    salts = [r.cache_salt for r in edge.prefill.prefill_requests]
    assert salts[0] and salts[1] and salts[0] != salts[1]
    assert [r.cache_salt for r in edge.decode.decode_requests] == salts
    # Conversations: the same id is two conversations.
    await edge.settled()
    history_a = await edge.client.post(
        "/v1/chat/completions", json=chat("two", conversation_id="same-id"), headers=bearer(key_a)
    )
    assert history_a.status_code == 200
    prompt_a = list(edge.prefill.prefill_requests[-1].prompt_token_ids)
    assert len(prompt_a) > len(edge.prefill.prefill_requests[0].prompt_token_ids) + 4  # history came along
    await edge.settled()
    stored_b = await edge.app.state.services.conversations.history("tenant-b", "same-id")
    assert [m["content"] for m in stored_b] == ["hello world", "Hello world!"]
    # Usage: each tenant sees only its own.
    await edge.settled()
    usage_a = (await edge.client.get("/v1/usage", headers=bearer(key_a))).json()
    usage_b = (await edge.client.get("/v1/usage", headers=bearer(key_b))).json()
    assert usage_a["tenant"] == "tenant-a" and usage_a["total"]["requests"] == 2
    assert usage_b["tenant"] == "tenant-b" and usage_b["total"]["requests"] == 1
    assert usage_b["total"]["completion_tokens"] == 4


async def test_admin_usage_needs_the_admin_key(edge: Any) -> None:
    key = await edge.tenant("acme")
    await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
    await edge.settled()
    assert (await edge.client.get("/v1/admin/usage", headers=bearer(key))).status_code == 401
    view = await edge.client.get("/v1/admin/usage", headers=bearer(edge.admin_key))
    assert view.status_code == 200
    tenants = {item["tenant"]: item for item in view.json()["data"]}
    assert tenants["acme"]["total"]["requests"] == 1


async def test_keys_never_appear_in_logs_or_metrics(edge: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key = await edge.tenant("acme", output_tokens_per_minute=5)
    await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
    await edge.settled()
    await edge.client.post("/v1/chat/completions", json=chat(max_tokens=5), headers=bearer(key))  # 429
    await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key + "x"))  # 401
    metrics = (await edge.client.get("/metrics")).text
    logged = "\n".join(r.getMessage() + json.dumps(vars(r), default=str) for r in caplog.records)
    assert "request finished" in logged and "request refused" in logged
    # tdm_<key id>_<secret>: the secret is URL-safe base64 and may hold "_" itself (split at the last
    # one, a run once checked a single character, found in an unrelated log line).
    _, secret = key.removeprefix("tdm_").split("_", 1)
    assert len(secret) >= 40 and secret not in logged and secret not in metrics


def test_admin_cli_creates_lists_and_revokes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import uuid

    prefix = f"tandem-cli-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TANDEM_GATEWAY_TENANCY__KEY_PREFIX", prefix)

    def run(*argv: str) -> list[dict[str, Any]]:
        assert admin.main(list(argv)) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    try:
        (tenant,) = run("tenant", "create", "acme", "--output-tokens-per-minute", "900", "--allowed-model", MODEL)
        assert tenant["output_tokens_per_minute"] == 900 and tenant["allowed_models"] == [MODEL]
        (created,) = run("key", "create", "acme", "--label", "ci")
        assert created["api_key"].startswith("tdm_") and created["tenant_id"] == "acme"
        (listed,) = run("key", "list", "acme")
        assert listed["key_id"] == created["key_id"] and "api_key" not in listed
        assert created["api_key"] not in json.dumps(listed)
        (revoked,) = run("key", "revoke", created["key_id"])
        assert revoked["revoked"] is True
        (updated,) = run("tenant", "update", "acme", "--max-concurrent-streams", "2", "--no-allow-client-system-prompt")
        assert updated["max_concurrent_streams"] == 2 and updated["allow_client_system_prompt"] is False
        assert [t["id"] for t in run("tenant", "list")] == ["acme"]
        assert admin.main(["key", "create", "nobody"]) == 2
    finally:
        import redis

        client = redis.Redis()
        for k in client.scan_iter(match=f"{prefix}:*"):
            client.delete(k)


async def test_a_tenant_created_again_under_the_same_id_gets_a_new_cache_salt(edge: Any) -> None:
    """The salt is random per tenant record: not a function of the public id, and a deleted tenant's
    cached prefixes are not its successor's."""
    key = await edge.tenant("reborn")
    assert (await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
    await edge.store.delete_tenant("reborn")
    key = await edge.tenant("reborn")
    assert (await edge.client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
    first, second = (request.cache_salt for request in edge.prefill.prefill_requests)
    assert first and second and first != second
    assert len(first) == 32 and "reborn" not in first


async def test_a_tenant_stored_before_salts_gets_one_salt_for_good(edge: Any) -> None:
    tenant_key = f"{edge.key_prefix}:gw:tenant:legacy"
    await edge.tenant("legacy")
    stored = json.loads(await edge.redis.get(tenant_key))
    del stored["salt"]  # a record written before this field existed
    await edge.redis.set(tenant_key, json.dumps(stored))
    salts = {(await edge.store.get_tenant("legacy")).cache_salt for _ in range(3)}
    assert len(salts) == 1
    assert json.loads(await edge.redis.get(tenant_key))["salt"] == salts.pop()


def test_admins_never_see_the_salt(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.gateway.tenancy.models import Tenant

    tenant = Tenant(id="acme")
    assert "salt" not in tenant.public() and tenant.public()["id"] == "acme"


async def test_a_deleted_tenants_data_goes_with_it(edge: Any) -> None:
    """Conversations, usage and quota state: a tenant created again under the same id reads none of it."""
    key = await edge.tenant("gone", max_concurrent_streams=4)
    body = chat("remember: the code is 4711 ✓", conversation_id="c1")
    assert (await edge.client.post("/v1/chat/completions", json=body, headers=bearer(key))).status_code == 200
    await edge.settled()
    assert [k async for k in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:*:gone:*")]
    deleted = await edge.store.delete_tenant("gone")
    assert deleted >= 3  # the record, a conversation, usage counters, ...
    assert [k async for k in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:*:gone*")] == []
    assert "gone" not in await edge.redis.smembers(f"{edge.key_prefix}:gw:usage:_tenants")

    key = await edge.tenant("gone")
    usage = (await edge.client.get("/v1/usage", headers=bearer(key))).json()["total"]
    assert usage["requests"] == 0
    again = await edge.client.post("/v1/chat/completions", json=chat("hi", conversation_id="c1"), headers=bearer(key))
    assert again.status_code == 200
    prompt = edge.prefill.prefill_requests[-1].prompt_token_ids
    assert len(prompt) < len(edge.prefill.prefill_requests[0].prompt_token_ids) + 3  # no old turns in it
