"""HTTP route handlers: OpenAI endpoints (chat, completions, Responses), Anthropic Messages, usage, model
list, admin, health, readiness, metrics.

Called by Starlette (routes are assembled in :mod:`tandem.gateway.app`). Every
generation endpoint runs one pipeline (``/v1/messages`` translated into a chat
request by :mod:`~tandem.gateway.api.anthropic_messages` and written back by
:mod:`~tandem.gateway.api.anthropic_wire`, ``/v1/responses`` likewise by
:mod:`~tandem.gateway.api.responses_request` and :mod:`~tandem.gateway.api.responses_wire`):
:func:`~tandem.gateway.api.prepare.prepare` (drain check, authentication, validation, model and
tenant checks, prompt and context fit) yields a frozen prepared request, the quota admits it, and a
streamed (:mod:`~tandem.gateway.api.streaming`) or complete
(:mod:`~tandem.gateway.api.complete`) response runs it through the orchestrator.
Every error that comes before generation leaves here as a 4xx/5xx in the
endpoint's error shape (OpenAI's, or Anthropic's for ``/v1/messages``); the API key itself is never logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from tandem.common.errors import BackendUnavailableError, InvalidRequestError, TandemError
from tandem.gateway.api import admin_adapters, models_list, stored_responses
from tandem.gateway.api.anthropic_messages import DIALECT as ANTHROPIC_DIALECT
from tandem.gateway.api.anthropic_messages import check_version
from tandem.gateway.api.anthropic_tool_wire import AnthropicToolWire
from tandem.gateway.api.anthropic_wire import ANTHROPIC_WIRE
from tandem.gateway.api.background_responses import with_status
from tandem.gateway.api.complete import CompleteResponse
from tandem.gateway.api.errors import api_error_from
from tandem.gateway.api.generation import (
    STATUS_CLIENT_GONE,
    GenerationResponse,
    Outcome,
    RequestTiming,
    ResponseOptions,
)
from tandem.gateway.api.prepare import Dialect, Endpoint, PreparedRequest, prepare
from tandem.gateway.api.response_chains import answer_turn
from tandem.gateway.api.responses_auto import AutoResponsesWire
from tandem.gateway.api.responses_request import DIALECT as RESPONSES_DIALECT
from tandem.gateway.api.responses_wire import echo_of, responses_wire, stored_response_bytes
from tandem.gateway.api.responses_wire import response as response_object
from tandem.gateway.api.services import GatewayServices
from tandem.gateway.api.streaming import StreamedResponse
from tandem.gateway.api.tool_wire import OpenAIToolWire
from tandem.gateway.api.tools import ToolSpec
from tandem.gateway.api.validation import ChatCompletionRequest
from tandem.gateway.api.wire import OPENAI_WIRE, WireFormat
from tandem.gateway.conversations import ANSWER_BYTES_PER_TOKEN
from tandem.gateway.errors import (
    AuthenticationError,
    PermissionDeniedError,
    RateLimitedError,
    ShuttingDownError,
    StorageQuotaExceededError,
)
from tandem.gateway.job import GenerationJob
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.quota.base import Admission
from tandem.gateway.sse import ResponseMeta
from tandem.gateway.tenancy.auth import check_admin, request_authorization
from tandem.gateway.timings import TIMINGS_HEADER, wants_timings
from tandem.gateway.usage import UsageRecord
from tandem.gateway.usage_progress import ProgressWriter

logger = logging.getLogger(__name__)

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
MESSAGES_ENDPOINT = "/v1/messages"
RESPONSES_ENDPOINT = "/v1/responses"


def _services(request: Request) -> GatewayServices:
    services: GatewayServices = request.app.state.services
    return services


Handler = Callable[[Request], Awaitable[Response]]
#: The wire format of an answer that is a tool call, for the request's tools.
ToolWire = Callable[[ToolSpec], WireFormat]


def _rejection_reason(exc: TandemError) -> str | None:
    for cls, reason in (
        (AuthenticationError, "unauthenticated"),
        (PermissionDeniedError, "forbidden"),
        (StorageQuotaExceededError, "storage_quota"),
        (RateLimitedError, "rate_limited"),
        (ShuttingDownError, "draining"),
        (BackendUnavailableError, "backend_unavailable"),
    ):
        if isinstance(exc, cls):
            return reason
    return None


def _openai_errors(endpoint: str, handler: Handler, wire: WireFormat = OPENAI_WIRE) -> Handler:
    """Turn TandemErrors raised before generation starts into error responses in ``wire``'s shape (OpenAI's
    unless told otherwise), and count them."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except TandemError as exc:
            error = api_error_from(exc)
            services = _services(request)
            services.metrics.requests_total.labels(endpoint=endpoint, status=str(error.status_code)).inc()
            reason = _rejection_reason(exc)
            if reason is not None:
                services.metrics.rejected_requests_total.labels(reason=reason).inc()
                logger.info(
                    "request refused", extra={"endpoint": endpoint, "status": error.status_code, "reason": reason}
                )
            return JSONResponse(wire.error_body(error), status_code=error.status_code, headers=error.headers or None)
        except ClientDisconnect:
            # The client left while sending its body (or the server cut a body that came too slowly).
            _services(request).metrics.requests_total.labels(endpoint=endpoint, status=str(STATUS_CLIENT_GONE)).inc()
            logger.info("client left before its request was read", extra={"endpoint": endpoint})
            return Response(status_code=STATUS_CLIENT_GONE)

    return wrapped


