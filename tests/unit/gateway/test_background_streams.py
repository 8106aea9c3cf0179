"""Streamed background responses (``background: true, stream: true``) and their resume
(``GET /v1/responses/{id}?stream=true&starting_after=N``) on the gateway with auth on, real Redis, a real HTTP
server where a client drops its stream, the real ``openai`` SDK, and fake workers (SIMULATED engines:
tests/kit/gateway's scripted workers and router). The events are stored as they go (tandem.gateway.api
.response_events); a resume replays them after N and follows the live ones; the create's client going away does
not cancel; the tenant's byte budget bounds the stored events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from tandem.gateway.api.background_responses import LEASE_ENDED_MESSAGE
from tandem.gateway.api.response_chains import answer_turn
from tandem.gateway.api.response_events import HEADER, TRUNCATED
from tests.kit.gateway import MODEL
from tests.unit.gateway.test_background_responses import LEASE_S, TEXT, create, get, slow, wait_for
from tests.unit.gateway.test_response_chains import INSTRUCTIONS, bearer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    return {"tenancy": {"background_lease_s": LEASE_S}}


def parse(text: str) -> list[dict[str, Any]]:
    """The events of an SSE body (heartbeats skipped); each one's ``event:`` name must be its ``type``."""
    events = []
    for frame in text.split("\n\n"):
        lines = [line for line in frame.split("\n") if line]
        if not lines:
            continue
        name = lines[0].removeprefix("event: ")
        payload = json.loads(lines[1].removeprefix("data: "))
        assert payload["type"] == name, frame
        events.append(payload)
    return events


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def numbers(events: list[dict[str, Any]]) -> list[int]:
    return [e["sequence_number"] for e in events]


def request(**body: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": 8, "input": TEXT, "instructions": INSTRUCTIONS, **body}


async def resume(edge: Any, key: str, rid: str, starting_after: str | int | None = None) -> httpx.Response:
    params: dict[str, Any] = {"stream": "true"}
    if starting_after is not None:
        params["starting_after"] = starting_after
    return await edge.client.get(f"/v1/responses/{rid}", params=params, headers=bearer(key))


async def test_events_are_stored_and_a_resume_replays_from_any_point(edge: Any) -> None:
    key = await edge.tenant("acme")
    foreground = (await create(edge, key)).json()
    created = await create(edge, key, background=True, stream=True)
    assert created.status_code == 200, created.text
    assert created.headers["content-type"].startswith("text/event-stream")
    events = parse(created.text)
    rid = created.headers["x-request-id"]
    assert numbers(events) == list(range(len(events))) and len(events) > 6
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["id"] == rid
    assert events[-1]["response"]["background"] is True
    assert text_of(events) == foreground["output"][0]["content"][0]["text"] == "Hello world!"
    record = await get(edge, key, rid)
    assert record["status"] == "completed" and record["output"] == events[-1]["response"]["output"]
    # Stored as they were sent, after the header, in the tenant's namespace.
    log = edge.app.state.services.background._events
    stored = await log.read("acme", rid, 0)
    assert stored[0] == HEADER and [json.loads(f.split("\ndata: ")[1]) for f in stored[1:]] == events
    # A resume of a final response replays and ends, from anywhere.
    for after in (None, 0, 3, len(events) - 2, len(events) - 1):
        replay = await resume(edge, key, rid, after)
        assert replay.status_code == 200, replay.text
        first = 0 if after is None else after + 1
        assert parse(replay.text) == events[first:], after
    # The account counts the events, and a DELETE takes them with the record.
    account = await edge.redis.hgetall(f"{edge.key_prefix}:gw:stored:acme")
    assert int(account[f"events:{rid}"]) > sum(len(f.encode()) for f in stored)
    assert (await edge.client.delete(f"/v1/responses/{rid}", headers=bearer(key))).status_code == 200
    assert await log.read("acme", rid, 0) == []
    account = await edge.redis.hgetall(f"{edge.key_prefix}:gw:stored:acme")
    assert f"events:{rid}" not in account
    await edge.settled()


@pytest.mark.parametrize(
    "after",
    ["-1", "abc", "1.5", "", "٣", "9" * 5000, "1e3", " 1", "0x1", "12 ; DROP", "🙂", "1000000"],
)
async def test_bad_starting_after_is_400(edge: Any, after: str) -> None:
    key = await edge.tenant("acme")
    rid = (await create(edge, key, background=True, stream=True)).headers["x-request-id"]
    answer = await resume(edge, key, rid, after)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "starting_after" and error["code"] == "invalid_value"
    assert error["type"] == "invalid_request_error" and "Traceback" not in error["message"]
    assert len(error["message"]) < 300
    await edge.settled()


async def test_resume_is_refused_where_it_cannot_be_served(edge: Any) -> None:
    key = await edge.tenant("acme")
    other = await edge.tenant("rival")
    streamed = (await create(edge, key, background=True, stream=True)).headers["x-request-id"]
    polled = (await create(edge, key, background=True)).json()["id"]
    foreground = (await create(edge, key)).json()["id"]
    for rid in (polled, foreground):  # created without background and stream: nothing stored to replay
        refused = await resume(edge, key, rid)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream", refused.text
    refused = await edge.client.get(f"/v1/responses/{streamed}?stream=yes", headers=bearer(key))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
    hidden = await resume(edge, other, streamed, 0)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "response_not_found"
    plain = await edge.client.get(f"/v1/responses/{streamed}?stream=false", headers=bearer(key))
    assert plain.status_code == 200 and plain.json()["status"] == "completed"
    await edge.settled()


async def test_a_dropped_create_stream_runs_on_and_a_resume_follows_it_live(edge: Any, edge_url: str) -> None:
    """The create's client reads a few events and closes its connection (a real HTTP server sees it go); the
    generation is not cancelled, and a resume after the last event it read follows the rest as it comes."""
    key = await edge.tenant("acme")
    slow(edge, num_steps=30, delay_s=0.05)
    seen: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient(base_url=edge_url, timeout=30) as client,
        client.stream("POST", "/v1/responses", json=request(background=True, stream=True, max_output_tokens=40),
                      headers=bearer(key)) as created,
    ):  # fmt: skip
        rid = created.headers["x-request-id"]
        buffer = ""
        async for chunk in created.aiter_text():
            buffer += chunk
            *frames, buffer = buffer.split("\n\n")
            seen += parse("\n\n".join(frames))
            if len(seen) >= 6:
                break
    assert numbers(seen) == list(range(len(seen)))
    assert (await get(edge, key, rid))["status"] == "in_progress"
    live = await resume(edge, key, rid, seen[-1]["sequence_number"])
    rest = parse(live.text)
    assert rest[-1]["type"] == "response.incomplete", rest[-1]
    assert numbers(seen + rest) == list(range(len(seen) + len(rest)))
    final = rest[-1]["response"]
    assert text_of(seen + rest) == final["output"][0]["content"][0]["text"] == "Hello" + " mot" * 29 + "."
    assert not edge.decode.decode_cancelled.is_set()
    await edge.settled()
    assert (await get(edge, key, rid)) == final
    usage = (await edge.app.state.services.usage.tenant_usage("acme"))["total"]
    assert usage["requests"] == 1 and usage["aborted_requests"] == 0


