"""The gateway's SSE framing against the parsers clients really run, with the bytes cut into network reads
every which way.

The stream is what the real gateway writes (recorded at the ASGI boundary, its own write boundaries kept) for
a chat request that waits in the router's queue long enough for heartbeats, asks for usage and for the stage
timings, and whose first token is half an emoji, so that its first write is the role chunk alone. The parsers:

* vLLM's benchmark client (``vllm bench serve --backend openai-chat``): ``async_request_openai_chat_completions``
  of ``vllm/benchmarks/lib/endpoint_request_func.py``. It strips every network read before splitting events,
  and keeps a leftover only when it starts with ``data: ``; a read that ended with a ``: queued`` comment
  swallowed the events after it (the one stream in 16 that "never received a valid chunk");
* the ``openai`` SDK's ``AsyncStream`` over its ``SSEDecoder`` (it stops at ``[DONE]``);
* a line reader: httpx's ``aiter_lines`` into the load generator's ``StreamParser``;
* a strict WHATWG event-stream parser, and Node's EventSource (undici) where ``node`` has one.

Each is fed exact reads (a stand-in for the HTTP client under the parser: an aiohttp-shaped session for
vLLM, httpx mock transports for the others), and also reads off a real socket from a small uvicorn server
that writes the same bytes in adversarial pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import random
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import httpx2
import openai
import pytest
from tandem_loadtest.client import StreamParser
from tandem_loadtest.records import RequestRecord

from tandem.gateway.app import build_app
from tandem.gateway.metrics import GatewayMetrics
from tests.kit.gateway import DecodeStep, FakeReadiness, placement
from tests.kit.net import http_scope, serving

from .conftest import gateway_settings

pytestmark = [pytest.mark.timeout(120)]

MODEL = "SmolLM2-135M-Instruct"
#: The answer, cut into tokens the way a detokenizer emits them: the first token is the first half of the
#: emoji (no text yet), then CJK, U+2028 (a line end to str.splitlines), text that looks like SSE framing,
#: and a token that completes no character.
DECODE_STEPS = [
    DecodeStep("😀", [102]),
    DecodeStep(" 你好", [103]),
    DecodeStep(",\u2028 world", [104]),
    DecodeStep("\n\ndata: [DONE]\n\n", [105]),
    DecodeStep(": not a comment", [106]),
    DecodeStep("", [107]),
    DecodeStep(" é\u2029.", [108], "stop"),
]
EXPECTED_TEXT = "".join(step.text for step in DECODE_STEPS)
HEARTBEAT_INTERVAL_S = 0.1
QUEUE_DELAY_S = 0.45  # a few heartbeats before the first token


# --- the stream, as the gateway writes it -------------------------------------------------------------------


def parse_event_stream(stream: bytes) -> list[tuple[str, str]]:
    """(event type, data) of every event, per the WHATWG event-stream rules, strictly: UTF-8, every event
    ended by a blank line, no fields but ``data`` and ``event`` (what the gateway writes). The rules of
    test_parser_fuzz's parser, kept here so that a framing test does not import the request parsing that
    module also tests."""
    *lines, rest = re.split(r"\r\n|\r|\n", stream.decode("utf-8"))
    assert rest == "", "the stream ends mid-line"
    events: list[tuple[str, str]] = []
    event_type, data = "", list[str]()
    for line in lines:
        if line == "":
            if data:
                events.append((event_type or "message", "\n".join(data)))
            event_type, data = "", []
        elif not line.startswith(":"):  # not a comment
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            assert field in {"data", "event"}, f"unexpected field line {line!r}"
            if field == "data":
                data.append(value)
            else:
                event_type = value
    assert not data, "an event was never terminated"
    return events


@dataclass(frozen=True)
class Recorded:
    """The body of one streamed response and what it must parse to."""

    writes: list[bytes]  # the gateway's http.response.body messages, in order

    @property
    def body(self) -> bytes:
        return b"".join(self.writes)

    def data_events(self) -> list[dict[str, Any]]:
        """The JSON of every ``message`` event before ``[DONE]`` (the strict parser's reading)."""
        events = parse_event_stream(self.body)
        datas = [data for kind, data in events if kind == "message"]
        return [json.loads(data) for data in datas[: datas.index("[DONE]")]]

    def usage(self) -> dict[str, Any]:
        (usage,) = [event["usage"] for event in self.data_events() if event.get("usage")]
        return dict(usage)


async def record_stream(app: Any, body: dict[str, Any], headers: dict[str, str]) -> Recorded:
    """Run ``app`` on one request as an ASGI server would, keeping each body message apart."""
    raw = json.dumps(body).encode()
    scope = http_scope("/v1/chat/completions", headers)
    request_sent, response_done = False, asyncio.Event()
    status: list[int] = []
    writes: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await response_done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            if message.get("body"):
                writes.append(bytes(message["body"]))
            if not message.get("more_body", False):
                response_done.set()

    await app(scope, receive, send)
    assert status == [200]
    return Recorded(writes)


@pytest.fixture(params=["plain", "with timings"])
async def recorded(
    request: pytest.FixtureRequest, start_worker: Any, fake_router: Any, prompt_tokenizer: Any
) -> Recorded:
    """The stream as vLLM bench asks for it (usage, no timings), and with the stage timings too."""
    prefill = await start_worker("prefill-0", first_text="")
    decode = await start_worker("decode-0", decode_steps=DECODE_STEPS, decode_step_delay_s=0.02)
    fake_router.placements.append(placement(prefill, decode))
    fake_router.schedule_delay_s = QUEUE_DELAY_S
    app = build_app(
        gateway_settings(stream={"heartbeat_interval_s": HEARTBEAT_INTERVAL_S}),
        router=fake_router,
        tokenizer=prompt_tokenizer,
        readiness=FakeReadiness(),
        metrics=GatewayMetrics(),
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with app.router.lifespan_context(app):
        headers = {"X-Tandem-Timings": "1"} if request.param == "with timings" else {}
        stream = await record_stream(app, body, headers)
    assert len(stream.writes) >= 8, stream.writes  # heartbeats, role chunk, deltas, ... each written apart
    return stream


def test_the_recorded_stream_is_what_the_parsers_must_find(recorded: Recorded) -> None:
    """The truth the parsers are checked against, read with the strict WHATWG parser."""
    events = recorded.data_events()
    chunks = [e for e in events if e["choices"]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == EXPECTED_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert recorded.usage()["completion_tokens"] == 1 + sum(len(step.token_ids) for step in DECODE_STEPS)
    timings = [json.loads(data) for kind, data in parse_event_stream(recorded.body) if kind == "tandem.timings"]
    if timings:
        assert timings[0]["stages_ms"]["schedule"] >= QUEUE_DELAY_S * 1000 * 0.9
    num_heartbeats = sum(1 for write in recorded.writes if not write.startswith((b"data:", b"event:")))
    assert num_heartbeats >= 2


# --- how the bytes are cut into reads -----------------------------------------------------------------------


def _cut(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, *cuts, len(body)})
    return [body[a:b] for a, b in itertools.pairwise(points) if a < b]


def _event_ends(body: bytes) -> list[int]:
    """The offset after every blank line that ends an event (or stands alone)."""
    return [m.end() for m in re.finditer(rb"\n\n", body)]


def _first_data_event_end(body: bytes) -> int:
    return body.index(b"\n\n", body.index(b"data:")) + 2


Schedule = Callable[[Recorded], list[bytes]]

#: Read schedules met on real networks: a client that keeps up reads what each write sent; one that fell
#: behind (or a proxy that re-chunks) reads several events, or an event cut anywhere.
SCHEDULES: dict[str, Schedule] = {
    "as written": lambda r: list(r.writes),
    "all in one read": lambda r: [r.body],
    "one read per event": lambda r: _cut(r.body, _event_ends(r.body)),
    "every event ends mid-terminator": lambda r: _cut(r.body, [end - 1 for end in _event_ends(r.body)]),
    "heartbeats with the first data event": lambda r: _cut(
        r.body, [end for end in _event_ends(r.body) if end >= _first_data_event_end(r.body)]
    ),
    "heartbeats apart, the rest in one read": lambda r: _cut(
        r.body, [end for end in _event_ends(r.body) if end < _first_data_event_end(r.body)] + [r.body.index(b"data:")]
    ),
    "one byte per read": lambda r: [r.body[i : i + 1] for i in range(len(r.body))],
}


def report(failures: dict[str, str], num_cases: int | None = None) -> str:
    head = f"{len(failures)} of {num_cases} read schedules fail" if num_cases else "failures"
    return "\n".join([head + ":", *(f"  {name}: {problem[:300]}" for name, problem in list(failures.items())[:15])])


def vllm_can_cut_at(body: bytes, offset: int) -> bool:
    """vLLM's client strips every read (``chunk_bytes = chunk_bytes.strip()``), so a read that starts or ends
    next to a space loses it, whatever the server sends: after ``data:`` the event no longer parses, inside
    the text a space goes missing (vLLM's own server has the same exposure;
    :func:`test_vllm_bench_loses_a_space_at_a_read_edge_whatever_the_framing` pins it). Every other cut,
    blank lines included, it must survive."""
    return body[offset - 1 : offset] != b" " and body[offset : offset + 1] != b" "


def for_vllm(body: bytes, reads: list[bytes]) -> list[bytes]:
    """``reads`` with the cuts vLLM cannot survive joined back."""
    cuts, offset = [], 0
    for read in reads[:-1]:
        offset += len(read)
        if vllm_can_cut_at(body, offset):
            cuts.append(offset)
    return _cut(body, cuts)


def random_reads(body: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    cuts, offset = [], 0
    while offset < len(body):
        offset += rng.randint(1, 48)
        cuts.append(offset)
    return _cut(body, [c for c in cuts if c < len(body)])


# --- vLLM's benchmark client --------------------------------------------------------------------------------


def _load_vllm_bench() -> ModuleType:
    """vLLM's ``benchmarks/lib/endpoint_request_func.py``, loaded from its file: it needs only aiohttp, regex
    and tqdm, while ``import vllm`` would import torch (seconds)."""
    spec = importlib.util.find_spec("vllm")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "benchmarks" / "lib" / "endpoint_request_func.py"
    name = "vllm_bench_endpoint_request_func"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vllm_bench() -> ModuleType:
    return _load_vllm_bench()


class _ReadsContent:
    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads

    async def iter_any(self) -> AsyncIterator[bytes]:
        for read in self._reads:
            yield read


@dataclass
class _ReadsResponse:
    content: _ReadsContent
    status: int = 200
    reason: str = "OK"


class ReadsSession:
    """The part of an aiohttp.ClientSession that vLLM's request function uses, answering with fixed reads."""

    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads

    @contextlib.asynccontextmanager
    async def post(self, url: str, json: Any, headers: Any) -> AsyncIterator[_ReadsResponse]:
        yield _ReadsResponse(_ReadsContent(self._reads))


async def vllm_read(vllm_bench: ModuleType, session: Any, url: str = "http://gateway/v1/chat/completions") -> Any:
    request = vllm_bench.RequestFuncInput(prompt="hello world", api_url=url, prompt_len=2, output_len=16, model=MODEL)
    return await vllm_bench.async_request_openai_chat_completions(request, session)


def vllm_problems(output: Any, recorded: Recorded) -> str | None:
    """What vLLM's client got wrong, or None."""
    if not output.success:
        return f"success=False: {output.error.strip().splitlines()[-1] if output.error else ''}"
    if output.generated_text != EXPECTED_TEXT:
        return f"generated_text={output.generated_text!r}"
    num_chunks = sum(1 for e in recorded.data_events() if e["choices"])
    if len(output.itl) + 1 != num_chunks:  # the first chunk gives the TTFT, each later one an ITL
        return f"saw {len(output.itl) + 1} of {num_chunks} chunks"
    if output.output_tokens != recorded.usage()["completion_tokens"]:
        return f"output_tokens={output.output_tokens}"
    return None


async def test_vllm_bench_reads_every_chunk_whatever_the_reads(vllm_bench: ModuleType, recorded: Recorded) -> None:
    body = recorded.body
    cases: dict[str, list[bytes]] = {name: for_vllm(body, make(recorded)) for name, make in SCHEDULES.items()}
    cases.update({f"random reads #{seed}": for_vllm(body, random_reads(body, seed)) for seed in range(100)})
    cases.update(
        {f"two reads, cut at {i}": [body[:i], body[i:]] for i in range(1, len(body)) if vllm_can_cut_at(body, i)}
    )
    failures = {}
    for name, reads in cases.items():
        assert b"".join(reads) == body
        problem = vllm_problems(await vllm_read(vllm_bench, ReadsSession(reads)), recorded)
        if problem is not None:
            failures[name] = problem
    assert not failures, report(failures, len(cases))


async def test_vllm_bench_loses_a_space_at_a_read_edge_whatever_the_framing(vllm_bench: ModuleType) -> None:
    """Why :func:`vllm_can_cut_at` spares spaces: a plain OpenAI stream (no heartbeat, no extra event) that
    reaches vLLM's client cut after ``data:`` fails, and cut before a space in the text loses the space."""
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    delta = b'data: {"choices":[{"index":0,"delta":{"content":" world"}}]}\n\n'
    stream = role + delta + b"data: [DONE]\n\n"
    after_data = len(role) + len(b"data:")
    cut = await vllm_read(vllm_bench, ReadsSession([stream[:after_data], stream[after_data:]]))
    assert not cut.success
    before_space = stream.index(b" world")
    lost = await vllm_read(vllm_bench, ReadsSession([stream[:before_space], stream[before_space:]]))
    assert lost.success and lost.generated_text == "world"


# --- the openai SDK -----------------------------------------------------------------------------------------


class _Reads(httpx2.AsyncByteStream, httpx.AsyncByteStream):
    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for read in self._reads:
            yield read


SSE_RESPONSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8"}


async def openai_read(client: openai.AsyncOpenAI) -> list[Any]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    return [chunk async for chunk in stream]


def openai_client_with_reads(reads: list[bytes]) -> openai.AsyncOpenAI:
    transport = httpx2.MockTransport(
        lambda request: httpx2.Response(200, headers=SSE_RESPONSE_HEADERS, stream=_Reads(reads))
    )
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1",
        api_key="sk-test",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=transport),
    )


def openai_problems(chunks: list[Any], recorded: Recorded) -> str | None:
    events = recorded.data_events()
    if [getattr(c, "object", None) for c in chunks] != [e["object"] for e in events]:
        strays = [sorted(k for k, v in c.model_dump().items() if v is not None) for c in chunks if not c.object]
        return f"{len(chunks)} chunks for {len(events)} events; chunks that are no chunk, by their fields: {strays}"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if text != EXPECTED_TEXT:
        return f"text={text!r}"
    if chunks[0].choices[0].delta.role != "assistant":
        return "no role chunk first"
    if chunks[-1].usage is None or chunks[-1].usage.completion_tokens != recorded.usage()["completion_tokens"]:
        return f"usage={chunks[-1].usage}"
    return None


async def test_openai_sdk_reads_every_chunk_whatever_the_reads(recorded: Recorded) -> None:
    cases = {name: make(recorded) for name, make in SCHEDULES.items()}
    cases.update({f"random reads #{seed}": random_reads(recorded.body, seed) for seed in range(20)})
    failures = {}
    for name, reads in cases.items():
        async with openai_client_with_reads(reads) as client:
            problem = openai_problems(await openai_read(client), recorded)
        if problem is not None:
            failures[name] = problem
    assert not failures, report(failures, len(cases))


# --- a line reader ------------------------------------------------------------------------------------------


async def lines_read(lines: AsyncIterator[str]) -> StreamParser:
    parser = StreamParser(RequestRecord(index=0, tenant="t", label="l", endpoint="/v1", max_tokens=16, send_s=0.0))
    async for line in lines:
        parser.feed_line(line, 0.0)
    parser.close(0.0)
    return parser


def lines_problems(parser: StreamParser, recorded: Recorded) -> str | None:
    record = parser.record
    text = "".join(parser.text_parts)
    if text != EXPECTED_TEXT:
        return f"text={text!r}"
    if not parser.done or record.error is not None or record.finish_reason != "stop":
        return f"done={parser.done} error={record.error} finish_reason={record.finish_reason}"
    if record.completion_tokens != recorded.usage()["completion_tokens"]:
        return f"completion_tokens={record.completion_tokens}"
    return None


async def test_a_line_reader_reads_every_chunk_whatever_the_reads(recorded: Recorded) -> None:
    cases = {name: make(recorded) for name, make in SCHEDULES.items()}
    cases.update({f"random reads #{seed}": random_reads(recorded.body, seed) for seed in range(20)})
    failures = {}
    for name, reads in cases.items():
        response = httpx.Response(200, headers=SSE_RESPONSE_HEADERS, stream=_Reads(reads))
        problem = lines_problems(await lines_read(response.aiter_lines()), recorded)
        if problem is not None:
            failures[name] = problem
    assert not failures, report(failures, len(cases))


# --- the same over real sockets -----------------------------------------------------------------------------


def replay_app(writes: list[bytes], gap_s: float) -> Callable[..., Any]:
    """An ASGI app that answers any request with ``writes``, one body message each, ``gap_s`` apart (so that
    a client that keeps up reads each on its own)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for write in writes:
            await send({"type": "http.response.body", "body": write, "more_body": True})
            await asyncio.sleep(gap_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


@contextlib.asynccontextmanager
async def replaying(writes: list[bytes], gap_s: float) -> AsyncIterator[str]:
    async with serving(replay_app(writes, gap_s)) as port:
        yield f"http://127.0.0.1:{port}"


#: Over a socket, pieces written apart may still arrive together (never the reverse), so these are the
#: schedules whose pieces start and end where vLLM can be cut.
NETWORK_SCHEDULES = [
    "as written",
    "one read per event",
    "every event ends mid-terminator",
    "heartbeats with the first data event",
    "heartbeats apart, the rest in one read",
]


async def test_vllm_bench_over_a_socket(vllm_bench: ModuleType, recorded: Recorded) -> None:
    import aiohttp

    failures = {}
    for name in NETWORK_SCHEDULES:
        async with replaying(SCHEDULES[name](recorded), gap_s=0.005) as url:
            async with aiohttp.ClientSession() as session:
                output = await vllm_read(vllm_bench, session, f"{url}/v1/chat/completions")
        problem = vllm_problems(output, recorded)
        if problem is not None:
            failures[name] = problem
    assert not failures, report(failures)


async def test_openai_sdk_and_a_line_reader_over_a_socket(recorded: Recorded) -> None:
    failures = {}
    for name in ["as written", "one byte per read"]:
        writes = SCHEDULES[name](recorded)
        async with replaying(writes, gap_s=0.005 if name == "as written" else 0.0) as url:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0) as client:
                problem = openai_problems(await openai_read(client), recorded)
            if problem is not None:
                failures[f"openai, {name}"] = problem
            async with httpx.AsyncClient(base_url=url) as http, http.stream("POST", "/v1/chat/completions") as r:
                problem = lines_problems(await lines_read(r.aiter_lines()), recorded)
            if problem is not None:
                failures[f"lines, {name}"] = problem
    assert not failures, report(failures)


EVENTSOURCE_JS = """
const seen = [];
const es = new EventSource(process.argv[1]);
es.onmessage = (e) => seen.push(["message", e.data]);
es.addEventListener("tandem.timings", (e) => seen.push(["tandem.timings", e.data]));
es.onerror = () => { es.close(); console.log(JSON.stringify(seen)); };
"""


def _node_with_eventsource() -> str | None:
    node = shutil.which("node")
    if node is None:
        return None
    probe = subprocess.run(
        [node, "--experimental-eventsource", "-e", "process.exit(typeof EventSource === 'function' ? 0 : 1)"],
        capture_output=True,
        check=False,
    )
    return node if probe.returncode == 0 else None


@pytest.mark.skipif(_node_with_eventsource() is None, reason="needs node with EventSource")
async def test_a_browser_eventsource_over_a_socket(recorded: Recorded) -> None:
    node = _node_with_eventsource()
    assert node is not None
    truth = [[kind, data] for kind, data in parse_event_stream(recorded.body)]
    failures = {}
    for name in ["as written", "one byte per read"]:
        async with replaying(SCHEDULES[name](recorded), gap_s=0.005 if name == "as written" else 0.0) as url:
            proc = await asyncio.create_subprocess_exec(
                node,
                "--experimental-eventsource",
                "--no-warnings",
                "-e",
                EVENTSOURCE_JS,
                f"{url}/events",
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
        seen = json.loads(out)
        if seen != truth:
            failures[name] = seen[:3]
    assert not failures, report(failures)
