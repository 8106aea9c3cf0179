"""Property tests (hypothesis) of the parsers at both ends of a stream.

* The gateway's request parsing: any bytes become either a valid request whose
  numbers and strings fit the wire to the workers, or an InvalidRequestError
  that maps to a 4xx in the OpenAI shape. Nothing else escapes.
* The gateway's SSE encoder: any generated text (newlines, ``\\r``, ``data:``,
  any Unicode) parses back, with a strict parser written from the WHATWG
  event-stream rules below, to exactly the same content events and a final
  ``[DONE]``.
* The load generator's client-side SSE parser reads those streams back exactly.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st
from tandem_loadtest.client import StreamParser
from tandem_loadtest.records import RequestRecord

from tandem.common.errors import InvalidRequestError
from tandem.gateway.api.errors import api_error_from
from tandem.gateway.api.validation import ChatCompletionRequest, CompletionRequest, check_content_type, parse_body
from tandem.gateway.job import Usage
from tandem.gateway.sse import DONE_EVENT, HEARTBEAT, ChunkEncoder, ResponseMeta

MODEL = "SmolLM2-135M-Instruct"
FUZZ = settings(max_examples=300, deadline=None, database=None)
FEW = settings(max_examples=100, deadline=None, database=None)

# --- request bodies ------------------------------------------------------------------------------

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and ±Infinity included: json.dumps writes them as the non-JSON literals
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, -(2**63) - 1, 1e999]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]) | json_values},
        optional={
            "content": st.text(max_size=30)
            | st.lists(st.fixed_dictionaries({"type": st.just("text") | st.text(max_size=4), "text": st.text()}))
            | json_values,
            "name": st.text(max_size=5) | json_values,
        },
    ),
    max_size=3,
)
request_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just(MODEL) | st.text(max_size=8) | json_values,
        "messages": messages | json_values,
        "prompt": st.text(max_size=20)
        | st.lists(st.integers(min_value=-3, max_value=2**33), max_size=5)
        | st.lists(st.text(max_size=5), max_size=3)
        | json_values,
        "max_tokens": numbers | json_values,
        "max_completion_tokens": numbers,
        "temperature": numbers,
        "top_p": numbers,
        "top_k": numbers,
        "presence_penalty": numbers,
        "frequency_penalty": numbers,
        "seed": numbers,
        "stop": st.text(max_size=5) | st.lists(st.text(max_size=3), max_size=20) | json_values,
        "n": numbers,
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
        "user": st.text(max_size=5) | json_values,
        "ignore_eos": st.booleans() | json_values,
        "logprobs": json_values,
        "tools": json_values,
        "conversation_id": st.text(max_size=130) | json_values,
        "echo": json_values,
        "best_of": numbers,
        "suffix": json_values,
        "logit_bias": json_values | st.dictionaries(st.text(max_size=6), numbers, max_size=3),
        "top_logprobs": numbers,
        "min_tokens": numbers,
        "min_p": numbers,
        "repetition_penalty": numbers,
        "stop_token_ids": st.lists(numbers, max_size=3) | json_values,
        "response_format": json_values
        | st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
            optional={"json_schema": st.fixed_dictionaries({"name": st.text(max_size=3), "schema": json_values})},
        ),
        "structured_outputs": json_values
        | st.fixed_dictionaries(
            {},
            optional={
                "json": json_values | st.text(max_size=8),
                "regex": st.text(max_size=5),
                "choice": st.lists(st.text(max_size=3), max_size=3),
            },
        ),
        "tool_choice": json_values,
        "parallel_tool_calls": json_values,
    },
)


@st.composite
def request_bodies(draw: st.DrawFn) -> bytes:
    """Mostly request-shaped JSON (sometimes with NaN, deep nesting, escapes), broken in a few ways."""
    fields = draw(request_fields)
    text = json.dumps(fields, ensure_ascii=draw(st.booleans()))
    body = text.encode()
    how = draw(st.sampled_from(["as-is", "as-is", "truncated", "byte-flipped", "nested", "escape", "not-object"]))
    if how == "truncated":
        body = body[: draw(st.integers(0, len(body)))]
    elif how == "byte-flipped" and body:
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + bytes([draw(st.integers(0, 255))]) + body[i + 1 :]
    elif how == "nested":
        depth = draw(st.sampled_from([1, 63, 64, 65, 999, 1001, 5000]))
        body = body[:-1] + (', "x": ' if fields else '"x": ').encode() + b"[" * depth + b"]" * depth + b"}"
    elif how == "escape":
        escape = draw(st.sampled_from([r"\ud800", r"\udfff", r"\ud83d\ude00", r"\u0000", r"\\ud800", r"\u2028"]))
        body = body[:-1] + (', "user": "' if fields else '"user": "').encode() + escape.encode() + b'"}'
    elif how == "not-object":
        body = json.dumps([fields]).encode()
    return body


def check_parse(body: bytes, model_cls: type[ChatCompletionRequest] | type[CompletionRequest]) -> None:
    try:
        request = parse_body(body, model_cls)
    except InvalidRequestError as exc:
        error = api_error_from(exc)
        assert 400 <= error.status_code < 500
        assert error.type == "invalid_request_error"
        assert error.response().body  # JSON, UTF-8: renders whatever the message holds
        return
    assert isinstance(request, model_cls)
    # What passed validation fits the wire to the workers and re-encodes as strict JSON and UTF-8.
    request.sampling_params().to_proto(max_tokens=1)
    json.dumps(request.model_dump(), allow_nan=False).encode("utf-8")


@FUZZ
@given(body=request_bodies(), chat=st.booleans())
@example(body=b'{"model": "m", "messages": [{"role": "user"}], "seed": 18446744073709551616}', chat=True)
@example(body=b'{"model": "m", "prompt": "x", "top_k": 4294967296}', chat=False)
@example(body=b'{"model": "m", "prompt": "x", "temperature": NaN}', chat=False)
@example(body=b'{"x": ' + b"[" * 100_000, chat=True)
def test_any_request_body_is_a_request_or_a_4xx(body: bytes, chat: bool) -> None:
    check_parse(body, ChatCompletionRequest if chat else CompletionRequest)


@FUZZ
@given(body=st.binary(max_size=300), chat=st.booleans())
def test_any_bytes_are_a_request_or_a_4xx(body: bytes, chat: bool) -> None:
    check_parse(body, ChatCompletionRequest if chat else CompletionRequest)


@FEW
@given(content_type=st.text(max_size=60) | st.sampled_from(["application/json", "text/plain; charset=utf-8"]))
def test_any_content_type_is_accepted_or_a_4xx(content_type: str) -> None:
    try:
        check_content_type(content_type)
    except InvalidRequestError as exc:
        assert api_error_from(exc).status_code == 400
        assert exc.code == "unsupported_content_type"


# --- the SSE encoder, against a strict parser ------------------------------------------------------


def parse_event_stream(stream: bytes) -> list[tuple[str, str]]:
    """(event type, data) of every event in ``stream``, per the WHATWG event-stream rules, strictly:
    the stream must be UTF-8, every event must be terminated by a blank line, and the only fields may be
    ``data`` and ``event`` (what the gateway writes), so content that escaped its line would show."""
    text = stream.decode("utf-8")
    assert not text.startswith("\ufeff")
    *lines, rest = re.split(r"\r\n|\r|\n", text)  # the only line terminators
    assert rest == "", "the stream ends mid-line"
    events: list[tuple[str, str]] = []
    event_type, data = "", ""
    pending = False
    for line in lines:
        if line == "":
            if pending:
                events.append((event_type or "message", data.removesuffix("\n")))
            event_type, data, pending = "", "", False
            continue
        if line.startswith(":"):
            continue  # a comment
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        assert field in {"data", "event"}, f"unexpected field line {line!r}"
        if field == "data":
            data += value + "\n"
            pending = True
        else:
            event_type = value
    assert not pending, "an event was never terminated"
    return events


texts = st.text()  # any Unicode scalar values: newlines, \r, NUL, "data:", U+2028, emoji, ...
deltas = st.lists(texts | st.sampled_from(["\n\ndata: [DONE]\n\n", "\r", "\r\n", ": x", "data:", "\x00"]), max_size=8)


def encode_stream(
    meta: ResponseMeta, parts: list[str], finish_reason: str, num_heartbeats: int, error: str | None
) -> bytes:
    encoder = ChunkEncoder(meta)
    out = HEARTBEAT * num_heartbeats + encoder.start()
    out += b"".join(encoder.delta(text) for text in parts)
    if error is not None:
        out += ChunkEncoder.error({"error": {"message": error, "type": "server_error", "param": None, "code": "x"}})
    else:
        out += encoder.finish(finish_reason) + encoder.usage(Usage(7, len(parts), 3))
    return out + DONE_EVENT


streams = st.fixed_dictionaries(
    {
        "meta": st.builds(
            ResponseMeta,
            id=texts,
            created=st.integers(0, 2**40),
            model=texts,
            kind=st.sampled_from(["chat", "text"]),
            include_usage=st.booleans(),
        ),
        "parts": deltas,
        "finish_reason": st.sampled_from(["stop", "length"]),
        "num_heartbeats": st.integers(0, 2),
        "error": st.none() | texts,
    }
)


def content_of(meta: ResponseMeta, payload: dict[str, Any]) -> str | None:
    choice = payload["choices"][0]
    return choice["delta"].get("content") if meta.kind == "chat" else choice["text"]


@FEW
@given(stream=streams)
def test_encoded_stream_parses_back_to_the_same_events(stream: dict[str, Any]) -> None:
    meta: ResponseMeta = stream["meta"]
    parts: list[str] = stream["parts"]
    events = parse_event_stream(encode_stream(**stream))
    assert events[-1] == ("message", "[DONE]")
    assert all(kind == "message" for kind, _ in events)
    payloads = [json.loads(data) for _, data in events[:-1]]
    if meta.kind == "chat":
        role = payloads.pop(0)
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert role.get("usage", "absent") == (None if meta.include_usage else "absent")
    for payload in payloads:
        if "error" not in payload:
            assert (payload["id"], payload["model"], payload["created"]) == (meta.id, meta.model, meta.created)
    content = [content_of(meta, p) for p in payloads[: len(parts)]]
    assert content == parts
    tail = payloads[len(parts) :]
    if stream["error"] is not None:
        assert tail == [{"error": {"message": stream["error"], "type": "server_error", "param": None, "code": "x"}}]
        return
    assert tail[0]["choices"][0]["finish_reason"] == stream["finish_reason"]
    assert content_of(meta, tail[0]) in (None, "")
    if meta.include_usage:
        assert tail[1]["choices"] == [] and tail[1]["usage"]["completion_tokens"] == len(parts)
        assert all(p["usage"] is None for p in payloads[: len(parts) + 1])
    else:
        assert len(tail) == 1 and "usage" not in tail[0]


# --- the load generator's client-side parser --------------------------------------------------------


def loadtest_read(stream: bytes, lines_of: Any = None) -> StreamParser:
    parser = StreamParser(RequestRecord(index=0, tenant="t", label="l", endpoint="/v1", max_tokens=1, send_s=0.0))
    lines = (lines_of or (lambda text: re.split(r"\r\n|\r|\n", text)))(stream.decode("utf-8"))
    for i, line in enumerate(lines):
        parser.feed_line(line, i * 0.01)
    parser.close(len(lines) * 0.01)
    return parser


@FEW
@given(stream=streams)
def test_the_loadtest_parser_reads_gateway_streams_exactly(stream: dict[str, Any]) -> None:
    meta: ResponseMeta = stream["meta"]
    parser = loadtest_read(encode_stream(**stream))
    record = parser.record
    assert parser.done
    assert "".join(parser.text_parts) == "".join(stream["parts"])
    assert len(record.content_times_s) == len([p for p in stream["parts"] if p])
    if stream["error"] is not None:
        assert record.error is not None and record.error.startswith("stream error")
        return
    assert record.error is None
    assert record.finish_reason == stream["finish_reason"]
    if meta.include_usage:
        assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (7, len(stream["parts"]), 3)


@FEW
@given(stream=streams)
@example(
    stream={
        "meta": ResponseMeta(id="x", created=1, model="m", kind="chat"),
        "parts": ["a\u2028b"],
        "finish_reason": "stop",
        "num_heartbeats": 0,
        "error": None,
    }
)
def test_the_loadtest_parser_reads_gateway_streams_split_like_httpx(stream: dict[str, Any]) -> None:
    parser = loadtest_read(encode_stream(**stream), lines_of=str.splitlines)
    assert parser.record.error is None or stream["error"] is not None
    assert "".join(parser.text_parts) == "".join(stream["parts"])


@FEW
@given(payload=json_values)
@example(payload={"choices": "abc"})
def test_the_loadtest_parser_survives_any_event(payload: Any) -> None:
    parser = loadtest_read(b"data: " + json.dumps(payload).encode() + b"\n\n")
    assert not parser.done