def _generation_handler(
    endpoint: Endpoint,
    path: str,
    *,
    dialect: Dialect | None = None,
    wire: WireFormat = OPENAI_WIRE,
    tool_wire: ToolWire = OpenAIToolWire,
    check_headers: Callable[[Request], None] | None = None,
    wire_for: Callable[[PreparedRequest], WireFormat] | None = None,
) -> Handler:
    """The one pipeline of every generation endpoint: prepare, admit, generate. ``dialect``: the body is
    another API's chat request, ``wire``: the answer is written in that API's shape (``tool_wire``'s when
    the request's tools make it a tool call), ``check_headers``: the API's own headers, checked first,
    ``wire_for``: the answer's wire format is the request's own (``wire`` then writes only the errors
    before generation)."""

    async def handle(request: Request) -> Response:
        services = _services(request)
        if check_headers is not None:
            check_headers(request)
        prepared = await prepare(request, services, endpoint, dialect)
        tenant = prepared.tenant
        admission = await services.quota.admit(
            tenant.id,
            tenant,
            prepared.request_id,
            len(prepared.prompt_token_ids),
            prepared.max_tokens,
            model=prepared.body.model,
        )
        # Usage lands only on the tenant record it was admitted under (not on one deleted, or deleted and
        # created again, meanwhile); anonymous requests (auth disabled) have no record to check.
        tenant_salt = tenant.cache_salt if prepared.principal.key_id else ""
        opened = await _open_usage(services, admission, prepared.body.model, prepared.model.base_model, tenant_salt)
        prepared.clock.mark("admitted")
        if prepared.num_dropped_messages:
            logger.info(
                "context trimmed",
                extra={"request_id": prepared.request_id, "num_dropped_messages": prepared.num_dropped_messages},
            )

        wire_now = _answer_wire(prepared, wire, tool_wire, wire_for)
        meta = _response_meta(prepared)
        # The open usage record follows the tokens sent, written off the token path (usage_progress).
        progress = ProgressWriter(
            lambda n: services.usage.progress(prepared.request_id, n),
            interval_s=services.usage_progress_interval_s,
            max_unsaved_tokens=services.usage_max_unsaved_tokens,
            request_id=prepared.request_id,
        )

        async def on_finish(outcome: Outcome) -> None:
            progress.close()
            await _settle(services, admission, prepared.body.model, prepared.model.base_model, outcome, tenant_salt)
            conversation = prepared.conversation
            if conversation is not None and outcome.finished is not None:
                answer = {"role": "assistant", "content": outcome.text}
                try:
                    appended = await services.conversations.append(
                        tenant.id,
                        conversation.id,
                        [*conversation.new_turns, answer],
                        num_dropped_history=conversation.num_dropped_history,
                        tenant_salt=tenant_salt,
                        max_stored_bytes=services.storage_quota.limit_bytes(tenant),
                    )
                    _count_forgotten(services, "conversation", appended.num_forgotten_turns)
                except BackendUnavailableError as exc:
                    logger.warning("conversation not saved: %s", exc, extra={"request_id": prepared.request_id})

        background = prepared.chain is not None and prepared.chain.background
        limit_bytes = services.storage_quota.limit_bytes(tenant)

        async def store_answer(outcome: Outcome) -> None:
            chain = prepared.stored_chain
            assert chain is not None and outcome.finished is not None
            response = wire_now.full_response(meta, outcome.text, outcome.finished, ())
            if background:  # its record is there, queued or in progress (tandem.gateway.api.background_responses)
                return await services.background.store_answer(tenant.id, tenant_salt, limit_bytes, response)
            appended = await services.conversations.append(
                tenant.id,
                chain.id,
                [*chain.new_turns, answer_turn(response)],
                tenant_salt=tenant_salt,
                max_stored_bytes=services.storage_quota.limit_bytes(tenant),
            )
            _count_forgotten(services, "response", appended.num_forgotten_turns)

        on_progress = progress.advance if opened else None
        if not background:
            return _generation_response(
                services, request, prepared, path, admission, on_finish, on_progress, wire_now, meta,
                store_answer if prepared.stored_chain is not None else None,
            )  # fmt: skip
        assert prepared.stored_chain is not None and prepared.chain is not None
        assert isinstance(prepared.body, ChatCompletionRequest)
        queued = with_status(response_object(meta, echo_of(prepared.body, prepared.chain), [], None), "queued")
        on_progress = services.background.in_progress_hook(tenant.id, tenant_salt, limit_bytes, queued, on_progress)
        generation = _generation_response(
            services, request, prepared, path, admission, on_finish, on_progress, wire_now, meta, store_answer
        )
        # A streamed one's stored events leave room for its answer (the preparation's estimate: the response
        # object and the text in it, and the text in the answer's turn).
        reserve_bytes = None
        if prepared.body.stream:
            num_answer_bytes = ANSWER_BYTES_PER_TOKEN * prepared.max_tokens
            reserve_bytes = stored_response_bytes(prepared.body, prepared.chain, prepared.max_tokens) + num_answer_bytes
        try:
            turns = prepared.stored_chain.new_turns
            return await services.background.start(
                tenant.id, tenant_salt, limit_bytes, turns, queued, generation, admission.headers, reserve_bytes
            )
        except BackendUnavailableError:  # nothing generated: the admission goes back, as for any 503
            progress.close()
            model = prepared.body.model
            await _settle(services, admission, model, prepared.model.base_model, Outcome(503), tenant_salt)
            raise

    return _openai_errors(path, handle, wire)


