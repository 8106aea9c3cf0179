"""What happens around a request: retries, errors before and after the stream
starts, client disconnects, and the cleanup (Release, Abort) that must follow."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import httpx
import pytest

from tandem.common.errors import BackendUnavailableError, NoCapacityError
from tandem.v1 import router_pb2
from tests.kit.gateway import DecodeStep

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

MODEL = "SmolLM2-135M-Instruct"


def chat_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 8,
        **extra,
    }


async def test_client_disconnect_cancels_decode_and_cleans_up(stack: Any, live_url: str, wait: Any) -> None:
    stack.decode.decode_hang_after = 1  # " world", then the decode stalls until cancelled
    async with httpx.AsyncClient(base_url=live_url, timeout=10) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
            assert response.status_code == 200
            seen: list[str] = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:])["choices"][0]["delta"].get("content", ""))
                if len(seen) == 3:  # role chunk, "Hello", " world"
                    break
            assert seen == ["", "Hello", " world"]
            closed_at_s = time.monotonic()
    # Leaving the block closes the connection mid-stream.
    await wait(stack.decode.decode_cancelled, 2.0)
    assert time.monotonic() - closed_at_s < 1.5
    await wait(stack.decode.aborted_event)
    await wait(stack.prefill.aborted_event)
    await wait(stack.router.released_event)
    request_id = stack.decode.decode_requests[0].request_id
    assert stack.decode.aborted == [request_id]
    assert stack.prefill.aborted == [request_id]
    assert stack.router.released == [request_id]
    for _ in range(100):
        if stack.metrics.registry.get_sample_value("tandem_gateway_in_flight_requests") == 0:
            break
        await asyncio.sleep(0.01)
    assert stack.metrics.registry.get_sample_value("tandem_gateway_in_flight_requests") == 0
    assert (
        stack.metrics.registry.get_sample_value(
            "tandem_gateway_requests_total", {"endpoint": "/v1/chat/completions", "status": "499"}
        )
        == 1.0
    )


async def test_client_disconnect_during_non_stream_request_cleans_up(stack: Any, live_url: str, wait: Any) -> None:
    stack.decode.decode_hang_after = 1
    async with httpx.AsyncClient(base_url=live_url, timeout=10) as client:
        task = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body()))
        for _ in range(200):
            if stack.decode.decode_requests:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()  # httpx closes the connection
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait(stack.decode.decode_cancelled, 2.0)
    await wait(stack.prefill.aborted_event)
    await wait(stack.router.released_event)


async def test_prefill_unavailable_is_retried_once_elsewhere(
    stack: Any, start_worker: Any, make_placement: Any, free_dead_address: str, wait: Any
) -> None:
    dead = router_pb2.WorkerRef(worker_id="prefill-dead", role="prefill", address=free_dead_address)
    stack.router.placements[:] = [
        make_placement(dead, stack.decode),
        make_placement(stack.prefill, stack.decode),
    ]
    response = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello world!"
    first, second = stack.router.schedule_calls
    assert first["exclude_worker_ids"] == []
    assert second["exclude_worker_ids"] == ["prefill-dead"]
    assert first["request_id"] == second["request_id"]
    # The prompt was hashed once; the retry sends the same hashes.
    assert first["prompt_block_hashes"] and first["prompt_block_hashes"] == second["prompt_block_hashes"]
    assert stack.hasher.num_hashed == 1
    await wait(stack.router.released_event)
    for _ in range(100):
        if len(stack.router.released) == 2:
            break
        await asyncio.sleep(0.01)
    # Once for the abandoned placement, once at the end.
    assert stack.router.released == [first["request_id"]] * 2


#: A decoded tail of accents, an emoji and CJK, split across chunks as an engine streams them.
NON_ASCII_STEPS = [
    DecodeStep(" café", [102]),
    DecodeStep(" 🌍", [103, 104]),
    DecodeStep(" 世界", [105], "stop"),
]


async def test_decode_unavailable_before_its_first_token_is_placed_once_more(
    stack: Any, free_dead_address: str, wait: Any
) -> None:
    """A decode worker that died between requests (registration not yet expired): the prefill worker
    still holds the KV, so the decode goes to another decode worker and the client sees nothing. The
    second Schedule is decode-only (it names the prefill worker that holds the KV) and replaces the
    first one's reservation: nothing is released between the two."""
    dead = router_pb2.WorkerRef(worker_id="decode-dead", role="decode", address=free_dead_address)
    other_prefill = router_pb2.WorkerRef(worker_id="prefill-other", role="prefill", address=free_dead_address)
    stack.router.placements[:] = [
        router_pb2.Placement(prefill=stack.prefill.ref("prefill"), decode=dead, lease_s=30.0),
        # Should the router name another prefill worker, the KV is still where it was computed.
        router_pb2.Placement(prefill=other_prefill, decode=stack.decode.ref("decode"), lease_s=30.0),
    ]
    stack.decode.decode_steps = NON_ASCII_STEPS
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200
    body = response.content.decode()
    assert '"error"' not in body and body.endswith("data: [DONE]\n\n")
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hello café 🌍 世界"

    first, second = stack.router.schedule_calls
    request_id = first["request_id"]
    assert first["prefill_done_on_worker_id"] == "" and first["exclude_worker_ids"] == []
    assert second["request_id"] == request_id
    assert second["prefill_done_on_worker_id"] == "prefill-0"  # decode-only: the KV is there
    assert second["exclude_worker_ids"] == ["decode-dead"]
    # The prompt was hashed once; the decode-only Schedule sends the same hashes.
    assert first["prompt_block_hashes"] and second["prompt_block_hashes"] == first["prompt_block_hashes"]
    assert stack.hasher.num_hashed == 1

    (prefill_request,) = stack.prefill.prefill_requests  # the KV stays where it was computed
    (decode_request,) = stack.decode.decode_requests
    assert decode_request.request_id == request_id  # which names the KV on the KV path
    # The handle the first (and only) prefill returned.
    assert decode_request.kv_handle.engine_id == "prefill-0"
    assert list(decode_request.kv_handle.block_ids) == [7, 8]
    assert decode_request.kv_handle.num_tokens == len(prefill_request.prompt_token_ids)
    assert (decode_request.first_token_id, decode_request.first_text) == (101, "Hello")
    assert not decode_request.local_prefill

    await wait(stack.router.released_event)
    await asyncio.sleep(0.05)  # a second Release, were there one, would have come by now
    # No Release between the two Schedules; exactly one, at the end.
    assert stack.router.calls == [("schedule", request_id), ("schedule", request_id), ("release", request_id)]
    assert stack.prefill.aborted == []  # completed: nothing to abort
    sample = stack.metrics.registry.get_sample_value
    assert sample("tandem_gateway_worker_retries_total", {"role": "decode"}) == 1
    assert not sample("tandem_gateway_worker_retries_total", {"role": "prefill"})


