"""Fixtures for the gateway's unit tests: a tiny real tokenizer folder, a fake
router, fake workers served by in-process grpc.aio servers, the app behind
httpx's ASGI transport, and the app on a real uvicorn. The doubles themselves
live in :mod:`tests.kit`."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio

# Heavy imports at collection time, outside the per-test timeouts (seconds on a busy machine).
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

from tandem.common.registry import WorkerRecord
from tandem.common.tls import TLSSettings, add_port
from tandem.gateway.app import build_app
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.prefix_hashes import PromptHasher
from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.settings import GatewaySettings
from tandem.v1 import router_pb2, worker_pb2_grpc
from tests.kit.gateway import MODEL, FakeReadiness, FakeRouter, FakeWorker, make_tokenizer_dir, placement
from tests.kit.net import dead_address, serving
from tests.kit.redis import delete_prefix
from tests.kit.router import FakeRouterServicer, serving_router


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Hugging Face tokenizer folder (word-level, with a chat template) that loads in milliseconds."""
    return make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def prompt_tokenizer(tokenizer_dir: Path) -> HfPromptTokenizer:
    return HfPromptTokenizer.from_dir(tokenizer_dir)


# --- fake workers -------------------------------------------------------------------------------


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


@pytest.fixture
def free_dead_address() -> str:
    return dead_address()


# --- fake router --------------------------------------------------------------------------------


@pytest.fixture
def make_placement() -> Callable[..., router_pb2.Placement]:
    return placement


@pytest.fixture
def fake_router() -> FakeRouter:
    return FakeRouter()


# --- the app ------------------------------------------------------------------------------------


@dataclass
class Stack:
    """The app with its fakes: one prefill worker, one decode worker, the router."""

    app: Any
    router: FakeRouter
    prefill: FakeWorker
    decode: FakeWorker
    metrics: GatewayMetrics
    readiness: FakeReadiness
    client: httpx.AsyncClient
    hasher: CountingHasher


class CountingHasher(PromptHasher):
    """The real hasher over a static registry (one 4-token sha256 configuration), counting prompts hashed."""

    def __init__(self) -> None:
        record = WorkerRecord("prefill-0", "prefill", MODEL, "127.0.0.1:1", block_size_tokens=4, block_hash_seed="s")
        super().__init__(_StaticRegistry([record]))
        self.num_hashed = 0

    async def hashes(
        self, model: str, prompt_token_ids: Any, cache_salt: str, *, adapter: str = "", adapter_path: str = ""
    ) -> list[router_pb2.PromptBlockHashes]:
        self.num_hashed += 1
        return await super().hashes(model, prompt_token_ids, cache_salt, adapter=adapter, adapter_path=adapter_path)


class _StaticRegistry:
    def __init__(self, records: list[WorkerRecord]) -> None:
        self._records = records

    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        return list(self._records)


def gateway_settings(**overrides: Any) -> GatewaySettings:
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    values: dict[str, Any] = {
        "served_model_name": MODEL,
        "max_model_len": 64,
        "default_max_tokens": 16,
        "max_body_bytes": 64 * 1024,
        "cleanup_timeout_s": 1.0,
        # Off by default; the unit stack exercises the PrefetchKV call on every handoff.
        "kv_prefetch": True,
        "prefill_timeout_s": 5.0,
        "request_timeout_s": 20.0,
        # An unreachable router fails at once here; test_request_lifecycle.py tests the wait.
        "router_unavailable_wait_s": 0.0,
        # These tests are about the request path; tenancy has its own tests (test_tenancy.py and others).
        "auth": {"mode": "disabled"},
        "tenancy": {"key_prefix": prefix},
        # The adapter catalog sits under the registry's prefix: a test's adapters are its own.
        "registry": {"key_prefix": prefix},
    }
    values.update(overrides)
    return GatewaySettings(**values)


