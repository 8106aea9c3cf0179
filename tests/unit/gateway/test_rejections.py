"""Refused requests count against their key (issue 38: a request refused by validation cost 0.2-0.3 s of
gateway CPU, was never charged and never rate-limited). Against the real app and the real Redis: past the
limit, the key's requests get 429 before their body is read, whatever the body; other keys are served; the
count is shared by every gateway replica. A 404 for a model or adapter not loaded yet is not the client's
mistake and counts nothing (nor do 429 and 503)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tandem.common.errors import BackendUnavailableError, InvalidRequestError, TandemError
from tandem.gateway.api.errors import ModelNotFoundError, RequestTooLargeError, api_error_from
from tandem.gateway.errors import PermissionDeniedError, RateLimitedError, ShuttingDownError, StorageQuotaExceededError
from tandem.gateway.redis_client import connect
from tandem.gateway.tenancy.auth import Principal
from tandem.gateway.tenancy.models import Tenant
from tandem.gateway.tenancy.rejections import RejectionLimiter, counts_against_key

MODEL = "SmolLM2-135M-Instruct"
LIMIT = 5

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    return {"auth": {"max_rejected_requests_per_minute": LIMIT}}


def _too_long() -> dict[str, Any]:
    """Refused: over the test gateway's body limit (64 KiB)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40_000}], "max_tokens": 4}


async def test_a_key_that_keeps_sending_refused_requests_is_refused_cheaply(edge: Any) -> None:
    if time.time() % 60 > 55:  # the count starts again each minute: keep the test inside one
        time.sleep(60 - time.time() % 60 + 0.1)
    bad = await edge.tenant("noisy")
    good = await edge.tenant("quiet")
    for _ in range(LIMIT):
        refused = await edge.client.post("/v1/chat/completions", json=_too_long(), headers=_bearer(bad))
        assert refused.status_code in (400, 413), refused.text
    # Over the limit: 429, before the body is even read (a valid request is refused the same).
    for body in (_too_long(), {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}):
        limited = await edge.client.post("/v1/chat/completions", json=body, headers=_bearer(bad))
        assert limited.status_code == 429, limited.text
        error = limited.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "invalid requests" in error["message"], error
        assert 1 <= int(limited.headers["retry-after"]) <= 60
    assert edge.prefill.prefill_requests == []
    ok = await edge.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers=_bearer(good),
    )
    assert ok.status_code == 200, ok.text


async def test_polling_for_an_adapter_not_loaded_yet_is_never_limited_and_bad_requests_still_are(
    edge: Any,
) -> None:
    """A client waiting for an adapter an operator is rolling out asks for it until it is there: 404
    ``model_not_found`` each time, many times the limit, and then it is served. Those 404s counted nothing:
    the key still gets exactly LIMIT malformed requests before its 429."""
    if time.time() % 60 > 45:
        time.sleep(60 - time.time() % 60 + 0.1)
    key = await edge.tenant("rollout")
    body = {"model": "acme-next", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for _ in range(3 * LIMIT):
        missing = await edge.client.post("/v1/chat/completions", json=body, headers=_bearer(key))
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", missing.text
    loaded = await edge.client.post(
        "/v1/admin/adapters", json={"name": "acme-next", "path": "/adapters/next"}, headers=_bearer(edge.admin_key)
    )
    assert loaded.status_code == 200, loaded.text
    deadline = time.monotonic() + 5.0  # the gateway reads the adapter catalog at most once a second
    while (
        served := await edge.client.post("/v1/chat/completions", json=body, headers=_bearer(key))
    ).status_code == 404:
        assert time.monotonic() < deadline, served.text
    assert served.status_code == 200, served.text
    for _ in range(LIMIT):
        refused = await edge.client.post("/v1/chat/completions", json=_too_long(), headers=_bearer(key))
        assert refused.status_code in (400, 413), refused.text
    limited = await edge.client.post("/v1/chat/completions", json=body, headers=_bearer(key))
    assert limited.status_code == 429 and "invalid requests" in limited.json()["error"]["message"], limited.text


@pytest.mark.parametrize(
    ("error", "counted"),
    [
        (InvalidRequestError("bad", code="invalid_value"), True),
        (RequestTooLargeError("big", code="request_too_large"), True),
        (PermissionDeniedError("no", code="model_not_allowed"), True),
        (StorageQuotaExceededError("full"), True),
        (ModelNotFoundError("none", code="model_not_found"), False),
        (RateLimitedError("slow", kind="tokens", retry_after_s=1, headers={}), False),
        (ShuttingDownError("bye"), False),
        (BackendUnavailableError("redis"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_what_counts_as_an_invalid_request(error: TandemError, counted: bool) -> None:
    """By the status each error answers with (api_error_from): 400, 413 and 403 count; 404, 429 and 503 don't."""
    assert counts_against_key(error) is counted
    assert api_error_from(error).status_code in ((400, 403, 413) if counted else (404, 429, 503))


async def test_the_count_is_shared_by_every_replica(edge: Any) -> None:
    """Two limiters (two gateway replicas) over one Redis: the key goes over the limit on the replica that
    refuses it next, after LIMIT refusals in all, not LIMIT on each."""
    if time.time() % 60 > 55:
        time.sleep(60 - time.time() % 60 + 0.1)
    client = connect("redis://127.0.0.1:6379/0", timeout_s=2.0)
    try:
        replicas = [RejectionLimiter(client, key_prefix=edge.key_prefix, limit_per_minute=LIMIT) for _ in range(2)]
        principal = Principal(Tenant(id="shared"), key_id="k1")
        for i in range(LIMIT - 1):
            await replicas[i % 2].count(principal)
            replicas[0].check(principal)
            replicas[1].check(principal)
        await replicas[1].count(principal)  # the LIMIT-th refusal, on replica 1
        with pytest.raises(Exception, match="Too many invalid requests"):
            replicas[1].check(principal)
        replicas[0].check(principal)  # replica 0 learns it at its own next refusal ...
        await replicas[0].count(principal)
        with pytest.raises(Exception, match="Too many invalid requests"):
            replicas[0].check(principal)  # ... and refuses from then on
        other = Principal(Tenant(id="shared"), key_id="k2")
        replicas[0].check(other)  # another key of the same tenant is not affected
    finally:
        await client.aclose()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
