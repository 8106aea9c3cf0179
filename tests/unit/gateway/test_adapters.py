"""LoRA adapters through the gateway (issue 40): the admin API and CLI load, list and unload them in the
real catalog (Redis); a request naming one carries its engine name (``NAME@VERSION``) to Schedule,
Prefill, PrefetchKV and Decode (fake router and workers, tests/kit/gateway.py) with block hashes that
include it; a reload changes the engine name; an unload is a 404 within the catalog cache's second while
a stream in flight finishes; hostile names are refused at load (400) and unknown at request (404); the workers'
refusals of an adapter become OpenAI errors; /v1/models lists adapters in vLLM's shape, per tenant."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from tandem.common.adapters import AdapterCatalog
from tandem.common.block_hash import BlockHasher
from tandem.gateway.adapters import ModelResolver
from tests.kit.redis import delete_prefix

pytestmark = [pytest.mark.timeout(60)]

MODEL = "SmolLM2-135M-Instruct"
REDIS_URL = "redis://127.0.0.1:6379/0"
ROOT = Path(__file__).resolve().parents[3]

#: Names no adapter may have: chat-template control tokens, emoji, too long, separators, empty.
HOSTILE_NAMES = ["<|im_start|>", "lora-🙂", "a" * 200, "a@1", "x y", "-lead", "../x", "", MODEL]


def chat(model: str, content: str = "hello world", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def load(edge: Any, name: str, path: str = "/adapters/x", **extra: Any) -> Any:
    return await edge.client.post(
        "/v1/admin/adapters", json={"name": name, "path": path, **extra}, headers=bearer(edge.admin_key)
    )


def catalog(edge: Any) -> AdapterCatalog:
    return AdapterCatalog(edge.redis, key_prefix=edge.key_prefix)


async def test_the_engine_name_reaches_schedule_prefill_and_decode_with_the_adapters_hashes(edge: Any) -> None:
    key = await edge.tenant("acme")
    loaded = await load(edge, "acme-support", "/adapters/acme support/réglé")
    assert loaded.status_code == 200, loaded.text
    engine = loaded.json()["engine_name"]
    assert engine == f"acme-support@{loaded.json()['version']}"
    # (the unit tokenizer refuses control tokens in content: 400 before any adapter; see test_prompt.py)
    prompt = "Café 東京 🙂 naïve façade " * 3

    for stream in (False, True):
        response = await edge.client.post(
            "/v1/chat/completions", json=chat("acme-support", prompt, stream=stream), headers=bearer(key)
        )
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(b[6:]) for b in response.text.split("\n\n") if b.startswith("data: {")]
            assert chunks and {c["model"] for c in chunks} == {"acme-support"}
        else:
            assert response.json()["model"] == "acme-support"  # named as the client named it
        schedule = edge.router.schedule_calls[-1]
        assert (schedule["model"], schedule["adapter"]) == (MODEL, engine)
        prefill = edge.prefill.prefill_requests[-1]
        assert prefill.adapter == engine
        assert edge.decode.decode_requests[-1].adapter == engine
        # The decode worker's prefetch streams the prompt's KV for the same adapter (tandem.worker.decode).
        prefetch = edge.decode.prefetch_requests[-1]
        assert (prefetch.request_id, prefetch.adapter) == (prefill.request_id, engine)
        # The router's hashes are the adapter's (vLLM's ("lora", name, path) keys), not the base model's.
        [hashes] = schedule["prompt_block_hashes"]
        hasher = BlockHasher(hashes.block_size_tokens, hashes.hash_seed)
        ids = list(prefill.prompt_token_ids)
        expected = hasher.block_hashes(
            ids, cache_salt=prefill.cache_salt, lora_name=engine, lora_path="/adapters/acme support/réglé"
        )
        assert list(hashes.hashes) == expected and expected
        assert not set(expected) & set(hasher.block_hashes(ids, cache_salt=prefill.cache_salt))

    base = await edge.client.post("/v1/chat/completions", json=chat(MODEL, prompt), headers=bearer(key))
    assert base.status_code == 200
    assert edge.router.schedule_calls[-1]["adapter"] == ""
    assert edge.prefill.prefill_requests[-1].adapter == edge.decode.decode_requests[-1].adapter == ""
    assert edge.decode.prefetch_requests[-1].adapter == ""
    # The latencies count the adapter's requests as their base model's: no label value per adapter.
    sample = edge.metrics.registry.get_sample_value
    assert sample("tandem_gateway_time_to_first_token_seconds_count", {"model": MODEL}) == 3
    assert sample("tandem_gateway_time_to_first_token_seconds_count", {"model": "acme-support"}) is None
    assert sample("tandem_gateway_time_to_first_token_seconds_count", {"model": engine}) is None


async def test_a_local_prefill_and_a_migrated_stream_carry_the_adapter(edge: Any, start_worker: Any) -> None:
    """Every Decode rebuilt for a request (local prefill, migration after a decode worker's death)."""
    from tests.kit.gateway import placement

    key = await edge.tenant("acme")
    engine = (await load(edge, "acme-support")).json()["engine_name"]
    local = placement(edge.prefill, edge.decode)
    local.local_prefill = True
    local.ClearField("prefill")
    edge.decode.decode_unavailable_after = 1  # dies after one step: the stream migrates
    survivor = await start_worker("decode-1")
    second = placement(edge.prefill, survivor)
    second.local_prefill = True
    second.ClearField("prefill")
    edge.router.placements[:] = [local, second]
    response = await edge.client.post(
        "/v1/chat/completions", json=chat("acme-support", stream=True), headers=bearer(key)
    )
    assert response.status_code == 200 and "[DONE]" in response.text
    assert [c["adapter"] for c in edge.router.schedule_calls] == [engine, engine]
    assert edge.decode.decode_requests[-1].adapter == engine and edge.decode.decode_requests[-1].local_prefill
    assert survivor.decode_requests[-1].adapter == engine and survivor.decode_requests[-1].resume_token_ids


async def test_a_reload_changes_the_engine_name_of_the_next_request(edge: Any) -> None:
    key = await edge.tenant("acme")
    first = (await load(edge, "acme-support", "/adapters/v1")).json()
    assert (await edge.client.post("/v1/chat/completions", json=chat("acme-support"), headers=bearer(key))).is_success
    assert edge.prefill.prefill_requests[-1].adapter == first["engine_name"]
    second = (await load(edge, "acme-support", "/adapters/v1")).json()  # same files, reloaded
    assert second["version"] > first["version"]
    assert (await edge.client.post("/v1/chat/completions", json=chat("acme-support"), headers=bearer(key))).is_success
    assert edge.prefill.prefill_requests[-1].adapter == second["engine_name"] != first["engine_name"]
    assert edge.router.schedule_calls[-1]["adapter"] == second["engine_name"]
    # ... and its blocks hash apart from the first load's, though the name and path are the same
    assert edge.router.schedule_calls[-1]["prompt_block_hashes"] != edge.router.schedule_calls[0]["prompt_block_hashes"]


async def test_an_unload_is_a_404_within_a_second_while_a_stream_in_flight_finishes(edge: Any) -> None:
    key = await edge.tenant("acme")
    await load(edge, "acme-support")
    edge.decode.decode_step_delay_s = 0.8  # three steps: the stream outlasts the wait for the 404
    in_flight = asyncio.ensure_future(
        edge.client.post("/v1/chat/completions", json=chat("acme-support", stream=True), headers=bearer(key))
    )
    while not edge.decode.decode_requests:
        await asyncio.sleep(0.01)
    # Unloaded elsewhere (another gateway's admin API, the CLI): this gateway learns it from its cache.
    assert await catalog(edge).remove("acme-support")
    unloaded_at = time.monotonic()
    while True:
        # max_tokens 1: answered by the prefill alone, so each probe is quick
        probe = await edge.client.post(
            "/v1/chat/completions", json=chat("acme-support", max_tokens=1), headers=bearer(key)
        )
        if probe.status_code == 404:
            break
        assert probe.status_code == 200
        assert time.monotonic() - unloaded_at < 1.5, "still served 1.5 s after the unload"
        await asyncio.sleep(0.02)
    elapsed_s = time.monotonic() - unloaded_at
    print(f"unload -> 404 after {elapsed_s:.3f} s")
    assert elapsed_s <= 1.2, elapsed_s  # cache_s = 1.0, plus one probe
    assert not in_flight.done()  # the stream that began before the unload is still going
    assert probe.json()["error"]["code"] == "model_not_found"
    streamed = await in_flight
    assert streamed.status_code == 200
    assert '"finish_reason":"stop"' in streamed.text.replace(" ", "") and streamed.text.rstrip().endswith(
        "data: [DONE]"
    )


async def test_unknown_and_hostile_adapter_names_are_404_at_request_and_400_at_load(edge: Any) -> None:
    key = await edge.tenant("acme")
    for name in HOSTILE_NAMES:
        response = await load(edge, name)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == "name"
    for name in [*HOSTILE_NAMES[:-2], "not-loaded"]:
        response = await edge.client.post("/v1/chat/completions", json=chat(name), headers=bearer(key))
        assert response.status_code == 404, (name, response.text)
        assert response.json()["error"]["code"] == "model_not_found"
    assert await catalog(edge).entries() == {}  # nothing was written
    assert edge.router.schedule_calls == []


async def test_a_load_needs_an_absolute_path_and_a_served_base_model_and_the_admin_key(edge: Any) -> None:
    for body, param in (
        ({"name": "ok", "path": "relative/dir"}, "path"),
        ({"name": "ok", "path": "/a\nb"}, "path"),
        ({"name": "ok", "path": "/x", "base_model": "other-model"}, "base_model"),
        ({"name": "ok", "path": 7}, "path"),
        ({"name": "ok", "path": "/x", "rank": 8}, "rank"),
    ):
        response = await edge.client.post("/v1/admin/adapters", json=body, headers=bearer(edge.admin_key))
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param
    not_json = await edge.client.post(
        "/v1/admin/adapters", content=b"{", headers={**bearer(edge.admin_key), "content-type": "application/json"}
    )
    assert not_json.status_code == 400
    tenant_key = await edge.tenant("acme")
    for headers in ({}, bearer(tenant_key)):
        response = await edge.client.post("/v1/admin/adapters", json={"name": "ok", "path": "/x"}, headers=headers)
        assert response.status_code == 401
        assert (await edge.client.get("/v1/admin/adapters", headers=headers)).status_code == 401
        assert (await edge.client.delete("/v1/admin/adapters/ok", headers=headers)).status_code == 401
    assert await catalog(edge).entries() == {}
    explicit = await load(edge, "ok", base_model=MODEL)
    assert explicit.status_code == 200 and explicit.json()["base_model"] == MODEL
    listed = await edge.client.get("/v1/admin/adapters", headers=bearer(edge.admin_key))
    assert [a["name"] for a in listed.json()["data"]] == ["ok"]
    gone = await edge.client.delete("/v1/admin/adapters/ok", headers=bearer(edge.admin_key))
    assert gone.json() == {"name": "ok", "object": "adapter", "deleted": True}
    again = await edge.client.delete("/v1/admin/adapters/ok", headers=bearer(edge.admin_key))
    assert again.status_code == 404 and again.json()["error"]["code"] == "adapter_not_found"
    # this gateway forgets its cached catalog on its own changes: a 404 at once
    response = await edge.client.post("/v1/chat/completions", json=chat("ok"), headers=bearer(tenant_key))
    assert response.status_code == 404


@pytest.mark.parametrize(
    ("code", "status", "error_code"),
    [
        (grpc.StatusCode.NOT_FOUND, 404, "model_not_found"),
        (grpc.StatusCode.FAILED_PRECONDITION, 503, "adapter_unavailable"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "no_capacity"),
    ],
)
async def test_a_workers_refusal_of_the_adapter_is_an_openai_error_without_internals(
    edge: Any, code: grpc.StatusCode, status: int, error_code: str
) -> None:
    key = await edge.tenant("acme")
    await load(edge, "acme-support")
    edge.prefill.prefill_error = code
    response = await edge.client.post("/v1/chat/completions", json=chat("acme-support"), headers=bearer(key))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == error_code
    assert "127.0.0.1" not in response.text and "scripted" not in response.text and "@" not in response.text
    if status == 503:
        assert int(response.headers["retry-after"]) >= 1
    else:
        assert "`acme-support`" in error["message"]


async def test_the_model_list_shows_adapters_as_vllm_does_and_only_what_the_tenant_may_use(edge: Any) -> None:
    await load(edge, "acme-support", "/adapters/secret/place")
    await load(edge, "globex-legal")
    everyone = await edge.tenant("everyone")
    listed = (await edge.client.get("/v1/models", headers=bearer(everyone))).json()["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [(MODEL, None), ("acme-support", MODEL), ("globex-legal", MODEL)]
    assert all(m["root"] == m["id"] and m["object"] == "model" for m in listed)
    assert "/adapters" not in json.dumps(listed)  # the deployment's paths stay inside
    one = await edge.client.get("/v1/models/acme-support", headers=bearer(everyone))
    assert one.json()["parent"] == MODEL

    narrow = await edge.tenant("narrow", allowed_adapters=["acme-support"])
    listed = (await edge.client.get("/v1/models", headers=bearer(narrow))).json()["data"]
    assert [m["id"] for m in listed] == [MODEL, "acme-support"]
    other_model = await edge.tenant("other-model", allowed_models=["another-model"])
    assert (await edge.client.get("/v1/models", headers=bearer(other_model))).json()["data"] == []
    forbidden = await edge.client.post("/v1/chat/completions", json=chat("globex-legal"), headers=bearer(narrow))
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "model_not_allowed"
    assert (await edge.client.get("/v1/models/globex-legal", headers=bearer(narrow))).status_code == 403
    # a name that names nothing: 403 as for another tenant's adapter, so that it cannot probe names
    assert (await edge.client.get("/v1/models/nope", headers=bearer(narrow))).status_code == 403
    assert (await edge.client.get("/v1/models/nope", headers=bearer(everyone))).status_code == 404


async def test_the_resolver_reads_the_catalog_once_a_second_and_rides_out_a_redis_outage() -> None:
    class Catalog:
        def __init__(self) -> None:
            self.num_reads = 0
            self.down = False

        async def entries(self) -> dict[str, Any]:
            from tandem.common.adapters import AdapterEntry
            from tandem.common.errors import BackendUnavailableError

            self.num_reads += 1
            if self.down:
                raise BackendUnavailableError("down")
            return {
                "a": AdapterEntry("a", MODEL, "/a", 3),
                "other": AdapterEntry("other", "not-served", "/o", 4),  # another deployment's model
            }

    now = [0.0]
    reader = Catalog()
    resolver = ModelResolver((MODEL,), reader, cache_s=1.0, clock=lambda: now[0])
    resolved = await resolver.resolve("a")
    assert resolved is not None and (resolved.base_model, resolved.adapter, resolved.adapter_path) == (
        MODEL,
        "a@3",
        "/a",
    )
    assert await resolver.resolve("other") is None
    assert (await resolver.resolve(MODEL)) is not None
    await asyncio.gather(*(resolver.resolve("a") for _ in range(20)))
    assert reader.num_reads == 1
    now[0] = 1.0
    reader.down = True
    assert await resolver.resolve("a") is not None  # the last read serves
    assert reader.num_reads == 2
    assert await resolver.resolve("a") is not None and reader.num_reads == 2  # and is not asked again at once
    from tandem.common.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError):
        await ModelResolver((MODEL,), reader).resolve("a")  # never read: 503, not a guess


def test_the_admin_cli_loads_lists_and_unloads_against_real_redis() -> None:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "TANDEM_GATEWAY_REDIS__URL": REDIS_URL,
        "TANDEM_GATEWAY_REGISTRY__KEY_PREFIX": prefix,
        "TANDEM_GATEWAY_SERVED_MODEL_NAME": MODEL,
    }

    def admin(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tandem.gateway.admin", "adapter", *argv],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        loaded = admin("load", "acme-support", "/adapters/acme")
        assert loaded.returncode == 0, loaded.stderr
        entry = json.loads(loaded.stdout)
        assert (entry["name"], entry["base_model"], entry["path"]) == ("acme-support", MODEL, "/adapters/acme")
        reloaded = json.loads(admin("load", "acme-support", "/adapters/acme").stdout)
        assert reloaded["version"] > entry["version"]
        listed = admin("list")
        assert [json.loads(line)["engine_name"] for line in listed.stdout.splitlines()] == [reloaded["engine_name"]]
        for argv in (
            ("load", "<|im_start|>", "/x"),
            ("load", "ok", "relative"),
            ("load", "ok", "/x", "--base-model", "nope"),
            ("unload", "never-loaded"),
        ):
            refused = admin(*argv)
            assert refused.returncode == 2 and refused.stderr.startswith("tandem-admin: "), (argv, refused.stderr)
            assert "Traceback" not in refused.stderr
        assert admin("unload", "acme-support").returncode == 0
        assert admin("list").stdout == ""
    finally:

        async def clean() -> None:
            client = aioredis.Redis.from_url(REDIS_URL)
            await delete_prefix(client, prefix)
            await client.aclose()

        asyncio.run(clean())
