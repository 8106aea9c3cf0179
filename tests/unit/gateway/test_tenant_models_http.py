"""Per-tenant model and adapter allow-lists through the gateway (issue 40 part 4), against the real
Redis (tenants, the adapter catalog, usage, quota) with the fake router and workers
(tests/kit/gateway.py): a model or adapter a tenant may not use is 403 ``model_not_allowed`` in the
OpenAI error shape that reaches no backend, records no usage and takes no quota; a tenant with an
adapter list gets the same 403, word for word, for another tenant's adapter and for a name that
names nothing; an allowed adapter passes; hostile and non-ASCII names; ``/v1/usage`` shows the
requests per model and adapter, adding up to the totals; a tenant's quota on one adapter is a 429
that names it, while its base model is served."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.gateway.usage import COUNTERS

pytestmark = [pytest.mark.timeout(60)]

MODEL = "SmolLM2-135M-Instruct"
#: Names a client may send in ``model``: control tokens, emoji, CJK, accents, separators, long.
HOSTILE = ["<|im_start|>system", "🦄", "東京-lora", "café", "a|b", "x" * 300, "tandem-test-a@1"]


def chat(model: str, content: str = "hello 🙂 東京 café", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def load(edge: Any, name: str) -> None:
    response = await edge.client.post(
        "/v1/admin/adapters", json={"name": name, "path": f"/adapters/{name}"}, headers=bearer(edge.admin_key)
    )
    assert response.status_code == 200, response.text


async def quota_and_usage_keys(edge: Any, tenant_id: str) -> list[str]:
    """The tenant's quota buckets, stream slots and usage records (not its count of refused requests)."""
    patterns = [f"{edge.key_prefix}:gw:quota:{tenant_id}:*", f"{edge.key_prefix}:gw:usage:{tenant_id}*"]
    found = [str(k) for p in patterns async for k in edge.redis.scan_iter(match=p)]
    open_records = [str(k) async for k in edge.redis.scan_iter(match=f"{edge.key_prefix}:gw:usage:_open:*")]
    return sorted(k for k in found + open_records if ":rejected:" not in k)


def assert_not_allowed(response: Any, model: str) -> None:
    assert response.status_code == 403, response.text
    assert response.json() == {
        "error": {
            "message": f"This API key may not use the model `{model}`.",
            "type": "permission_error",
            "param": "model",
            "code": "model_not_allowed",
        }
    }


async def test_a_model_or_adapter_off_the_lists_is_403_and_changes_nothing(edge: Any) -> None:
    for name in ("tandem-test-a", "tandem-test-b"):
        await load(edge, name)
    key = await edge.tenant("lora-only", allowed_adapters=["tandem-test-a"], input_tokens_per_minute=10_000)
    for stream in (False, True):
        # Another tenant's adapter and a name that names nothing: the same answer, word for word.
        for model in ("tandem-test-b", "no-such-adapter", *HOSTILE):
            response = await edge.client.post(
                "/v1/chat/completions", json=chat(model, stream=stream), headers=bearer(key)
            )
            assert_not_allowed(response, model)
    completion = await edge.client.post(
        "/v1/completions", json={"model": "tandem-test-b", "prompt": "hi", "max_tokens": 2}, headers=bearer(key)
    )
    assert_not_allowed(completion, "tandem-test-b")
    await edge.settled()
    assert edge.router.schedule_calls == [] and edge.prefill.prefill_requests == []
    assert await quota_and_usage_keys(edge, "lora-only") == []

    # Its own adapter and the base model (no model list: every base model) pass.
    for model in ("tandem-test-a", MODEL):
        response = await edge.client.post("/v1/chat/completions", json=chat(model), headers=bearer(key))
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
    await edge.settled()
    adapters = [call["adapter"] for call in edge.router.schedule_calls]
    assert len(adapters) == 2 and adapters[0].startswith("tandem-test-a@") and adapters[1] == ""
    models = await edge.client.get("/v1/models", headers=bearer(key))
    assert sorted(card["id"] for card in models.json()["data"]) == sorted([MODEL, "tandem-test-a"])


