"""Fixtures for the gateway's unit tests: a tiny real tokenizer folder, a fake
router (Scheduler), fake workers served by in-process grpc.aio servers, the
app behind httpx's ASGI transport, and the app on a real uvicorn.

Fakes live here (not in an importable helper module) so the tests need no
sys.path tricks; tests reach them through fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio
import uvicorn

# Heavy imports at collection time, outside the per-test timeouts (seconds on a busy machine).
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

from tandem.common.errors import TandemError
from tandem.common.tls import TLSSettings, add_port
from tandem.gateway.app import build_app
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.readiness import ReadinessReport
from tandem.gateway.settings import GatewaySettings
from tandem.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"
WORDS = [
    "system",
    "user",
    "assistant",
    "developer",
    "hello",
    "world",
    "hi",
    "there",
    "how",
    "are",
    "you",
    "one",
    "two",
    "three",
    "four",
    "five",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Hugging Face tokenizer folder (word-level, with a chat template) that loads in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for word in WORDS:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def prompt_tokenizer(tokenizer_dir: Path) -> HfPromptTokenizer:
    return HfPromptTokenizer.from_dir(tokenizer_dir)


# --- fake workers -------------------------------------------------------------------------------


@dataclass
class DecodeStep:
    text: str
    token_ids: Sequence[int]
    finish_reason: str = ""


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A scripted tandem.v1.Worker. Records every call; reports a cancelled Decode stream."""

    worker_id: str
    first_text: str = "Hello"
    first_token_id: int = 101
    prefill_finish_reason: str = ""
    num_cached_tokens: int = 2
    prefill_error: grpc.StatusCode | None = None
    decode_steps: list[DecodeStep] = field(
        default_factory=lambda: [
            DecodeStep(" world", [102]),
            DecodeStep("", [103]),  # a token that completes no character yet
            DecodeStep("!", [104], "stop"),
        ]
    )
    decode_step_delay_s: float = 0.0
    #: After this many steps the stream stalls until cancelled (None: never).
    decode_hang_after: int | None = None
    #: After this many steps the stream fails with INTERNAL (None: never).
    decode_fail_after: int | None = None
    address: str = ""
    prefill_requests: list[worker_pb2.PrefillRequest] = field(default_factory=list)
    decode_requests: list[worker_pb2.DecodeRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    decode_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    aborted_event: asyncio.Event = field(default_factory=asyncio.Event)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: Any) -> worker_pb2.PrefillResponse:
        self.prefill_requests.append(request)
        if self.prefill_error is not None:
            await context.abort(self.prefill_error, "scripted prefill failure")
        response = worker_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=self.first_token_id,
            first_text=self.first_text,
            finish_reason=self.prefill_finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
        )
        if request.keep_kv and not self.prefill_finish_reason:
            response.kv_handle.CopyFrom(
                common_pb2.KVHandle(
                    engine_id=self.worker_id,
                    kv_address="127.0.0.1:1",
                    remote_request_id=request.request_id,
                    block_ids=[7, 8],
                    num_tokens=len(request.prompt_token_ids),
                )
            )
        return response

    async def Decode(self, request: worker_pb2.DecodeRequest, context: Any) -> AsyncIterator[worker_pb2.DecodeChunk]:
        self.decode_requests.append(request)
        try:
            for index, step in enumerate(self.decode_steps):
                if self.decode_hang_after is not None and index >= self.decode_hang_after:
                    await asyncio.sleep(3600)
                if self.decode_fail_after is not None and index >= self.decode_fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, "scripted decode failure")
                if self.decode_step_delay_s:
                    await asyncio.sleep(self.decode_step_delay_s)
                chunk = worker_pb2.DecodeChunk(
                    text=step.text, token_ids=list(step.token_ids), finish_reason=step.finish_reason
                )
                if step.finish_reason:
                    chunk.stats.num_output_tokens = sum(len(s.token_ids) for s in self.decode_steps)
                yield chunk
        except asyncio.CancelledError:
            self.decode_cancelled.set()
            raise

    async def Abort(self, request: worker_pb2.AbortRequest, context: Any) -> worker_pb2.AbortResponse:
        self.aborted.append(request.request_id)
        self.aborted_event.set()
        return worker_pb2.AbortResponse(found=True)

    def ref(self, role: str) -> router_pb2.WorkerRef:
        return router_pb2.WorkerRef(worker_id=self.worker_id, role=role, address=self.address)


@pytest_asyncio.fixture
async def start_worker() -> AsyncIterator[Callable[..., Any]]:
    """``await start_worker("prefill-0", **script)`` → a FakeWorker listening on 127.0.0.1.

    ``tls=`` serves it over (m)TLS instead of plaintext; ``worker_cls=`` a FakeWorker subclass.
    """
    servers: list[grpc.aio.Server] = []

    async def start(
        worker_id: str, *, tls: TLSSettings | None = None, worker_cls: type[FakeWorker] = FakeWorker, **script: Any
    ) -> FakeWorker:
        worker = worker_cls(worker_id=worker_id, **script)
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        port = add_port(server, "127.0.0.1:0", tls or TLSSettings())
        assert port, "could not bind the fake worker's port"
        await server.start()
        servers.append(server)
        worker.address = f"127.0.0.1:{port}"
        return worker

    yield start
    for server in servers:
        await server.stop(grace=None)


