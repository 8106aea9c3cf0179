"""Builds the gateway's Starlette app from its parts.

Called by :mod:`tandem.gateway.__main__` (real parts) and by tests (fakes);
calls nothing at import time. Every dependency can be passed in, so a test can
swap the router (a fake :class:`~tandem.gateway.router.Router`), the
workers (fake gRPC servers) or Redis (a private redis-server) without patching.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Mapping

import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tandem.common.adapters import AdapterCatalog
from tandem.gateway import playground
from tandem.gateway.adapter_admin import AdapterAdmin
from tandem.gateway.adapters import ModelResolver
from tandem.gateway.api import openapi, routes
from tandem.gateway.api.background_responses import BackgroundResponses
from tandem.gateway.api.errors import ApiError, internal_error
from tandem.gateway.api.generation import StreamLimits
from tandem.gateway.api.prepare import MAX_BYTES_PER_TOKEN
from tandem.gateway.api.response_events import EventLog
from tandem.gateway.api.services import GatewayServices, ModelLimits, ServedModelServices
from tandem.gateway.conversations import ConversationStore
from tandem.gateway.drain import Drain
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.orchestrator import Orchestrator
from tandem.gateway.prefix_hashes import PromptHasher
from tandem.gateway.prompt import PromptTokenizer
from tandem.gateway.quota.redis_quota import RedisQuota
from tandem.gateway.readiness import ReadinessCheck
from tandem.gateway.redis_client import connect
from tandem.gateway.router import Router
from tandem.gateway.settings import GatewaySettings, ServedModel
from tandem.gateway.storage_quota import StorageQuota
from tandem.gateway.tenancy.auth import Authenticator
from tandem.gateway.tenancy.rejections import RejectionLimiter
from tandem.gateway.tenancy.store import TenantStore
from tandem.gateway.usage import UsageStore
from tandem.gateway.usage_sweeper import UsageSweeper
from tandem.gateway.workers import WorkerChannels

logger = logging.getLogger(__name__)

_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"Unknown path {request.url.path}.", 405: f"Method {request.method} not allowed."}.get(
        exc.status_code, str(exc.detail)
    )
    return ApiError(
        exc.status_code, message, code=_HTTP_ERROR_CODES.get(exc.status_code), headers=dict(exc.headers or {})
    ).response()


async def _unhandled(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s", request.url.path, exc_info=exc)
    return internal_error().response()


def replica_id() -> str:
    """This gateway process among all replicas and their restarts: host, pid and a random part."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _model_limits(settings: GatewaySettings, model: ServedModel) -> ModelLimits:
    return ModelLimits(
        served_model_name=model.name,
        max_model_len=model.max_model_len,
        default_max_tokens=settings.default_max_tokens,
        max_body_bytes=settings.max_body_bytes,
        max_prompt_bytes=settings.max_prompt_bytes or MAX_BYTES_PER_TOKEN * model.max_model_len,
    )


def _served_models(
    settings: GatewaySettings,
    default_tokenizer: PromptTokenizer,
    tokenizers: Mapping[str, PromptTokenizer],
    tool_tokenizers: Mapping[str, PromptTokenizer],
) -> dict[str, ServedModelServices]:
    served: dict[str, ServedModelServices] = {}
    for i, model in enumerate(settings.models):
        model_tokenizer = tokenizers.get(model.name, default_tokenizer if i == 0 else None)
        if model_tokenizer is None:
            raise ValueError(f"no tokenizer for the served model {model.name!r}")
        served[model.name] = ServedModelServices(
            _model_limits(settings, model), model_tokenizer, tool_tokenizers.get(model.name), model.tool_call_format
        )
    return served