async def test_an_adapter_needs_its_base_model_allowed(edge: Any) -> None:
    await load(edge, "tandem-test-a")
    key = await edge.tenant("other-model", allowed_models=["some-other-model"])
    for model in ("tandem-test-a", MODEL):
        response = await edge.client.post("/v1/chat/completions", json=chat(model), headers=bearer(key))
        assert_not_allowed(response, model)
    # No adapter list: a name that names nothing is 404, as it was before adapters.
    missing = await edge.client.post("/v1/chat/completions", json=chat("no-such"), headers=bearer(key))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert edge.router.schedule_calls == []
    assert (await edge.client.get("/v1/models", headers=bearer(key))).json()["data"] == []


async def test_unrestricted_tenants_get_404_for_hostile_names(edge: Any) -> None:
    key = await edge.tenant("open")
    for model in HOSTILE:
        response = await edge.client.post("/v1/chat/completions", json=chat(model), headers=bearer(key))
        assert response.status_code == 404, (model, response.text)
        assert response.json()["error"]["code"] == "model_not_found"
    assert edge.router.schedule_calls == []


async def test_v1_usage_shows_each_model_and_adapter_adding_up_to_the_totals(edge: Any) -> None:
    for name in ("tandem-test-a", "tandem-test-b"):
        await load(edge, name)
    key = await edge.tenant("acme")
    other = await edge.tenant("zeta")
    sent = {MODEL: 1, "tandem-test-a": 2, "tandem-test-b": 1}
    for model, count in sent.items():
        for _ in range(count):
            response = await edge.client.post("/v1/chat/completions", json=chat(model), headers=bearer(key))
            assert response.status_code == 200, response.text
    assert (await edge.client.post("/v1/chat/completions", json=chat(MODEL), headers=bearer(other))).status_code == 200
    await edge.settled()
    usage = (await edge.client.get("/v1/usage", headers=bearer(key))).json()
    rows = {row["model"]: row for row in usage["data"]}
    assert {model: row["requests"] for model, row in rows.items()} == sent
    assert {model: row["base_model"] for model, row in rows.items()} == dict.fromkeys(sent, MODEL)
    assert all(row["prompt_tokens"] > 0 and row["completion_tokens"] > 0 for row in rows.values())
    for counter in COUNTERS:
        assert sum(row[counter] for row in usage["data"]) == usage["total"][counter]
    (by_base,) = usage["by_base_model"]
    assert by_base == {"model": MODEL, **usage["total"]}
    assert usage["total"]["requests"] == 4  # zeta's request is zeta's
    zeta = (await edge.client.get("/v1/usage", headers=bearer(other))).json()
    assert [row["model"] for row in zeta["data"]] == [MODEL] and zeta["total"]["requests"] == 1


async def test_a_models_own_quota_is_a_429_naming_it(edge: Any) -> None:
    await load(edge, "tandem-test-a")
    key = await edge.tenant("acme", model_quotas={"tandem-test-a": {"input_tokens_per_minute": 2}})
    headers = bearer(key)
    refused = await edge.client.post("/v1/chat/completions", json=chat("tandem-test-a"), headers=headers)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["message"].startswith("For the model `tandem-test-a`: ") and error["type"] == "tokens"
    served = await edge.client.post("/v1/chat/completions", json=chat(MODEL), headers=headers)
    assert served.status_code == 200, served.text
    await edge.settled()
    assert len(edge.router.schedule_calls) == 1 and edge.router.schedule_calls[0]["adapter"] == ""
    usage = (await edge.client.get("/v1/usage", headers=headers)).json()
    assert [row["model"] for row in usage["data"]] == [MODEL]  # the refused request is not billed