def start_redis(port: int, *args: str) -> subprocess.Popen[bytes]:
    """A private redis-server on 127.0.0.1:``port`` (``args``: more of its options), once it accepts connections."""
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("redis-server did not start")


def dead_address() -> str:
    """An address where nothing listens (connecting gives UNAVAILABLE at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def free_dead_address() -> str:
    return dead_address()


# --- fake router --------------------------------------------------------------------------------


@dataclass
class FakeScheduler:
    """Hands out scripted placements (the last one repeats) or raises a scripted error."""

    placements: list[router_pb2.Placement] = field(default_factory=list)
    error: TandemError | None = None
    schedule_calls: list[dict[str, Any]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    released_event: asyncio.Event = field(default_factory=asyncio.Event)
    #: How long each Schedule takes (a router queueing the request).
    schedule_delay_s: float = 0.0
    #: Errors raised by the first Schedule calls, one each, before the scripted behaviour.
    fail_first: list[TandemError] = field(default_factory=list)

    async def schedule(
        self,
        request_id: str,
        model: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        tenant: str,
        cache_salt: str,
        exclude_worker_ids: Sequence[str],
        priority: str = "",
    ) -> router_pb2.Placement:
        self.schedule_calls.append(
            {
                "request_id": request_id,
                "model": model,
                "prompt_token_ids": list(prompt_token_ids),
                "max_tokens": max_tokens,
                "exclude_worker_ids": list(exclude_worker_ids),
                "tenant": tenant,
                "cache_salt": cache_salt,
                "priority": priority,
            }
        )
        if self.schedule_delay_s:
            await asyncio.sleep(self.schedule_delay_s)
        if self.fail_first:
            raise self.fail_first.pop(0)
        if self.error is not None:
            raise self.error
        index = min(len(self.schedule_calls) - 1, len(self.placements) - 1)
        placement = router_pb2.Placement()
        placement.CopyFrom(self.placements[index])
        placement.request_id = request_id
        return placement

    async def release(self, request_id: str) -> None:
        self.released.append(request_id)
        self.released_event.set()


def placement(prefill: FakeWorker | router_pb2.WorkerRef, decode: FakeWorker) -> router_pb2.Placement:
    prefill_ref = prefill.ref("prefill") if isinstance(prefill, FakeWorker) else prefill
    return router_pb2.Placement(prefill=prefill_ref, decode=decode.ref("decode"), lease_s=30.0)


@pytest.fixture
def make_placement() -> Callable[..., router_pb2.Placement]:
    return placement


@pytest.fixture
def fake_scheduler() -> FakeScheduler:
    return FakeScheduler()


# --- the app ------------------------------------------------------------------------------------


@dataclass
class FakeReadiness:
    report: ReadinessReport = field(default_factory=lambda: ReadinessReport(True, True, 1, 1))

    async def check(self) -> ReadinessReport:
        return self.report


@dataclass
class Stack:
    """The app with its fakes: one prefill worker, one decode worker, the scheduler."""

    app: Any
    scheduler: FakeScheduler
    prefill: FakeWorker
    decode: FakeWorker
    metrics: GatewayMetrics
    readiness: FakeReadiness
    client: httpx.AsyncClient


def gateway_settings(**overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = {
        "served_model_name": MODEL,
        "max_model_len": 64,
        "default_max_tokens": 16,
        "max_body_bytes": 64 * 1024,
        "cleanup_timeout_s": 1.0,
        "prefill_timeout_s": 5.0,
        "request_timeout_s": 20.0,
        # An unreachable router fails at once here; test_request_lifecycle.py tests the wait.
        "router_unavailable_wait_s": 0.0,
        # These tests are about the request path; tenancy has its own tests (test_tenancy.py and others).
        "auth": {"mode": "disabled"},
        "tenancy": {"key_prefix": f"tandem-unit-{uuid.uuid4().hex[:8]}"},
    }
    values.update(overrides)
    return GatewaySettings(**values)


@pytest_asyncio.fixture
async def stack(
    start_worker: Callable[..., Any], fake_scheduler: FakeScheduler, prompt_tokenizer: HfPromptTokenizer
) -> AsyncIterator[Stack]:
    prefill = await start_worker("prefill-0")
    decode = await start_worker("decode-0")
    fake_scheduler.placements.append(placement(prefill, decode))
    metrics = GatewayMetrics()
    readiness = FakeReadiness()
    app = build_app(
        gateway_settings(),
        scheduler=fake_scheduler,
        tokenizer=prompt_tokenizer,
        readiness=readiness,
        metrics=metrics,
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        async with app.router.lifespan_context(app):
            yield Stack(app, fake_scheduler, prefill, decode, metrics, readiness, client)


@contextlib.asynccontextmanager
async def serving(app: Any, **config: Any) -> AsyncIterator[int]:
    """``app`` on a real uvicorn on a free loopback port (yields the port); ``config`` goes to uvicorn.Config."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options: dict[str, Any] = {"log_config": None, "lifespan": "off", "timeout_graceful_shutdown": 2, **config}
    server = uvicorn.Server(uvicorn.Config(app, **options))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest_asyncio.fixture