def _count_forgotten(services: GatewayServices, store: str, num_turns: int) -> None:
    if num_turns:
        services.metrics.stored_turns_forgotten_total.labels(store=store).inc(num_turns)


def _answer_wire(
    prepared: PreparedRequest,
    wire: WireFormat,
    tool_wire: ToolWire,
    wire_for: Callable[[PreparedRequest], WireFormat] | None,
) -> WireFormat:
    if wire_for is not None:
        return wire_for(prepared)
    if prepared.tools is not None and prepared.tools.reads_calls:
        return tool_wire(prepared.tools)  # the answer is a tool call (tandem.gateway.api.tool_wire)
    return wire


async def _open_usage(
    services: GatewayServices, admission: Admission, model: str, base_model: str, tenant_salt: str
) -> bool:
    """Open the request's usage record, so that it is billed even if this gateway dies before it ends.
    A Redis that cannot take it (down, full, read-only) turns the request away with 503 before any
    token, and the admission is given back; True when the record is open. ``model`` is the client's
    name (a base model or an adapter), ``base_model`` the base model that runs it."""
    record = UsageRecord(
        tenant_id=admission.tenant_id,
        model=model,
        base_model=base_model,
        num_prompt_tokens=admission.num_input_tokens,
        num_completion_tokens=0,
        num_cached_tokens=0,
        aborted=False,
        request_id=admission.request_id,
        tenant_salt=tenant_salt,
    )
    try:
        return await services.usage.open(record)
    except BackendUnavailableError:
        await services.quota.settle(admission, 0, served=False)
        raise