async def test_a_refused_decode_replacement_releases_once_and_frees_the_kv(
    stack: Any, free_dead_address: str, wait: Any
) -> None:
    """The decode-only Schedule is refused (no decode worker has budget): the request ends with an
    error event, its reservation is released once, and the prefill worker is told to drop the KV it
    holds rather than keep it until its lease runs out."""
    dead = router_pb2.WorkerRef(worker_id="decode-dead", role="decode", address=free_dead_address)
    stack.router.placements[:] = [router_pb2.Placement(prefill=stack.prefill.ref("prefill"), decode=dead)]
    schedule = stack.router.schedule

    async def refuse_the_second(*args: Any, **kwargs: Any) -> router_pb2.Placement:
        placement: router_pb2.Placement = await schedule(*args, **kwargs)
        if len(stack.router.schedule_calls) > 1:
            raise NoCapacityError("no decode worker has budget", retry_after_s=1)
        return placement

    stack.router.schedule = refuse_the_second
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200  # the first token was already sent
    assert '"no_capacity"' in response.text and response.text.endswith("data: [DONE]\n\n")
    await wait(stack.prefill.aborted_event)
    await wait(stack.router.released_event)
    await asyncio.sleep(0.05)
    (request_id,) = stack.prefill.aborted
    assert stack.router.schedule_calls[1]["prefill_done_on_worker_id"] == "prefill-0"
    assert stack.router.calls == [("schedule", request_id), ("schedule", request_id), ("release", request_id)]