async def live_url(stack: Stack) -> AsyncIterator[str]:
    """The stack's app on a real uvicorn (real sockets, real disconnects)."""
    async with serving(stack.app) as port:
        yield f"http://127.0.0.1:{port}"


async def wait_for(event: asyncio.Event, timeout_s: float = 2.0) -> None:
    await asyncio.wait_for(event.wait(), timeout_s)


@pytest.fixture
def wait() -> Callable[..., Any]:
    return wait_for


# --- tenancy: the app with API keys, quotas and Redis -------------------------------------------------------


@dataclass
class Edge:
    """The app with auth on, its Redis store, and helpers to make tenants and keys."""

    app: Any
    scheduler: FakeScheduler
    prefill: FakeWorker
    decode: FakeWorker
    metrics: GatewayMetrics
    client: httpx.AsyncClient
    store: Any
    redis: Any
    key_prefix: str
    admin_key: str

    async def tenant(self, tenant_id: str, **policy: Any) -> str:
        """Create a tenant with ``policy`` and return a fresh key of it."""
        from tandem.gateway.tenancy.models import Tenant

        await self.store.put_tenant(Tenant(id=tenant_id, **policy))
        _, key = await self.store.create_key(tenant_id)
        return key

    async def settled(self, timeout_s: float = 5.0) -> None:
        """Wait until every request ended and its completion work (quota, usage, conversation) ran."""
        services = self.app.state.services
        deadline = asyncio.get_running_loop().time() + timeout_s
        while services.drain.num_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        await services.orchestrator.drain()


async def delete_prefix(client: Any, prefix: str) -> None:
    async for key in client.scan_iter(match=f"{prefix}:*", count=500):
        await client.delete(key)


@pytest.fixture
def edge_overrides() -> dict[str, Any]:
    """Settings of the ``edge`` app beyond the defaults below; a test module overrides this fixture."""
    return {}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in extra.items():
        out[name] = {**out[name], **value} if isinstance(value, dict) and isinstance(out.get(name), dict) else value
    return out


@pytest_asyncio.fixture
async def edge(
    start_worker: Callable[..., Any],
    fake_scheduler: FakeScheduler,
    prompt_tokenizer: HfPromptTokenizer,
    edge_overrides: dict[str, Any],
) -> AsyncIterator[Edge]:
    from tandem.gateway.redis_client import connect
    from tandem.gateway.tenancy.store import TenantStore

    prefill = await start_worker("prefill-0")
    decode = await start_worker("decode-0")
    fake_scheduler.placements.append(placement(prefill, decode))
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    admin_key = "admin-" + uuid.uuid4().hex
    base = {
        "auth": {"mode": "api_key", "cache_s": 0, "admin_key": admin_key},
        "tenancy": {"key_prefix": prefix},
        "stream": {"heartbeat_interval_s": 0.3},
    }
    settings = gateway_settings(**_merge(base, edge_overrides))
    metrics = GatewayMetrics()
    app = build_app(
        settings, scheduler=fake_scheduler, tokenizer=prompt_tokenizer, readiness=FakeReadiness(), metrics=metrics
    )
    redis_client = connect(settings.redis.url, timeout_s=2.0)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        async with app.router.lifespan_context(app):
            yield Edge(
                app,
                fake_scheduler,
                prefill,
                decode,
                metrics,
                client,
                TenantStore(redis_client, key_prefix=prefix),
                redis_client,
                prefix,
                admin_key,
            )
    await delete_prefix(redis_client, prefix)
    await redis_client.aclose()


@pytest_asyncio.fixture
async def edge_url(edge: Edge) -> AsyncIterator[str]:
    async with serving(edge.app) as port:
        yield f"http://127.0.0.1:{port}"


# --- a fake router over gRPC, for gateway processes started as `python -m tandem.gateway` ------------------


@dataclass
class FakeRouter:
    """tandem.v1.Router: hands out one placement; records schedules and releases."""

    placement: router_pb2.Placement
    scheduled: list[router_pb2.ScheduleRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    async def Schedule(self, request: router_pb2.ScheduleRequest, context: Any) -> router_pb2.Placement:
        self.scheduled.append(request)
        reply = router_pb2.Placement()
        reply.CopyFrom(self.placement)
        reply.request_id = request.request_id
        return reply

    async def Release(self, request: router_pb2.RouterReleaseRequest, context: Any) -> router_pb2.RouterReleaseResponse:
        self.released.append(request.request_id)
        return router_pb2.RouterReleaseResponse(found=True)


@pytest_asyncio.fixture
async def start_router() -> AsyncIterator[Callable[..., Any]]:
    from tandem.v1 import router_pb2_grpc

    servers: list[grpc.aio.Server] = []

    async def start(placement_: router_pb2.Placement) -> tuple[FakeRouter, str]:
        router = FakeRouter(placement_)
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(router, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return router, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(grace=None)
