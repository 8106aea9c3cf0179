"""Hostile input at the gateway's edge: bodies that are not quite JSON or carry
numbers the wire cannot, and connections that misbehave below HTTP (slow
heads and bodies, huge heads, too many connections). Every one gets a 4xx/5xx
in the OpenAI error shape (or, for a connection that never spoke, a close),
nothing is scheduled, and the server keeps answering everyone else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from tandem.gateway.api.validation import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest
from tandem.gateway.http_server import guarded_protocol
from tandem.gateway.settings import HttpSettings
from tests.kit.net import http_scope, serving, start_stream_then_stop_reading

pytestmark = [pytest.mark.timeout(60)]

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def raw_chat(extra: str) -> bytes:
    """A chat body with ``extra`` spliced in as written (for what json.dumps would refuse to write)."""
    return f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hello"}}], {extra}}}'.encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def assert_openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)
    assert error["message"]


# --- bodies --------------------------------------------------------------------------------------


BODY_CASES = [
    pytest.param(raw_chat('"temperature": NaN'), "invalid_json", None, id="nan-literal"),
    pytest.param(raw_chat('"top_p": Infinity'), "invalid_json", None, id="infinity-literal"),
    pytest.param(raw_chat('"presence_penalty": -Infinity'), "invalid_json", None, id="minus-infinity-literal"),
    pytest.param(raw_chat('"temperature": 1e999'), "invalid_value", "temperature", id="overflowing-float"),
    pytest.param(chat(seed=2**63), "invalid_value", "seed", id="seed-beyond-int64"),
    pytest.param(chat(seed=-(2**63) - 1), "invalid_value", "seed", id="seed-below-int64"),
    pytest.param(chat(top_k=2**31), "invalid_value", "top_k", id="top-k-beyond-int32"),
    pytest.param(chat(top_k=-2), "invalid_value", "top_k", id="top-k-negative"),
    pytest.param(chat(presence_penalty=-2.5), "invalid_value", "presence_penalty", id="penalty-negative"),
    pytest.param(chat(max_tokens=-1), "invalid_value", "max_tokens", id="max-tokens-negative"),
    pytest.param(chat(max_tokens=10**30), "context_length_exceeded", "messages", id="max-tokens-huge"),
    # Issue 38: 2**32 overflowed the wire's uint32 and answered 500.
    pytest.param(chat(min_tokens=2**32), "invalid_value", "min_tokens", id="min-tokens-beyond-uint32"),
    pytest.param(chat(min_tokens=9, max_tokens=4), "invalid_value", "min_tokens", id="min-tokens-beyond-max-tokens"),
    pytest.param(chat(stop=["x"] * 17), "invalid_value", "stop", id="too-many-stop-sequences"),
    pytest.param(chat(messages=[{"role": "user"}] * 2049), "invalid_value", "messages", id="too-many-messages"),
    pytest.param(raw_chat(f'"extra": {nested(MAX_JSON_DEPTH)}'), "invalid_json", None, id="nested-one-level-too-deep"),
    pytest.param(raw_chat(f'"extra": {nested(5000)}'), "invalid_json", None, id="nested-beyond-recursion-limit"),
    pytest.param(b"[" * 60_000, "invalid_json", None, id="unclosed-brackets"),
    pytest.param(raw_chat(r'"stop": ["a\ud800"]'), "invalid_json", None, id="lone-surrogate-escape"),
    pytest.param(raw_chat(r'"x": {"\udfff": 1}'), "invalid_json", None, id="lone-low-surrogate-in-key"),
    pytest.param(raw_chat('"user": "caf?"').replace(b"?", b"\xe9"), "invalid_json", None, id="latin-1"),
    pytest.param(b'{"model": "\xed\xa0\x80"}', "invalid_json", None, id="utf-8-encoded-surrogate"),
    pytest.param(b'{"model": "\xc3"}', "invalid_json", None, id="truncated-utf-8"),
    pytest.param(json.dumps(chat()).encode("utf-16"), "invalid_json", None, id="utf-16"),
    pytest.param(b"\xef\xbb\xbf" + json.dumps(chat()).encode(), "invalid_json", None, id="utf-8-bom"),
    pytest.param(b"null", "invalid_body", None, id="null"),
    pytest.param(b'"hello"', "invalid_body", None, id="string"),
    pytest.param(b"42", "invalid_body", None, id="number"),
]


@pytest.mark.parametrize(("body", "code", "param"), BODY_CASES)
async def test_hostile_body_is_a_400(stack: Any, body: Any, code: str, param: str | None) -> None:
    if isinstance(body, bytes):
        response = await stack.client.post(CHAT, content=body, headers={"content-type": "application/json"})
    else:
        response = await stack.client.post(CHAT, json=body)
    assert_openai_error(response, 400, code, param)
    assert stack.router.schedule_calls == []


async def test_nesting_up_to_the_limit_and_unknown_fields_are_accepted(stack: Any) -> None:
    # The body object is level 1, so the extra field may hold MAX_JSON_DEPTH - 1 levels.
    body = raw_chat(f'"extra": {nested(MAX_JSON_DEPTH - 1)}, "logit_bias": {{"50256": -100}}, "max_tokens": 3')
    response = await stack.client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    # Brackets inside strings are text, however many.
    text = chat(messages=[{"role": "user", "content": "[[{{" * 500}], max_tokens=3)
    assert (await stack.client.post(CHAT, json=text)).status_code == 200
    # A valid surrogate pair, escaped (as json.dumps writes an emoji by default), is fine.
    emoji = raw_chat(r'"user": "\ud83d\ude00", "max_tokens": 3')
    response = await stack.client.post(CHAT, content=emoji, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        pytest.param("text/plain", 400, id="text-plain"),
        pytest.param("application/x-www-form-urlencoded", 400, id="form"),
        pytest.param("multipart/form-data; boundary=x", 400, id="multipart"),
        pytest.param("", 400, id="empty"),
        pytest.param("application/json; charset=utf-8", 200, id="json-with-charset"),
        pytest.param("Application/JSON", 200, id="json-any-case"),
        pytest.param("application/vnd.example+json", 200, id="json-suffix"),
        pytest.param(None, 200, id="none"),
    ],
)
async def test_content_type(stack: Any, content_type: str | None, status: int) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    response = await stack.client.post(CHAT, content=json.dumps(chat(max_tokens=3)).encode(), headers=headers)
    if status == 200:
        assert response.status_code == 200, response.text
        return
    assert_openai_error(response, 400, "unsupported_content_type")
    assert stack.router.schedule_calls == []


def test_a_long_bad_list_stops_at_its_first_bad_item() -> None:
    # Without fail_fast pydantic reports every bad item (and tries every union member): seconds per MiB.
    with pytest.raises(ValidationError) as prompt_error:
        CompletionRequest.model_validate({"model": MODEL, "prompt": [-1] * 100_000})
    assert prompt_error.value.error_count() <= 3
    parts = [{"type": "image"}] * 100_000
    with pytest.raises(ValidationError) as parts_error:
        ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    assert parts_error.value.error_count() <= 3


async def test_client_gone_while_sending_its_body_is_no_server_error(
    stack: Any, caplog: pytest.LogCaptureFixture
) -> None:
    messages: list[dict[str, Any]] = []
    incoming = [{"type": "http.request", "body": b'{"model": "Smol', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = http_scope(CHAT)
    with caplog.at_level(logging.INFO):
        await stack.app(scope, receive, send)
    assert messages[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    sample = stack.metrics.registry.get_sample_value(
        "tandem_gateway_requests_total", {"endpoint": CHAT, "status": "499"}
    )
    assert sample == 1.0


async def test_rejected_requests_charge_no_quota(edge: Any) -> None:
    key = await edge.tenant("acme", input_tokens_per_minute=1000, output_tokens_per_minute=1000)
    auth = {"Authorization": f"Bearer {key}"}
    for body in (raw_chat('"temperature": NaN'), json.dumps(chat(seed=2**64)).encode(), b"[" * 5000):
        response = await edge.client.post(CHAT, content=body, headers={**auth, "content-type": "application/json"})
        assert response.status_code == 400, response.text
    ok = await edge.client.post(CHAT, json=chat(max_tokens=4), headers=auth)
    assert ok.status_code == 200
    # The first admitted request sees full buckets: nothing was reserved for the refused ones.
    assert int(ok.headers["x-ratelimit-remaining-output-tokens"]) == 1000 - 4
    assert edge.router.schedule_calls and len(edge.router.schedule_calls) == 1


# --- connections (a real uvicorn with the gateway's protocol) -----------------------------------


@contextlib.asynccontextmanager
async def guarded_server(app: Any, **limits: Any) -> AsyncIterator[tuple[str, int]]:
    """``app`` behind the gateway's guarded HTTP protocol, with ``limits`` as its HttpSettings."""
    protocol = guarded_protocol(HttpSettings(**limits))
    async with serving(app, timeout_graceful_shutdown=1, http=protocol, ws="none") as port:
        yield "127.0.0.1", port