async def test_decode_unavailable_past_the_migration_limit_is_a_final_error_event(
    stack: Any, free_dead_address: str
) -> None:
    """Every decode worker the router names is dead: one replacement that keeps the prefill worker's KV,
    then the stream migrates (decode-only, resuming after the first token) up to the limit (3), then the
    client gets the error event."""
    dead = router_pb2.WorkerRef(worker_id="decode-dead", role="decode", address=free_dead_address)
    stack.router.placements[:] = [router_pb2.Placement(prefill=stack.prefill.ref("prefill"), decode=dead)]
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200  # the first token was already sent
    assert '"worker_unavailable"' in response.text and response.text.endswith("data: [DONE]\n\n")
    assert len(stack.router.schedule_calls) == 1 + 1 + 3
    assert stack.router.schedule_calls[1]["prefill_done_on_worker_id"] == "prefill-0"
    for call in stack.router.schedule_calls[2:]:
        assert call["local_prefill_only"] and "decode-dead" in call["exclude_worker_ids"], call


async def test_client_gone_while_the_router_places_releases_the_placement(stack: Any, live_url: str, wait: Any) -> None:
    """The router reserves a pair for a request whose client has already left: the reservation is
    released as soon as the placement arrives, not held until its lease runs out."""
    stack.router.schedule_delay_s = 0.5
    async with httpx.AsyncClient(base_url=live_url) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=chat_body(stream=True), timeout=0.1)
    await wait(stack.router.released_event, 3.0)
    assert stack.router.released == [stack.router.schedule_calls[0]["request_id"]]
    assert stack.prefill.prefill_requests == []  # nothing ran on the workers


async def test_a_restarting_router_makes_requests_wait_not_fail(
    start_worker: Any, fake_router: Any, prompt_tokenizer: Any, make_placement: Any
) -> None:
    """The router is unreachable for a moment (a replica restarting): the request waits and is served."""
    from tandem.gateway.app import build_app
    from tests.kit.gateway import FakeReadiness

    from .conftest import gateway_settings

    prefill, decode = await start_worker("p"), await start_worker("d")
    fake_router.placements.append(make_placement(prefill, decode))
    fake_router.fail_first = [BackendUnavailableError("router unavailable: UNAVAILABLE")] * 3
    app = build_app(
        gateway_settings(router_unavailable_wait_s=10.0),
        router=fake_router,
        tokenizer=prompt_tokenizer,
        readiness=FakeReadiness(),
    )
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client,
        app.router.lifespan_context(app),
    ):
        response = await client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200, response.text
    assert len(fake_router.schedule_calls) == 4
    assert len({c["request_id"] for c in fake_router.schedule_calls}) == 1  # the same request, asked again


async def test_prefill_unavailable_twice_is_503(stack: Any, wait: Any) -> None:
    stack.prefill.prefill_error = grpc.StatusCode.UNAVAILABLE
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "worker_unavailable"
    assert len(stack.router.schedule_calls) == 2
    assert len(stack.prefill.prefill_requests) == 2
    await wait(stack.router.released_event)


async def test_prefill_invalid_argument_is_400_not_retried(stack: Any) -> None:
    stack.prefill.prefill_error = grpc.StatusCode.INVALID_ARGUMENT
    response = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert len(stack.router.schedule_calls) == 1


