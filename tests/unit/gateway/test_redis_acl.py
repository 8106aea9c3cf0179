"""The gateway's whole Redis path under its own ACL user (tandem.common.redis_acl), on the real Redis.

Key lookup, quota precheck, admission and settlement (Lua), usage (open record, progress, final
record, a dead replica's orphan settled by the sweeper), conversations (Lua append with the tenant's
salt guard), background responses (streamed ones' stored events and their resume) and the usage
endpoints: every command and key the gateway uses is granted, and Redis logs no denial. Before the
users existed, the scripts declared the tenant's record in KEYS, which needs write rights on it: the
gateway could not have run with a user that only reads tenants.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import redis.asyncio as aioredis

from tandem.gateway.app import build_app
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.redis_client import connect
from tandem.gateway.tenancy.models import Tenant
from tandem.gateway.tenancy.store import TenantStore
from tandem.gateway.usage import UsageRecord, UsageStore
from tests.kit.gateway import MODEL, FakeReadiness, FakeRouter, placement
from tests.kit.redis import acl_denials, acl_users
from tests.unit.gateway.conftest import gateway_settings

REDIS_URL = "redis://127.0.0.1:6379/0"


async def test_the_gateway_serves_bills_and_remembers_under_its_own_redis_user(
    start_worker: Callable[..., Any], fake_router: FakeRouter, prompt_tokenizer: HfPromptTokenizer
) -> None:
    prefill = await start_worker("prefill-0")
    decode = await start_worker("decode-0")
    fake_router.placements.append(placement(prefill, decode))
    async with acl_users(REDIS_URL) as users:
        prefix = users.key_prefix
        admin_client = connect(users.url("admin"), timeout_s=2.0)
        gateway_client = connect(users.url("gateway"), timeout_s=2.0)
        root = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            store = TenantStore(admin_client, key_prefix=prefix)
            await store.put_tenant(
                Tenant(
                    id="acme",
                    input_tokens_per_minute=100_000,
                    output_tokens_per_minute=100_000,
                    max_concurrent_streams=4,
                )
            )
            _, key = await store.create_key("acme")
            # A replica that died mid-request left an open record: the sweeper settles it at start.
            dead = UsageStore(gateway_client, key_prefix=prefix, replica_id="dead-replica")
            tenant = await store.get_tenant("acme")
            assert tenant is not None
            await dead.open(UsageRecord("acme", MODEL, 3, 0, 0, False, request_id="orphan-1", tenant_salt=tenant.salt))
            await dead.progress("orphan-1", 2)

            admin_key = "admin-acl-test"
            settings = gateway_settings(
                redis={"url": users.url("gateway")},
                auth={"mode": "api_key", "cache_s": 0, "admin_key": admin_key},
                tenancy={"key_prefix": prefix, "usage_sweep_interval_s": 0.2},
                registry={"key_prefix": prefix},
            )
            app = build_app(
                settings,
                router=fake_router,
                tokenizer=prompt_tokenizer,
                readiness=FakeReadiness(),
                metrics=GatewayMetrics(),
            )
            auth = {"Authorization": f"Bearer {key}"}
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                async with app.router.lifespan_context(app):
                    for stream in (False, True):
                        body = {
                            "model": MODEL,
                            "stream": stream,
                            "max_tokens": 4,
                            "conversation_id": "c1",
                            "messages": [{"role": "user", "content": f"hello {stream}"}],
                        }
                        response = await client.post("/v1/chat/completions", json=body, headers=auth)
                        assert response.status_code == 200, response.text
                        await app.state.services.orchestrator.drain()
                    usage = await client.get("/v1/usage", headers=auth)
                    assert usage.status_code == 200, usage.text
                    every = await client.get("/v1/admin/usage", headers={"Authorization": f"Bearer {admin_key}"})
                    assert every.status_code == 200, every.text
                    # LoRA adapters: the admin API loads one, a request resolves it, the admin API unloads it
                    admin_auth = {"Authorization": f"Bearer {admin_key}"}
                    adapter = {"name": "acme-lora", "path": "/adapters/acme"}
                    loaded = await client.post("/v1/admin/adapters", json=adapter, headers=admin_auth)
                    assert loaded.status_code == 200, loaded.text
                    body = {"model": "acme-lora", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
                    response = await client.post("/v1/chat/completions", json=body, headers=auth)
                    assert response.status_code == 200, response.text
                    assert prefill.prefill_requests[-1].adapter == loaded.json()["engine_name"]
                    models = await client.get("/v1/models", headers=auth)
                    assert [m["id"] for m in models.json()["data"]] == [MODEL, "acme-lora"]
                    unloaded = await client.delete("/v1/admin/adapters/acme-lora", headers=admin_auth)
                    assert unloaded.status_code == 200, unloaded.text
                    # Background responses: the lease, the record's conditional replaces, a cancel.
                    for cancel in (False, True):
                        decode.decode_step_delay_s = 0.5 if cancel else 0.0
                        body = {"model": MODEL, "input": "¿todo bien? 🙂", "max_output_tokens": 4, "background": True}
                        created = await client.post("/v1/responses", json=body, headers=auth)
                        assert created.status_code == 200, created.text
                        rid = created.json()["id"]
                        wanted = "in_progress" if cancel else "completed"
                        for _ in range(400):
                            got = await client.get(f"/v1/responses/{rid}", headers=auth)
                            if got.json()["status"] == wanted:
                                break
                            await asyncio.sleep(0.02)
                        assert got.json()["status"] == wanted, got.text
                        if cancel:
                            cancelled = await client.post(f"/v1/responses/{rid}/cancel", headers=auth)
                            assert cancelled.json()["status"] == "cancelled", cancelled.text
                    # A streamed one: its events stored as they go, a resume, its deletion with the record.
                    decode.decode_step_delay_s = 0.0
                    body = {**body, "stream": True}
                    created = await client.post("/v1/responses", json=body, headers=auth)
                    assert created.status_code == 200 and "response.completed" in created.text, created.text
                    rid = created.headers["x-request-id"]
                    resumed = await client.get(f"/v1/responses/{rid}?stream=true&starting_after=0", headers=auth)
                    assert resumed.status_code == 200 and "response.completed" in resumed.text, resumed.text
                    deleted = await client.delete(f"/v1/responses/{rid}", headers=auth)
                    assert deleted.status_code == 200, deleted.text
                    await app.state.services.orchestrator.drain()
                    while app.state.services.drain.num_in_flight:
                        await asyncio.sleep(0.02)

            totals = usage.json()["total"]
            assert totals["requests"] == 3, totals  # two served here, the dead replica's orphan
            stored = [json.loads(m) for m in await root.lrange(f"{prefix}:gw:conv:acme:c1", 0, -1)]
            assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
            assert await root.zcard(f"{prefix}:gw:quota:acme:streams") == 0  # both slots freed
            assert await acl_denials(root, prefix) == []
        finally:
            await admin_client.aclose()
            await gateway_client.aclose()
            await root.aclose()