@contextlib.asynccontextmanager
async def running_stack(
    start_worker: Callable[..., Any],
    fake_router: FakeRouter,
    prompt_tokenizer: HfPromptTokenizer,
    settings: GatewaySettings | None = None,
    **app_options: Any,
) -> AsyncIterator[Stack]:
    """The unit stack: a prefill and a decode worker placed by the fake router, the gateway's app on
    ``settings`` (default :func:`gateway_settings`), ``app_options`` passed on to ``build_app``."""
    prefill = await start_worker("prefill-0")
    decode = await start_worker("decode-0")
    fake_router.placements.append(placement(prefill, decode))
    metrics = GatewayMetrics()
    readiness = FakeReadiness()
    hasher = CountingHasher()
    app = build_app(
        settings or gateway_settings(),
        router=fake_router,
        tokenizer=prompt_tokenizer,
        readiness=readiness,
        metrics=metrics,
        prompt_hasher=hasher,
        **app_options,
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        async with app.router.lifespan_context(app):
            yield Stack(app, fake_router, prefill, decode, metrics, readiness, client, hasher)


@pytest_asyncio.fixture
async def stack(
    start_worker: Callable[..., Any], fake_router: FakeRouter, prompt_tokenizer: HfPromptTokenizer
) -> AsyncIterator[Stack]:
    async with running_stack(start_worker, fake_router, prompt_tokenizer) as unit_stack:
        yield unit_stack


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
    router: FakeRouter
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
    fake_router: FakeRouter,
    prompt_tokenizer: HfPromptTokenizer,
    edge_overrides: dict[str, Any],
) -> AsyncIterator[Edge]:
    from tandem.gateway.redis_client import connect
    from tandem.gateway.tenancy.store import TenantStore

    prefill = await start_worker("prefill-0")
    decode = await start_worker("decode-0")
    fake_router.placements.append(placement(prefill, decode))
    prefix = f"tandem-unit-{uuid.uuid4().hex[:8]}"
    admin_key = "admin-" + uuid.uuid4().hex
    base = {
        "auth": {"mode": "api_key", "cache_s": 0, "admin_key": admin_key},
        "tenancy": {"key_prefix": prefix},
        "registry": {"key_prefix": prefix},
        "stream": {"heartbeat_interval_s": 0.3},
    }
    settings = gateway_settings(**_merge(base, edge_overrides))
    metrics = GatewayMetrics()
    app = build_app(
        settings,
        router=fake_router,
        tokenizer=prompt_tokenizer,
        readiness=FakeReadiness(),
        metrics=metrics,
        prompt_hasher=CountingHasher(),
    )
    redis_client = connect(settings.redis.url, timeout_s=2.0)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        async with app.router.lifespan_context(app):
            yield Edge(
                app,
                fake_router,
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


@contextlib.asynccontextmanager
async def second_replica(edge: Edge, tokenizer: HfPromptTokenizer, **tenancy: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of another gateway app beside ``edge``: the same Redis, key prefix, admin key and router, no
    memory shared with it (a second replica); ``tenancy`` adds to its tenancy settings."""
    settings = gateway_settings(
        auth={"mode": "api_key", "cache_s": 0, "admin_key": edge.admin_key},
        tenancy={"key_prefix": edge.key_prefix, **tenancy},
        registry={"key_prefix": edge.key_prefix},
    )
    replica = build_app(
        settings,
        router=edge.router,
        tokenizer=tokenizer,
        readiness=FakeReadiness(),
        metrics=GatewayMetrics(),
        prompt_hasher=CountingHasher(),
    )
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=replica), base_url="http://replica") as client,
        replica.router.lifespan_context(replica),
    ):
        yield client


@pytest_asyncio.fixture
async def edge_url(edge: Edge) -> AsyncIterator[str]:
    async with serving(edge.app) as port:
        yield f"http://127.0.0.1:{port}"


@pytest_asyncio.fixture
async def start_router() -> AsyncIterator[Callable[..., Any]]:
    """``await start_router(placement)`` → (a FakeRouterServicer handing it out, its address)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(placement_: router_pb2.Placement) -> tuple[FakeRouterServicer, str]:
            servicer = FakeRouterServicer(placement_)
            return servicer, await stack.enter_async_context(serving_router(servicer))

        yield start