async def test_a_cancel_ends_the_create_stream_and_its_resumes_with_cancelled(edge: Any) -> None:
    key = await edge.tenant("acme")
    slow(edge)
    create_task = asyncio.create_task(create(edge, key, background=True, stream=True, max_output_tokens=40))
    rid = ""
    for _ in range(500):
        ids = [k for k in edge.app.state.services.background._cancels]
        if ids:
            rid = ids[0]
            break
        await asyncio.sleep(0.01)
    assert (await wait_for(edge, key, rid, ("in_progress",)))["status"] == "in_progress"
    cancelled = await edge.client.post(f"/v1/responses/{rid}/cancel", headers=bearer(key))
    assert cancelled.json()["status"] == "cancelled"
    events = parse((await create_task).text)
    assert events[-1]["type"] == "response.cancelled" and events[-1]["response"] == cancelled.json()
    assert numbers(events) == list(range(len(events)))
    replay = parse((await resume(edge, key, rid, 1)).text)
    assert replay == events[2:]
    await asyncio.wait_for(edge.decode.decode_cancelled.wait(), 5)
    await edge.settled()


async def test_a_resume_of_a_dead_gateways_stream_ends_failed_after_the_lease(edge: Any) -> None:
    """SIMULATED dead gateway: a streamed record and its first events written as its gateway writes them, with
    no lease (as once the dead gateway's lease ended). The resume replays them, then ends with the ``failed``
    record that GET answers."""
    key = await edge.tenant("acme")
    created = await create(edge, key, background=True, stream=True)
    rid = created.headers["x-request-id"]
    head = [f for f in created.text.split("\n\n") if f][:4]
    orphan_id = "resp_orphanstream01"
    queued = {**(await get(edge, key, rid)), "id": orphan_id, "status": "in_progress", "output": [], "usage": None}
    services = edge.app.state.services
    log = services.background._events
    assert await log.append("acme", orphan_id, [HEADER, *head], tenant_salt="", limit_bytes=10**6, reserve_bytes=0)
    await services.conversations.append("acme", orphan_id, [{"role": "user", "content": TEXT}, answer_turn(queued)])
    answer = await resume(edge, key, orphan_id, 1)
    events = parse(answer.text)
    assert numbers(events) == [2, 3, 4] and events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == LEASE_ENDED_MESSAGE
    assert events[-1]["response"] == await get(edge, key, orphan_id)
    await edge.settled()


