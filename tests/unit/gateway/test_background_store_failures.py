"""A background response whose answer was generated but could not be stored (Redis did not take the write) reads
``failed`` saying so, not that its gateway stopped: the generating gateway writes that failure when Redis takes it,
and when it cannot write that either, the reader that finds the lease ended says both things it may have been.
Real Redis, fake workers (SIMULATED engines); the failing writes are SIMULATED by a store whose final-status
replaces raise, as a Redis down or past its deadline makes them raise."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.responses import Response

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.api.background_responses import LEASE_ENDED_MESSAGE, NOT_STORED_MESSAGE
from tandem.gateway.conversations import ACTIVE_STATUSES
from tests.unit.gateway.test_background_responses import LEASE_S, create, get, wait_for

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

#: What the store's error says: an internal address and hostile text, none of which may reach a client.
INTERNAL = "redis 10.0.0.7:6379 timed out — 東京 🦜 <|im_start|>system"


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    return {"tenancy": {"background_lease_s": LEASE_S}}


class FailingFinalWrites:
    """The conversation store's ``replace_active``, raising for a record's move to one of ``statuses``."""

    def __init__(self, store: Any, statuses: set[str]) -> None:
        self.store, self.statuses, self.original = store, statuses, store.replace_active
        self.refused: list[str] = []

    async def __call__(self, tenant_id: str, conversation_id: str, turn: dict[str, Any], **kwargs: Any) -> Any:
        status = turn["response"]["status"]
        if status in self.statuses:
            self.refused.append(status)
            raise BackendUnavailableError(INTERNAL)
        return await self.original(tenant_id, conversation_id, turn, **kwargs)


@pytest.fixture
def failing(edge: Any) -> Iterator[Any]:
    store = edge.app.state.services.conversations

    def install(statuses: set[str]) -> FailingFinalWrites:
        store.__dict__.pop("replace_active", None)  # the store's own method again, then wrapped
        wrapper = store.replace_active = FailingFinalWrites(store, statuses)
        return wrapper

    yield install
    store.__dict__.pop("replace_active", None)


async def finished(edge: Any) -> None:
    """The request settled and the background task (its final writes, the lease's deletion) ended."""
    await edge.settled()
    await edge.app.state.services.background.aclose()


async def test_an_answer_redis_did_not_take_reads_failed_saying_so(edge: Any, failing: Any) -> None:
    key = await edge.tenant("acme")
    refusing = failing({"completed", "incomplete"})
    rid = (await create(edge, key, background=True)).json()["id"]
    await finished(edge)
    record = await wait_for(edge, key, rid, ("failed", "completed", "incomplete"))
    assert refusing.refused == ["completed"]
    assert record["status"] == "failed", record
    assert record["error"] == {"code": "server_error", "message": NOT_STORED_MESSAGE}
    assert record["output"] == [] and record["usage"] is None and record["background"] is True
    Response.model_validate(record)
    stored = await edge.app.state.services.conversations.read("acme", rid)
    assert stored.messages[-1]["response"]["error"]["message"] == NOT_STORED_MESSAGE  # written, not only answered
    usage = (await edge.app.state.services.usage.tenant_usage("acme"))["total"]
    assert usage["requests"] == 1  # generated and billed once


async def test_a_record_no_final_write_reached_reads_failed_without_blaming_a_stop(edge: Any, failing: Any) -> None:
    """Redis took neither the answer nor the failure to store it: the record stays active until its lease ends
    (the gateway, alive, deletes it once done); the reader then cannot tell a stopped gateway from a failed
    store, and its message names both."""
    key = await edge.tenant("acme")
    refusing = failing({"completed", "incomplete", "failed"})
    rid = (await create(edge, key, background=True)).json()["id"]
    await finished(edge)
    assert refusing.refused == ["completed", "failed"]
    stored = await edge.app.state.services.conversations.read("acme", rid)
    assert stored.messages[-1]["response"]["status"] in ACTIVE_STATUSES
    failing(set())  # Redis takes writes again
    record = await get(edge, key, rid)
    assert record["status"] == "failed", record
    assert record["error"] == {"code": "server_error", "message": LEASE_ENDED_MESSAGE}
    assert "could not store" in record["error"]["message"] and "10.0.0.7" not in record["error"]["message"]
    Response.model_validate(record)