async def _settle(
    services: GatewayServices, admission: Admission, model: str, base_model: str, outcome: Outcome, tenant_salt: str
) -> None:
    """Reconcile the quota with what was generated and record usage — also for aborted requests. A
    request that failed before its first token (no capacity, a queue timeout, a worker error) costs
    nothing: no usage record, and its input charge goes back to the bucket."""
    failed_before_answer = outcome.status >= 400 and outcome.num_completion_tokens == 0 and outcome.status != 499
    await services.quota.settle(admission, outcome.num_completion_tokens, served=not failed_before_answer)
    if failed_before_answer:
        await services.usage.discard(admission.request_id)
        return
    cached = outcome.finished.usage.cached_tokens if outcome.finished is not None else 0
    await services.usage.record(
        UsageRecord(
            tenant_id=admission.tenant_id,
            model=model,
            base_model=base_model,
            num_prompt_tokens=admission.num_input_tokens,
            num_completion_tokens=outcome.num_completion_tokens,
            num_cached_tokens=cached,
            aborted=outcome.finished is None,
            request_id=admission.request_id,
            tenant_salt=tenant_salt,
        )
    )


def _response_meta(prepared: PreparedRequest) -> ResponseMeta:
    return ResponseMeta(
        id=prepared.request_id,
        created=int(time.time()),
        model=prepared.body.model,
        kind="chat" if prepared.endpoint == "chat" else "text",
        include_usage=prepared.body.include_usage,
        logprobs=prepared.sampling.logprobs is not None,
    )


def _generation_response(
    services: GatewayServices,
    request: Request,
    prepared: PreparedRequest,
    path: str,
    admission: Admission,
    on_finish: Callable[[Outcome], Coroutine[Any, Any, None]],
    on_progress: Callable[[int], Coroutine[Any, Any, None]] | None,
    wire: WireFormat,
    meta: ResponseMeta,
    on_answer: Callable[[Outcome], Coroutine[Any, Any, None]] | None,
) -> GenerationResponse:
    tenant = prepared.tenant
    body = prepared.body
    job = GenerationJob(
        request_id=prepared.request_id,
        model=prepared.model.base_model,
        adapter=prepared.model.adapter,
        adapter_path=prepared.model.adapter_path,
        prompt_token_ids=prepared.prompt_token_ids,
        max_tokens=prepared.max_tokens,
        sampling=prepared.sampling,
        tenant=tenant.id,
        cache_salt=tenant.cache_salt,
        priority=tenant.priority_class,
        clock=prepared.clock,
    )
    logger.info(
        "request admitted",
        extra={
            "request_id": prepared.request_id,
            "tenant": tenant.id,
            "key_id": prepared.principal.key_id,
            "num_prompt_tokens": len(prepared.prompt_token_ids),
            "max_tokens": prepared.max_tokens,
            "adapter": prepared.model.adapter,
        },
    )
    conversation = prepared.conversation
    response_cls = StreamedResponse if body.stream else CompleteResponse
    return response_cls(
        orchestrator=services.orchestrator,
        job=job,
        meta=meta,
        metrics=services.metrics,
        timing=RequestTiming(endpoint=path, received_s=prepared.clock.marks["received"]),
        drain=services.drain,
        limits=services.stream_limits,
        options=ResponseOptions(
            headers=admission.headers,
            timings=wants_timings(request.headers.get(TIMINGS_HEADER)),
            extra_fields={"conversation_id": conversation.id} if conversation is not None else {},
            on_finish=on_finish,
            on_progress=on_progress,
            wire=wire,
            on_answer=on_answer,
        ),
    )