@pytest.mark.parametrize(
    ("error", "code", "retry_after"),
    [
        (NoCapacityError("all workers busy", retry_after_s=2.5), "no_capacity", "3"),
        (BackendUnavailableError("router down"), "backend_unavailable", "1"),
    ],
)
async def test_router_refusal_is_503_with_retry_after(
    stack: Any, error: Exception, code: str, retry_after: str
) -> None:
    stack.router.error = error
    for stream in (False, True):
        response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=stream))
        assert response.status_code == 503
        assert response.headers["retry-after"] == retry_after
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == code
        assert response.json()["error"]["type"] == "server_error"
    assert stack.prefill.prefill_requests == []
    assert stack.router.released == []  # nothing was placed


async def test_decode_failure_after_stream_started_is_a_final_error_event(stack: Any, wait: Any) -> None:
    stack.decode.decode_fail_after = 1
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200
    blocks = response.content.decode().split("\n\n")
    assert blocks[-1] == ""
    assert blocks[-2] == "data: [DONE]"
    error = json.loads(blocks[-3][len("data: ") :])
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "server_error"
    contents = [json.loads(b[6:])["choices"][0]["delta"].get("content") for b in blocks[:-3]]
    assert contents == ["", "Hello", " world"]
    await wait(stack.decode.aborted_event)
    await wait(stack.prefill.aborted_event)
    await wait(stack.router.released_event)


async def test_decode_failure_non_stream_is_an_error_status(stack: Any, wait: Any) -> None:
    stack.decode.decode_fail_after = 1
    response = await stack.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"
    await wait(stack.prefill.aborted_event)


async def test_decode_stream_ending_without_finish_reason_is_an_error(stack: Any, wait: Any) -> None:
    stack.decode.decode_steps = stack.decode.decode_steps[:1]
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert b'"error"' in response.content
    assert response.content.endswith(b"data: [DONE]\n\n")
    await wait(stack.prefill.aborted_event)


async def test_metrics_observe_each_stage(stack: Any) -> None:
    stack.decode.decode_step_delay_s = 0.01
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200
    metrics = await stack.client.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"tandem_gateway_{name}_bucket" in text
    sample = stack.metrics.registry.get_sample_value
    # By the base model the request ran on (the app's served models bound the label's values).
    by_model = {"model": MODEL}
    assert sample("tandem_gateway_time_to_first_token_seconds_count", by_model) == 1
    assert sample("tandem_gateway_e2e_request_latency_seconds_count", by_model) == 1
    assert sample("tandem_gateway_inter_token_latency_seconds_count", by_model) == 3  # three decoded tokens
    assert sample("tandem_gateway_inter_token_latency_seconds_sum", by_model) >= 0.02
    assert sample("tandem_gateway_requests_total", {"endpoint": "/v1/chat/completions", "status": "200"}) == 1
    assert sample("tandem_gateway_in_flight_requests") == 0
    for stage in ("tokenize", "schedule", "prefill", "decode"):
        assert sample("tandem_gateway_stage_seconds_count", {"stage": stage}) == 1


async def test_readyz_reports_the_check(stack: Any) -> None:
    from tandem.gateway.readiness import ReadinessReport

    response = await stack.client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["status"] == "ready"
    stack.readiness.report = ReadinessReport(True, True, 1, 0, detail="no decode worker")
    response = await stack.client.get("/readyz")
    assert response.status_code == 200  # a pool at zero: ready, the counts in the body
    assert response.json()["num_decode_workers"] == 0 and response.json()["detail"] == "no decode worker"
    stack.readiness.report = ReadinessReport(False, False, 1, 1, detail="router unreachable")
    response = await stack.client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["detail"] == "router unreachable"
    assert (await stack.client.get("/healthz")).status_code == 200