def build_app(
    settings: GatewaySettings,
    *,
    router: Router,
    tokenizer: PromptTokenizer,
    readiness: ReadinessCheck,
    metrics: GatewayMetrics | None = None,
    workers: WorkerChannels | None = None,
    redis_client: aioredis.Redis | None = None,
    drain: Drain | None = None,
    prompt_hasher: PromptHasher | None = None,
    tokenizers: Mapping[str, PromptTokenizer] | None = None,
    tool_tokenizers: Mapping[str, PromptTokenizer] | None = None,
) -> Starlette:
    """The ASGI app. Worker channels and Redis are closed and pending cleanups drained at shutdown.

    ``tokenizers``: each served model's tokenizer by name (``settings.models``); ``tokenizer`` is the
    default (first) model's when ``tokenizers`` lacks it. A served model with no tokenizer: ValueError.
    ``tool_tokenizers``: the tokenizers with a served model's tool chat template, by name (a model missing
    here refuses ``tool_choice: "auto"``)."""
    metrics = metrics if metrics is not None else GatewayMetrics()
    workers = workers if workers is not None else WorkerChannels(settings.tls)
    drain = drain if drain is not None else Drain()
    owns_redis = redis_client is None
    client = (
        redis_client
        if redis_client is not None
        else connect(settings.redis.connection_url(), timeout_s=settings.tenancy.redis_timeout_s)
    )
    tenancy = settings.tenancy
    prefix = tenancy.key_prefix
    store = TenantStore(client, key_prefix=prefix)
    fail_open = tenancy.fail_mode == "open"
    if settings.auth.mode == "disabled":
        logger.warning("authentication is disabled: every request is the anonymous tenant")
    usage = UsageStore(client, key_prefix=prefix, replica_id=replica_id(), fail_open=fail_open)
    # A concurrency slot outlives the longest request, so a replica that dies cannot hold it for long.
    quota = RedisQuota(client, key_prefix=prefix, lease_s=settings.request_timeout_s + 30, fail_open=fail_open)
    sweeper = UsageSweeper(
        usage,
        liveness_s=tenancy.usage_liveness_s,
        sweep_interval_s=tenancy.usage_sweep_interval_s,
        end_reservation=router.release,
        free_slot=quota.free_slot,
    )
    orchestrator = Orchestrator(
        router,
        workers,
        metrics=metrics,
        prefill_timeout_s=settings.prefill_timeout_s,
        request_timeout_s=settings.request_timeout_s,
        cleanup_timeout_s=settings.cleanup_timeout_s,
        router_unavailable_wait_s=settings.router_unavailable_wait_s,
        prompt_hasher=prompt_hasher,
        kv_prefetch=settings.kv_prefetch,
        max_migrations=settings.max_migrations_per_request,
    )
    # The adapter catalog lives beside the worker registry (its readers are the workers of each model).
    catalog = AdapterCatalog(client, key_prefix=settings.registry.key_prefix)
    served = _served_models(settings, tokenizer, tokenizers or {}, tool_tokenizers or {})
    served_models = tuple(m.name for m in settings.models)
    default = served[served_models[0]]
    metrics.serve_models(served_models)
    conversations = ConversationStore(
        client,
        key_prefix=prefix,
        ttl_s=tenancy.conversation_ttl_s,
        max_messages=tenancy.max_conversation_messages,
        max_conversations=tenancy.max_conversations_per_tenant,
        default_max_stored_bytes=tenancy.default_max_stored_bytes_per_tenant,
    )
    background = BackgroundResponses(
        client,
        conversations,
        EventLog(client, key_prefix=prefix, ttl_s=tenancy.conversation_ttl_s),
        key_prefix=prefix,
        lease_s=tenancy.background_lease_s,
        heartbeat_interval_s=settings.stream.heartbeat_interval_s,
    )
    services = GatewayServices(
        limits=default.limits,
        tokenizer=default.tokenizer,
        tool_tokenizer=default.tool_tokenizer,
        orchestrator=orchestrator,
        readiness=readiness,
        metrics=metrics,
        started_unix_s=int(time.time()),
        authenticator=Authenticator(store, mode=settings.auth.mode, cache_s=settings.auth.cache_s, fail_open=fail_open),
        quota=quota,
        rejections=RejectionLimiter(
            client, key_prefix=prefix, limit_per_minute=settings.auth.max_rejected_requests_per_minute
        ),
        usage=usage,
        conversations=conversations,
        storage_quota=StorageQuota(tenancy.default_max_stored_bytes_per_tenant),
        drain=drain,
        stream_limits=StreamLimits(
            heartbeat_interval_s=settings.stream.heartbeat_interval_s,
            max_buffered_bytes=settings.stream.max_buffered_bytes,
            slow_reader_timeout_s=settings.stream.slow_reader_timeout_s,
        ),
        models=ModelResolver(served_models, catalog, cache_s=settings.adapter_catalog_cache_s),
        adapter_admin=AdapterAdmin(catalog, served_models),
        background=background,
        served=served,
        admin_key=settings.auth.admin_key.get_secret_value() if settings.auth.admin_key is not None else None,
        usage_progress_interval_s=tenancy.usage_progress_interval_s,
        usage_max_unsaved_tokens=tenancy.usage_max_unsaved_tokens,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sweeper.start()
        yield
        await background.aclose()
        await orchestrator.drain()
        await sweeper.stop()
        await workers.aclose()
        if owns_redis:
            await client.aclose()

    app = Starlette(
        routes=[
            Route("/", playground.page, methods=["GET"]),
            Route("/openapi.json", openapi.document, methods=["GET"]),
            Route(routes.CHAT_ENDPOINT, routes.chat_completions, methods=["POST"]),
            Route(routes.COMPLETIONS_ENDPOINT, routes.completions, methods=["POST"]),
            Route(routes.MESSAGES_ENDPOINT, routes.messages, methods=["POST"]),
            Route(routes.RESPONSES_ENDPOINT, routes.responses, methods=["POST"]),
            Route(routes.RESPONSES_ENDPOINT + "/{response_id}", routes.get_response, methods=["GET"]),
            Route(routes.RESPONSES_ENDPOINT + "/{response_id}", routes.delete_response, methods=["DELETE"]),
            Route(routes.RESPONSES_ENDPOINT + "/{response_id}/cancel", routes.cancel_response, methods=["POST"]),
            Route("/v1/models", routes.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", routes.get_model, methods=["GET"]),
            Route("/v1/usage", routes.usage, methods=["GET"]),
            Route("/v1/admin/usage", routes.admin_usage, methods=["GET"]),
            Route("/v1/admin/adapters", routes.admin_list_adapters, methods=["GET"]),
            Route("/v1/admin/adapters", routes.admin_load_adapter, methods=["POST"]),
            Route("/v1/admin/adapters/{name:path}", routes.admin_unload_adapter, methods=["DELETE"]),
            Route("/healthz", routes.healthz, methods=["GET"]),
            Route("/readyz", routes.readyz, methods=["GET"]),
            # With a port of its own (settings.metrics_port), /metrics is there and not here.
            *([Route("/metrics", routes.metrics, methods=["GET"])] if settings.metrics_port is None else []),
        ],
        exception_handlers={HTTPException: _http_exception, Exception: _unhandled},
        lifespan=lifespan,
    )
    app.state.services = services
    app.state.drain = drain
    return app


def build_metrics_app(metrics: GatewayMetrics) -> Starlette:
    """``/metrics`` alone, for ``settings.metrics_port``: the same registry the API's app records into."""

    async def serve_metrics(request: Request) -> Response:
        return routes.metrics_response(metrics)

    return Starlette(routes=[Route("/metrics", serve_metrics, methods=["GET"])])
