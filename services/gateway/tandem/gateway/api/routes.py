"""HTTP route handlers: OpenAI endpoints, usage, model list, health, readiness, metrics.

Called by Starlette (routes are assembled in :mod:`tandem.gateway.app`); calls,
in request order: the drain check, authentication, validation, the model and
tenant checks, prompt assembly (conversation history, trimming), the quota,
then the orchestrator. Every error that comes before generation leaves here as
an OpenAI-shaped 4xx/5xx; the API key itself is never logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from tandem.common.errors import BackendUnavailableError, InvalidRequestError, TandemError
from tandem.common.ids import new_request_id
from tandem.gateway.api.errors import ModelNotFoundError, RequestTooLargeError, api_error_from
from tandem.gateway.api.generation import (
    STATUS_CLIENT_GONE,
    GenerationResponse,
    Outcome,
    RequestTiming,
    ResponseOptions,
    StreamLimits,
)
from tandem.gateway.api.validation import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestT,
    check_content_type,
    parse_body,
)
from tandem.gateway.assembly import PromptRules, assemble_chat
from tandem.gateway.conversations import ConversationStore, check_conversation_id
from tandem.gateway.drain import Drain
from tandem.gateway.errors import (
    AuthenticationError,
    PermissionDeniedError,
    RateLimitedError,
    ShuttingDownError,
)
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.orchestrator import GenerationJob, Orchestrator
from tandem.gateway.prompt import PromptTokenizer, text_prompt_ids
from tandem.gateway.quota.base import Admission, Quota
from tandem.gateway.readiness import ReadinessCheck
from tandem.gateway.sse import ResponseMeta
from tandem.gateway.tenancy.auth import Authenticator, Principal, check_admin
from tandem.gateway.tenancy.models import Tenant
from tandem.gateway.timings import TIMINGS_HEADER, StageClock, wants_timings
from tandem.gateway.usage import UsageRecord, UsageStore

logger = logging.getLogger(__name__)

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass(frozen=True)
class ModelLimits:
    served_model_name: str
    max_model_len: int
    default_max_tokens: int
    max_body_bytes: int


@dataclass(frozen=True)
class GatewayServices:
    """What the handlers use; built once by :func:`tandem.gateway.app.build_app`."""

    limits: ModelLimits
    tokenizer: PromptTokenizer
    orchestrator: Orchestrator
    readiness: ReadinessCheck
    metrics: GatewayMetrics
    started_unix_s: int
    authenticator: Authenticator
    quota: Quota
    usage: UsageStore
    conversations: ConversationStore
    drain: Drain
    stream_limits: StreamLimits
    admin_key: str | None = None


def _services(request: Request) -> GatewayServices:
    services: GatewayServices = request.app.state.services
    return services


Handler = Callable[[Request], Awaitable[Response]]


def _rejection_reason(exc: TandemError) -> str | None:
    for cls, reason in (
        (AuthenticationError, "unauthenticated"),
        (PermissionDeniedError, "forbidden"),
        (RateLimitedError, "rate_limited"),
        (ShuttingDownError, "draining"),
        (BackendUnavailableError, "backend_unavailable"),
    ):
        if isinstance(exc, cls):
            return reason
    return None


def _openai_errors(endpoint: str, handler: Handler) -> Handler:
    """Turn TandemErrors raised before generation starts into OpenAI error responses (and count them)."""

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
            return error.response()
        except ClientDisconnect:
            # The client left while sending its body (or the server cut a body that came too slowly).
            _services(request).metrics.requests_total.labels(endpoint=endpoint, status=str(STATUS_CLIENT_GONE)).inc()
            logger.info("client left before its request was read", extra={"endpoint": endpoint})
            return Response(status_code=STATUS_CLIENT_GONE)

    return wrapped


async def _read_request(request: Request, limits: ModelLimits, model_cls: type[RequestT]) -> RequestT:
    check_content_type(request.headers.get("content-type"))
    return parse_body(await _read_body(request, limits.max_body_bytes), model_cls)


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    too_large = RequestTooLargeError(f"Request body is larger than {max_body_bytes} bytes.")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_body_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _check_model(model: str, limits: ModelLimits, tenant: Tenant | None = None) -> None:
    if model != limits.served_model_name:
        raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model", code="model_not_found")
    if tenant is not None and not tenant.may_use(model):
        raise PermissionDeniedError(
            f"This API key may not use the model `{model}`.", code="model_not_allowed", param="model"
        )


def _context_tokens(limits: ModelLimits, tenant: Tenant) -> int:
    if tenant.max_context_tokens is None:
        return limits.max_model_len
    return min(limits.max_model_len, tenant.max_context_tokens)


def _resolve_max_tokens(requested: int | None, num_prompt_tokens: int, context_tokens: int, default: int) -> int:
    remaining = context_tokens - num_prompt_tokens
    if num_prompt_tokens == 0:
        raise InvalidRequestError("The prompt is empty.", param="prompt", code="invalid_value")
    if remaining < 1 or (requested is not None and requested > remaining):
        asked = (
            f"{num_prompt_tokens + (requested or 1)} tokens ({num_prompt_tokens} in the prompt, "
            f"{requested or 1} in the completion)"
        )
        raise InvalidRequestError(
            f"This model's maximum context length is {context_tokens} tokens. However, you requested "
            f"{asked}. Please reduce the length of the prompt or completion.",
            param="prompt",
            code="context_length_exceeded",
        )
    return requested if requested is not None else min(default, remaining)


async def _authenticate(request: Request, services: GatewayServices, clock: StageClock) -> Principal:
    if services.drain.draining:
        raise ShuttingDownError("This gateway replica is shutting down; retry.")
    principal = await services.authenticator.authenticate(request.headers.get("authorization"))
    clock.mark("authenticated")
    return principal


async def _chat_completions(request: Request) -> Response:
    clock = StageClock()
    services = _services(request)
    principal = await _authenticate(request, services, clock)
    tenant = principal.tenant
    limits = services.limits
    body = await _read_request(request, limits, ChatCompletionRequest)
    _check_model(body.model, limits, tenant)
    conversation_id = body.conversation_id
    history: list[dict[str, str]] = []
    if conversation_id is not None:
        check_conversation_id(conversation_id)
        history = await services.conversations.history(tenant.id, conversation_id)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    assembled = await assemble_chat(
        services.tokenizer,
        rules=PromptRules(tenant.system_prompt, tenant.allow_client_system_prompt),
        history=history,
        client_messages=messages,
        requested_max_tokens=body.requested_max_tokens(),
        default_max_tokens=limits.default_max_tokens,
        context_tokens=_context_tokens(limits, tenant),
    )
    clock.mark("prompt_built")
    services.metrics.observe_stage("tokenize", clock.marks["prompt_built"] - clock.marks["received"])
    request_id = f"chatcmpl-{new_request_id()}"
    admission = await services.quota.admit(
        tenant.id, tenant, request_id, len(assembled.prompt_ids), assembled.max_tokens
    )
    clock.mark("admitted")
    new_turns = [m for m in messages if m["role"] != "system"]

    async def on_finish(outcome: Outcome) -> None:
        await _settle(services, admission, body.model, outcome)
        if conversation_id is not None and outcome.finished is not None:
            answer = {"role": "assistant", "content": outcome.text}
            try:
                await services.conversations.append(tenant.id, conversation_id, [*new_turns, answer])
            except BackendUnavailableError as exc:
                logger.warning("conversation not saved: %s", exc, extra={"request_id": request_id})

    extra = {"conversation_id": conversation_id} if conversation_id is not None else {}
    if assembled.num_dropped_messages:
        logger.info(
            "context trimmed",
            extra={"request_id": request_id, "num_dropped_messages": assembled.num_dropped_messages},
        )
    return _generation_response(
        services,
        request,
        body,
        principal,
        request_id,
        assembled.prompt_ids,
        assembled.max_tokens,
        "chat",
        CHAT_ENDPOINT,
        clock,
        admission,
        on_finish,
        extra,
    )


async def _settle(services: GatewayServices, admission: Admission, model: str, outcome: Outcome) -> None:
    """Reconcile the quota with what was generated and record usage — also for aborted requests."""
    await services.quota.settle(admission, outcome.num_completion_tokens)
    if outcome.status >= 400 and outcome.num_completion_tokens == 0 and outcome.status != 499:
        return  # nothing ran on the engines worth billing (the prompt charge stays in the bucket)
    cached = outcome.finished.usage.cached_tokens if outcome.finished is not None else 0
    await services.usage.record(
        UsageRecord(
            tenant_id=admission.tenant_id,
            model=model,
            num_prompt_tokens=admission.num_input_tokens,
            num_completion_tokens=outcome.num_completion_tokens,
            num_cached_tokens=cached,
            aborted=outcome.finished is None,
            request_id=admission.request_id,
        )
    )


async def _completions(request: Request) -> Response:
    clock = StageClock()
    services = _services(request)
    principal = await _authenticate(request, services, clock)
    tenant = principal.tenant
    limits = services.limits
    body = await _read_request(request, limits, CompletionRequest)
    _check_model(body.model, limits, tenant)
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt_ids = await text_prompt_ids(services.tokenizer, prompt)
    elif prompt and isinstance(prompt[0], str):
        prompt_ids = await text_prompt_ids(services.tokenizer, str(prompt[0]))
    else:
        prompt_ids = [int(i) for i in prompt]
    clock.mark("prompt_built")
    services.metrics.observe_stage("tokenize", clock.marks["prompt_built"] - clock.marks["received"])
    max_tokens = _resolve_max_tokens(
        body.requested_max_tokens(), len(prompt_ids), _context_tokens(limits, tenant), limits.default_max_tokens
    )
    request_id = f"cmpl-{new_request_id()}"
    admission = await services.quota.admit(tenant.id, tenant, request_id, len(prompt_ids), max_tokens)
    clock.mark("admitted")

    async def on_finish(outcome: Outcome) -> None:
        await _settle(services, admission, body.model, outcome)

    return _generation_response(
        services,
        request,
        body,
        principal,
        request_id,
        prompt_ids,
        max_tokens,
        "text",
        COMPLETIONS_ENDPOINT,
        clock,
        admission,
        on_finish,
        {},
    )


def _generation_response(
    services: GatewayServices,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    principal: Principal,
    request_id: str,
    prompt_ids: list[int],
    max_tokens: int,
    kind: str,
    endpoint: str,
    clock: StageClock,
    admission: Admission,
    on_finish: Callable[[Outcome], Coroutine[Any, Any, None]],
    extra_fields: Mapping[str, object],
) -> GenerationResponse:
    tenant = principal.tenant
    job = GenerationJob(
        request_id=request_id,
        model=services.limits.served_model_name,
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=body.sampling_params(),
        tenant=tenant.id,
        cache_salt=tenant.cache_salt,
        priority=tenant.priority_class,
        clock=clock,
    )
    meta = ResponseMeta(
        id=request_id,
        created=int(time.time()),
        model=body.model,
        kind="chat" if kind == "chat" else "text",
        include_usage=body.include_usage,
        logprobs=job.sampling.logprobs is not None,
    )
    logger.info(
        "request admitted",
        extra={
            "request_id": request_id,
            "tenant": tenant.id,
            "key_id": principal.key_id,
            "num_prompt_tokens": len(prompt_ids),
            "max_tokens": max_tokens,
        },
    )
    return GenerationResponse(
        orchestrator=services.orchestrator,
        job=job,
        meta=meta,
        stream=body.stream,
        metrics=services.metrics,
        timing=RequestTiming(endpoint=endpoint, received_s=clock.marks["received"]),
        drain=services.drain,
        limits=services.stream_limits,
        options=ResponseOptions(
            headers=admission.headers,
            timings=wants_timings(request.headers.get(TIMINGS_HEADER)),
            extra_fields=dict(extra_fields),
            on_finish=on_finish,
        ),
    )


chat_completions = _openai_errors(CHAT_ENDPOINT, _chat_completions)
completions = _openai_errors(COMPLETIONS_ENDPOINT, _completions)


async def _usage(request: Request) -> Response:
    services = _services(request)
    principal = await services.authenticator.authenticate(request.headers.get("authorization"))
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


def _model_card(services: GatewayServices) -> dict[str, object]:
    return {
        "id": services.limits.served_model_name,
        "object": "model",
        "created": services.started_unix_s,
        "owned_by": "tandem",
        "max_model_len": services.limits.max_model_len,
    }


async def _list_models(request: Request) -> Response:
    services = _services(request)
    principal = await services.authenticator.authenticate(request.headers.get("authorization"))
    cards = [_model_card(services)] if principal.tenant.may_use(services.limits.served_model_name) else []
    return JSONResponse({"object": "list", "data": cards})


async def _get_model(request: Request) -> Response:
    services = _services(request)
    principal = await services.authenticator.authenticate(request.headers.get("authorization"))
    _check_model(request.path_params["model"], services.limits, principal.tenant)
    return JSONResponse(_model_card(services))


list_models = _openai_errors("/v1/models", _list_models)
get_model = _openai_errors("/v1/models/{model}", _get_model)


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
    return Response(generate_latest(_services(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