async def test_a_decode_worker_that_dies_mid_stream_is_migrated_and_the_client_sees_one_stream(
    stack: Any, start_worker: Any, wait: Any
) -> None:
    """The decode worker sends " world" and an empty-text token, then answers UNAVAILABLE (its engine
    died). The stream is placed again decode-only without it; the new decode worker computes the prompt,
    resumes after the three tokens the client has (the prefill's first and decode's two) and streams the
    rest. The client sees one stream: no token twice, none missing, one finish, usage billed once."""
    stack.decode.decode_unavailable_after = 2
    survivor = await start_worker(
        "decode-1", decode_steps=[DecodeStep(" 👋", [105]), DecodeStep(" 東京", [106], "length")]
    )
    stack.router.placements.append(
        router_pb2.Placement(decode=survivor.ref("decode"), local_prefill=True, lease_s=30.0)
    )
    response = await stack.client.post(
        "/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True})
    )
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    assert text == "Hello world 👋 東京"
    assert [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")] == ["length"]
    assert not [e for e in events if "error" in e]
    assert events[-1]["usage"]["completion_tokens"] == 1 + 2 + 2
    (resumed,) = survivor.decode_requests
    assert resumed.local_prefill and not resumed.HasField("kv_handle") and not resumed.first_token_id
    assert list(resumed.resume_token_ids) == [101, 102, 103] and resumed.resume_text == "Hello world"
    assert resumed.sampling.max_tokens == 8 and len({e["id"] for e in events}) == 1
    migrate = stack.router.schedule_calls[1]
    assert migrate["local_prefill_only"] and migrate["exclude_worker_ids"] == ["decode-0"]
    assert (
        stack.metrics.registry.get_sample_value(
            "tandem_gateway_migrations_total", {"role": "decode", "reason": "unavailable"}
        )
        == 1
    )
    await wait(stack.prefill.aborted_event)  # its hold, if any is left, is of no use now


async def test_a_decode_stream_that_ends_early_without_an_error_is_migrated_too(
    stack: Any, start_worker: Any, wait: Any
) -> None:
    """A decode stream closed with OK but no finish reason (a proxy cut it, a worker bug) is as good as a
    dead worker's: the stream migrates, reason ``truncated``, and the client sees one whole stream."""
    stack.decode.decode_steps = [DecodeStep(" world", [102])]  # then it just ends
    survivor = await start_worker("decode-1", decode_steps=[DecodeStep(" 👋", [105], "stop")])
    stack.router.placements.append(
        router_pb2.Placement(decode=survivor.ref("decode"), local_prefill=True, lease_s=30.0)
    )
    response = await stack.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", [])) == "Hello world 👋"
    assert not [e for e in events if "error" in e]
    (resumed,) = survivor.decode_requests
    assert list(resumed.resume_token_ids) == [101, 102]
    assert (
        stack.metrics.registry.get_sample_value(
            "tandem_gateway_migrations_total", {"role": "decode", "reason": "truncated"}
        )
        == 1
    )


async def test_migration_off_ends_the_stream_with_the_error_event(
    start_worker: Any, fake_router: Any, prompt_tokenizer: Any, make_placement: Any
) -> None:
    from tandem.gateway.app import build_app
    from tests.kit.gateway import FakeReadiness

    from .conftest import gateway_settings

    prefill, decode = await start_worker("p"), await start_worker("d", decode_unavailable_after=1)
    fake_router.placements.append(make_placement(prefill, decode))
    app = build_app(
        gateway_settings(max_migrations_per_request=0),
        router=fake_router,
        tokenizer=prompt_tokenizer,
        readiness=FakeReadiness(),
    )
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client,
        app.router.lifespan_context(app),
    ):
        response = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200
    assert '"worker_unavailable"' in response.text and response.text.endswith("data: [DONE]\n\n")
    assert '"content":"Hello"' in response.text.replace(" ", "") and "world" in response.text
    assert len(fake_router.schedule_calls) == 1