async def read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    data = b""
    async with asyncio.timeout(timeout_s):
        while chunk := await reader.read(65536):
            data += chunk
    return data


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body) if body else None


def assert_error_response(raw: bytes, status: int, code: str) -> dict[str, str]:
    got_status, headers, body = parse_response(raw)
    assert got_status == status, raw[:300]
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    return headers


async def healthz(host: str, port: int) -> float:
    """Seconds one fresh-connection GET /healthz takes; fails unless 200."""
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=5) as client:
        assert (await client.get("/healthz")).status_code == 200
    return time.monotonic() - started


async def test_slow_head_gets_408_and_others_are_served_meanwhile(stack: Any) -> None:
    async with guarded_server(stack.app, header_timeout_s=0.5) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        opened = time.monotonic()

        async def answer() -> tuple[bytes, float]:
            raw = await read_until_closed(reader, 5)
            return raw, time.monotonic() - opened

        answered = asyncio.create_task(answer())
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # a byte now and then never finishes the head
            await asyncio.sleep(0.1)
            writer.write(b"X")
        for _ in range(2):
            assert await healthz(host, port) < 3.0
        raw, lived_s = await answered
        assert 0.4 < lived_s < 2.0
        assert_error_response(raw, 408, "request_timeout")
        writer.close()