chat_completions = _generation_handler("chat", CHAT_ENDPOINT)
completions = _generation_handler("completions", COMPLETIONS_ENDPOINT)
messages = _generation_handler(
    "chat",
    MESSAGES_ENDPOINT,
    dialect=ANTHROPIC_DIALECT,
    wire=ANTHROPIC_WIRE,
    tool_wire=AnthropicToolWire,
    check_headers=lambda request: check_version(request.headers.get("anthropic-version")),
)


def _responses_wire(prepared: PreparedRequest) -> WireFormat:
    assert isinstance(prepared.body, ChatCompletionRequest), "a Responses body is translated into a chat request"
    if prepared.tools is not None and prepared.tools.mode == "auto":
        return AutoResponsesWire(echo_of(prepared.body, prepared.chain), prepared.tools)
    return responses_wire(prepared.body, prepared.tools, prepared.chain)


responses = _generation_handler("chat", RESPONSES_ENDPOINT, dialect=RESPONSES_DIALECT, wire_for=_responses_wire)


get_response = _openai_errors("/v1/responses/{response_id}", stored_responses.get_response)
delete_response = _openai_errors("/v1/responses/{response_id}", stored_responses.delete_response)
cancel_response = _openai_errors("/v1/responses/{response_id}/cancel", stored_responses.cancel_response)


async def _usage(request: Request) -> Response:
    services = _services(request)
    principal = await services.authenticator.authenticate(request_authorization(request.headers))
    return JSONResponse(await services.usage.tenant_usage(principal.tenant.id, day=_day_param(request)))


async def _admin_usage(request: Request) -> Response:
    services = _services(request)
    check_admin(request.headers.get("authorization"), services.admin_key)
    day = _day_param(request)
    wanted = request.query_params.get("tenant")
    tenant_ids = [wanted] if wanted else await services.usage.tenants()
    return JSONResponse({"object": "list", "data": [await services.usage.tenant_usage(t, day=day) for t in tenant_ids]})


def _day_param(request: Request) -> str | None:
    day = request.query_params.get("day")
    if day is None:
        return None
    try:
        time.strptime(day, "%Y-%m-%d")
    except ValueError as exc:
        raise InvalidRequestError("day: use YYYY-MM-DD.", param="day", code="invalid_value") from exc
    return day


usage = _openai_errors("/v1/usage", _usage)
admin_usage = _openai_errors("/v1/admin/usage", _admin_usage)
admin_list_adapters = _openai_errors("/v1/admin/adapters", admin_adapters.list_adapters)
admin_load_adapter = _openai_errors("/v1/admin/adapters", admin_adapters.load_adapter)
admin_unload_adapter = _openai_errors("/v1/admin/adapters/{name}", admin_adapters.unload_adapter)
list_models = _openai_errors("/v1/models", models_list.list_models)
get_model = _openai_errors("/v1/models/{model}", models_list.get_model)


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    services = _services(request)
    if services.drain.draining:
        return JSONResponse({"status": "draining", "ready": False}, status_code=503)
    report = await services.readiness.check()
    return JSONResponse(
        {"status": "ready" if report.ready else "not ready", **report.to_dict()},
        status_code=200 if report.ready else 503,
    )


async def metrics(request: Request) -> Response:
    return metrics_response(_services(request).metrics)


def metrics_response(metrics: GatewayMetrics) -> Response:
    """The Prometheus exposition of ``metrics`` (on the API's port, or on its own: ``app.build_metrics_app``)."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
