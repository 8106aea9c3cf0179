"""HTTP route handlers: OpenAI endpoints, model list, health, readiness, metrics.

Called by Starlette (routes are assembled in :mod:`tandem.gateway.app`); calls
validation, prompt building and the orchestrator, in that order. Every error
that comes from client input leaves here as an OpenAI-shaped 4xx.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.common.errors import InvalidRequestError, TandemError
from tandem.common.ids import new_request_id
from tandem.gateway.api.errors import ModelNotFoundError, RequestTooLargeError, api_error_from
from tandem.gateway.api.generation import GenerationResponse, RequestTiming
from tandem.gateway.api.validation import ChatCompletionRequest, CompletionRequest, parse_body
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.orchestrator import GenerationJob, Orchestrator, SamplingParams
from tandem.gateway.prompt import PromptTokenizer, chat_prompt_ids, text_prompt_ids
from tandem.gateway.readiness import ReadinessCheck
from tandem.gateway.sse import ResponseMeta

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


def _services(request: Request) -> GatewayServices:
    services: GatewayServices = request.app.state.services
    return services


Handler = Callable[[Request], Awaitable[Response]]


def _openai_errors(endpoint: str, handler: Handler) -> Handler:
    """Turn TandemErrors raised before generation starts into OpenAI error responses (and count them)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except TandemError as exc:
            error = api_error_from(exc)
            _services(request).metrics.requests_total.labels(endpoint=endpoint, status=str(error.status_code)).inc()
            return error.response()

    return wrapped


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


def _check_model(model: str, limits: ModelLimits) -> None:
    if model != limits.served_model_name:
        raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _resolve_max_tokens(requested: int | None, num_prompt_tokens: int, limits: ModelLimits, param: str) -> int:
    remaining = limits.max_model_len - num_prompt_tokens
    if num_prompt_tokens == 0:
        raise InvalidRequestError("The prompt is empty.", param=param, code="invalid_value")
    if remaining < 1 or (requested is not None and requested > remaining):
        asked = (
            f"{num_prompt_tokens + (requested or 1)} tokens ({num_prompt_tokens} in the {param}, "
            f"{requested or 1} in the completion)"
        )
        raise InvalidRequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{asked}. Please reduce the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return requested if requested is not None else min(limits.default_max_tokens, remaining)


def _sampling(body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=tuple(body.stop_strings()),
        ignore_eos=body.ignore_eos,
    )


async def _chat_completions(request: Request) -> Response:
    received_s = time.monotonic()
    services = _services(request)
    limits = services.limits
    body = parse_body(await _read_body(request, limits.max_body_bytes), ChatCompletionRequest)
    _check_model(body.model, limits)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    prompt_ids = await chat_prompt_ids(services.tokenizer, messages)
    services.metrics.observe_stage("tokenize", time.monotonic() - received_s)
    max_tokens = _resolve_max_tokens(body.requested_max_tokens(), len(prompt_ids), limits, "messages")
    request_id = f"chatcmpl-{new_request_id()}"
    return _generation_response(services, body, request_id, prompt_ids, max_tokens, "chat", CHAT_ENDPOINT, received_s)


async def _completions(request: Request) -> Response:
    received_s = time.monotonic()
    services = _services(request)
    limits = services.limits
    body = parse_body(await _read_body(request, limits.max_body_bytes), CompletionRequest)
    _check_model(body.model, limits)
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt_ids = await text_prompt_ids(services.tokenizer, prompt)
    elif prompt and isinstance(prompt[0], str):
        prompt_ids = await text_prompt_ids(services.tokenizer, str(prompt[0]))
    else:
        prompt_ids = [int(i) for i in prompt]
    services.metrics.observe_stage("tokenize", time.monotonic() - received_s)
    max_tokens = _resolve_max_tokens(body.requested_max_tokens(), len(prompt_ids), limits, "prompt")
    request_id = f"cmpl-{new_request_id()}"
    return _generation_response(
        services, body, request_id, prompt_ids, max_tokens, "text", COMPLETIONS_ENDPOINT, received_s
    )


def _generation_response(
    services: GatewayServices,
    body: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    prompt_ids: list[int],
    max_tokens: int,
    kind: str,
    endpoint: str,
    received_s: float,
) -> GenerationResponse:
    job = GenerationJob(
        request_id=request_id,
        model=services.limits.served_model_name,
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=_sampling(body),
    )
    meta = ResponseMeta(
        id=request_id,
        created=int(time.time()),
        model=body.model,
        kind="chat" if kind == "chat" else "text",
        include_usage=body.include_usage,
    )
    return GenerationResponse(
        orchestrator=services.orchestrator,
        job=job,
        meta=meta,
        stream=body.stream,
        metrics=services.metrics,
        timing=RequestTiming(endpoint=endpoint, received_s=received_s),
    )


chat_completions = _openai_errors(CHAT_ENDPOINT, _chat_completions)
completions = _openai_errors(COMPLETIONS_ENDPOINT, _completions)


def _model_card(services: GatewayServices) -> dict[str, object]:
    return {
        "id": services.limits.served_model_name,
        "object": "model",
        "created": services.started_unix_s,
        "owned_by": "tandem",
        "max_model_len": services.limits.max_model_len,
    }


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(_services(request))]})


async def get_model(request: Request) -> Response:
    services = _services(request)
    model = request.path_params["model"]
    try:
        _check_model(model, services.limits)
    except TandemError as exc:
        return api_error_from(exc).response()
    return JSONResponse(_model_card(services))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    report = await _services(request).readiness.check()
    return JSONResponse(
        {"status": "ready" if report.ready else "not ready", **report.to_dict()},
        status_code=200 if report.ready else 503,
    )


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_services(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