async def test_connection_that_never_speaks_is_closed_without_an_answer(stack: Any) -> None:
    async with guarded_server(stack.app, header_timeout_s=0.3) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        opened = time.monotonic()
        assert await read_until_closed(reader, 3) == b""
        assert 0.2 < time.monotonic() - opened < 2.0
        writer.close()


async def test_idle_keep_alive_is_not_a_slow_head(stack: Any) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    async with guarded_server(stack.app, header_timeout_s=0.3) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        for _ in range(2):
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
            assert head.startswith(b"HTTP/1.1 200")
            length = int(parse_response(head)[1]["content-length"])
            await reader.readexactly(length)
            await asyncio.sleep(0.6)  # idle longer than the head timeout, shorter than keep-alive
        # Two requests in one write (pipelined) are both answered.
        writer.write(request * 2)
        for _ in range(2):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
            assert head.startswith(b"HTTP/1.1 200")
            await reader.readexactly(int(parse_response(head)[1]["content-length"]))
        writer.close()


async def test_slow_body_gets_408_and_the_handler_sees_a_disconnect(
    stack: Any, caplog: pytest.LogCaptureFixture
) -> None:
    body = json.dumps(chat(max_tokens=3)).encode()
    async with guarded_server(stack.app, body_timeout_s=0.5) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        opened = time.monotonic()
        with caplog.at_level(logging.INFO):
            raw = await read_until_closed(reader, 3)
            assert time.monotonic() - opened < 2.0
            assert_error_response(raw, 408, "request_timeout")
            for _ in range(100):
                sample = stack.metrics.registry.get_sample_value(
                    "tandem_gateway_requests_total", {"endpoint": CHAT, "status": "499"}
                )
                if sample:
                    break
                await asyncio.sleep(0.01)
        assert sample == 1.0
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert stack.router.schedule_calls == []
        writer.close()
        # A body sent at once is served as usual.
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=5) as client:
            assert (await client.post(CHAT, json=chat(max_tokens=3))).status_code == 200


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        pytest.param(b"X-Big: " + b"a" * 8192 + b"\r\n", "request_header_too_large", id="one-big-header"),
        pytest.param(
            b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 200) for i in range(30)),
            "request_header_too_large",
            id="many-medium-headers",
        ),
        pytest.param(b"".join(b"X-H%d: v\r\n" % i for i in range(50)), "too_many_headers", id="too-many-headers"),
    ],
)
async def test_oversized_head_gets_431(stack: Any, headers: bytes, code: str) -> None:
    async with guarded_server(stack.app, max_header_bytes=4096, max_num_headers=40) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        assert_error_response(await read_until_closed(reader, 3), 431, code)
        writer.close()
        assert await healthz(host, port) < 3.0


