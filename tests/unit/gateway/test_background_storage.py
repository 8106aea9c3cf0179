"""A background response's record moves under its tenant's own storage limit, not the gateway's default:
each status write (in progress, cancelled) is an append under the byte budget that evicts the tenant's least
recently used stored items when over it, so the wrong limit would delete what the tenant is allowed to keep.
Real Redis, fake workers (SIMULATED engines)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.gateway.test_background_responses import create, get, slow, wait_for
from tests.unit.gateway.test_response_chains import bearer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

#: The gateway's default per-tenant limit here: below one stored response and one background record.
DEFAULT_BYTES = 2000


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    return {"tenancy": {"background_lease_s": 1.0, "default_max_stored_bytes_per_tenant": DEFAULT_BYTES}}


async def test_status_writes_keep_the_tenants_own_limit(edge: Any) -> None:
    key = await edge.tenant("acme", max_stored_bytes=1_000_000)
    kept = await create(edge, key)
    assert kept.status_code == 200, kept.text
    slow(edge)
    rid = (await create(edge, key, background=True, max_output_tokens=40)).json()["id"]
    assert (await wait_for(edge, key, rid, ("in_progress",)))["status"] == "in_progress"
    cancelled = await edge.client.post(f"/v1/responses/{rid}/cancel", headers=bearer(key))
    assert cancelled.json()["status"] == "cancelled"
    num_bytes, num_items = await edge.app.state.services.conversations.stored("acme")
    assert num_bytes > DEFAULT_BYTES and num_items == 2
    assert (await get(edge, key, kept.json()["id"]))["status"] == "completed"  # not evicted
    await edge.settled()