async def test_events_past_the_byte_budget_are_not_stored_and_the_answer_is(edge: Any) -> None:
    """A tenant whose storage limit holds the record and its answer but not every event: the create's own stream
    is whole, the stored list stops at the budget with its mark, the account stays under the limit, the
    answer is stored, and a resume ends with a clear error after the stored events."""
    limit_bytes = 6000
    key = await edge.tenant("acme", max_stored_bytes=limit_bytes)
    slow(edge, num_steps=40, delay_s=0.0)
    created = await create(edge, key, background=True, stream=True, max_output_tokens=40)
    assert created.status_code == 200, created.text
    events = parse(created.text)
    rid = created.headers["x-request-id"]
    assert events[-1]["type"] == "response.incomplete" and numbers(events) == list(range(len(events)))
    await edge.settled()
    stored = await edge.app.state.services.background._events.read("acme", rid, 0)
    assert stored[-1] == TRUNCATED and 3 < len(stored) - 2 < len(events), len(stored)
    num_bytes, _ = await edge.app.state.services.conversations.stored("acme")
    assert num_bytes <= limit_bytes
    assert (await get(edge, key, rid))["output"] == events[-1]["response"]["output"]
    replay = parse((await resume(edge, key, rid, 0)).text)
    assert replay[:-1] == events[1 : len(stored) - 2]
    assert replay[-1]["type"] == "error" and replay[-1]["code"] == "storage_quota_exceeded"
    assert replay[-1]["sequence_number"] == len(stored) - 2
    late = parse((await resume(edge, key, rid, len(events) - 2)).text)  # the client saw more than was stored
    assert [e["type"] for e in late] == ["error"] and late[0]["sequence_number"] == len(events) - 1


async def test_sdk_drops_a_background_stream_and_resumes_it(edge: Any, edge_url: str) -> None:
    """The ``openai`` SDK's own calls: ``create(background=True, stream=True)`` read for a few events and closed,
    then ``retrieve(id, stream=True, starting_after=N)``: exactly the rest, contiguous, every event parsed into the
    SDK's types, and the text of the same request answered without interruption."""
    key = await edge.tenant("acme")
    client = openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0)
    slow(edge, num_steps=25, delay_s=0.04)
    whole = await client.responses.create(model=MODEL, input=TEXT, max_output_tokens=40, store=False)
    stream = await client.responses.create(model=MODEL, input=TEXT, max_output_tokens=40, background=True, stream=True)
    seen = []
    async for event in stream:
        seen.append(event)
        if len(seen) == 5:
            break
    await stream.close()
    rid = seen[0].response.id  # type: ignore[union-attr]
    resumed = await client.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number)
    rest = [event async for event in resumed]
    every = seen + rest
    assert [e.sequence_number for e in every] == list(range(len(every)))
    assert rest[0].sequence_number == 5 and rest[-1].type == "response.incomplete"
    text = "".join(e.delta for e in every if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == whole.output_text  # type: ignore[union-attr]
    assert (await client.responses.retrieve(rid)).output_text == whole.output_text
    await edge.settled()


async def test_a_resume_through_another_replica_follows_the_generating_one(
    edge: Any, edge_url: str, prompt_tokenizer: Any
) -> None:
    """The create streams from one gateway; a second gateway over the same Redis (its own app, no shared
    memory) resumes it while it generates, and gets the rest as the first one stores it."""
    from tests.unit.gateway.conftest import second_replica

    key = await edge.tenant("acme")
    slow(edge, num_steps=30, delay_s=0.05)
    seen: list[dict[str, Any]] = []
    body = request(background=True, stream=True, max_output_tokens=40)
    async with (
        httpx.AsyncClient(base_url=edge_url, timeout=30) as client,
        client.stream("POST", "/v1/responses", json=body, headers=bearer(key)) as created,
    ):
        rid = created.headers["x-request-id"]
        buffer = ""
        async for chunk in created.aiter_text():
            buffer += chunk
            *frames, buffer = buffer.split("\n\n")
            seen += parse("\n\n".join(frames))
            if len(seen) >= 4:
                break
    async with second_replica(edge, prompt_tokenizer, background_lease_s=LEASE_S) as other:
        assert (await other.get(f"/v1/responses/{rid}", headers=bearer(key))).json()["status"] == "in_progress"
        params = {"stream": "true", "starting_after": seen[-1]["sequence_number"]}
        rest = parse((await other.get(f"/v1/responses/{rid}", params=params, headers=bearer(key))).text)
    assert numbers(seen + rest) == list(range(len(seen) + len(rest)))
    assert rest[-1]["type"] == "response.incomplete"
    assert text_of(seen + rest) == rest[-1]["response"]["output"][0]["content"][0]["text"]
    await edge.settled()