async def test_endless_head_is_cut_off_without_buffering_it(stack: Any) -> None:
    async with guarded_server(stack.app, max_header_bytes=4096) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        num_sent = 0
        with contextlib.suppress(ConnectionError):
            while num_sent < 64 * 1024 * 1024:  # the server closes long before this
                writer.write(b"a" * 65536)
                await writer.drain()
                num_sent += 65536
        raw = b""
        with contextlib.suppress(ConnectionError):
            raw = await read_until_closed(reader, 3)
        assert num_sent < 64 * 1024 * 1024
        if raw:  # the answer may be lost to the reset that closing with unread bytes causes
            assert_error_response(raw, 431, "request_header_too_large")
        writer.close()


async def test_unparseable_request_gets_an_openai_400(stack: Any) -> None:
    async with guarded_server(stack.app) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"\x00\x01 not http at all\r\n\r\n")
        assert_error_response(await read_until_closed(reader, 3), 400, "invalid_http_request")
        writer.close()


async def test_connections_beyond_the_cap_get_503(stack: Any) -> None:
    async with guarded_server(stack.app, max_connections=2) as (host, port):
        idle = [await asyncio.open_connection(host, port) for _ in range(2)]
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=5) as client:
            refused = await client.get("/healthz")
            assert_openai_error(refused, 503, "too_many_connections")
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "server_error"
            for _, writer in idle:
                writer.close()
            await asyncio.sleep(0.1)
            assert (await client.get("/healthz")).status_code == 200


async def test_a_capped_send_buffer_lets_the_stream_notice_a_client_that_never_reads(
    start_worker: Any, fake_router: Any, prompt_tokenizer: Any, wait: Any
) -> None:
    from tandem.gateway.app import build_app
    from tandem.gateway.metrics import GatewayMetrics
    from tests.kit.gateway import DecodeStep, FakeReadiness, placement

    from .conftest import gateway_settings

    prefill = await start_worker("prefill-0")
    # ~1.3 MB of events in all: what a loopback connection's self-tuned kernel buffers would swallow whole.
    decode = await start_worker("decode-0", decode_steps=[DecodeStep("x" * 2048, [5]) for _ in range(600)])
    fake_router.placements.append(placement(prefill, decode))
    metrics = GatewayMetrics()
    settings = gateway_settings(stream={"max_buffered_bytes": 4096, "slow_reader_timeout_s": 0.5})
    app = build_app(
        settings, router=fake_router, tokenizer=prompt_tokenizer, readiness=FakeReadiness(), metrics=metrics
    )
    body = json.dumps(chat(stream=True, max_tokens=40)).encode()
    async with app.router.lifespan_context(app), guarded_server(app, send_buffer_bytes=4096) as (host, port):
        sock = await start_stream_then_stop_reading(host, port, "/v1/chat/completions", body)
        # ... and never read again: cut off, and the generation cancelled, long before 600 steps.
        await wait(decode.aborted_event, 10)
        assert metrics.registry.get_sample_value("tandem_gateway_slow_reader_disconnects_total") == 1
        assert len(decode.decode_requests) == 1
        sock.close()


def test_http_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.gateway.settings import GatewaySettings

    monkeypatch.setenv("TANDEM_GATEWAY_HTTP__HEADER_TIMEOUT_S", "3.5")
    monkeypatch.setenv("TANDEM_GATEWAY_HTTP__SEND_BUFFER_BYTES", "16384")
    settings = GatewaySettings()
    assert (settings.http.header_timeout_s, settings.http.send_buffer_bytes) == (3.5, 16384)
    assert settings.http.max_header_bytes == 32 * 1024
    monkeypatch.setenv("TANDEM_GATEWAY_HTTP__MAX_HEADER_BYTES", "10")
    with pytest.raises(ValueError, match="max_header_bytes"):
        GatewaySettings()
