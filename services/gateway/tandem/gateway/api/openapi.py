"""The gateway's OpenAPI 3.1 document, served at ``/openapi.json``.

Called by Starlette; built once (lazily) from the pydantic request models in
:mod:`tandem.gateway.api.validation`, so the schema cannot drift from what the
handlers accept. Used by clients, and by the schemathesis test that fuzzes the
gateway for 5xx answers.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.gateway.api.anthropic_messages import MessagesRequest
from tandem.gateway.api.responses_request import ResponsesRequest
from tandem.gateway.api.validation import ChatCompletionRequest, CompletionRequest

_ERROR = {"$ref": "#/components/schemas/Error"}
_ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}


def _responses(*statuses: int, ok: dict[str, Any] | None = None, error: dict[str, Any] = _ERROR) -> dict[str, Any]:
    descriptions = {
        400: "Invalid request",
        401: "Missing, unknown or revoked API key",
        403: "The tenant may not do this",
        404: "Unknown model",
        413: "Body too large, or a conversation over the tenant's storage quota (code storage_quota_exceeded)",
        429: "Quota or concurrency limit; see Retry-After and x-ratelimit-*",
        503: "No capacity, Redis down, or draining; see Retry-After",
    }
    out: dict[str, Any] = {"200": ok or {"description": "OK", "content": {"application/json": {"schema": {}}}}}
    for status in statuses:
        out[str(status)] = {
            "description": descriptions[status],
            "content": {"application/json": {"schema": error}},
        }
    return out


@functools.cache
def build_document() -> dict[str, Any]:
    _, top = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (CompletionRequest, "validation"),
            (MessagesRequest, "validation"),
            (ResponsesRequest, "validation"),
        ],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    schemas["Error"] = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                "required": ["message", "type"],
            }
        },
        "required": ["error"],
    }
    schemas["AnthropicError"] = {
        "type": "object",
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                "required": ["type", "message"],
            },
        },
        "required": ["type", "error"],
    }
    generation_ok = {
        "description": "A completion, or an SSE stream when `stream` is true",
        "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {"type": "string"}}},
    }
    generation = _responses(400, 401, 403, 404, 413, 429, 503, ok=generation_ok)
    messages = _responses(400, 401, 403, 404, 413, 429, 503, ok=generation_ok, error=_ANTHROPIC_ERROR)
    timings_header = {
        "name": "X-Tandem-Timings",
        "in": "header",
        "required": False,
        "description": "1: add the stage breakdown (final SSE event `tandem.timings` / field `tandem_timings`).",
        "schema": {"type": "string", "enum": ["0", "1"]},
    }

    anthropic_headers = [
        {
            "name": "x-api-key",
            "in": "header",
            "required": False,
            "description": "The API key, as the anthropic SDK sends it (Authorization: Bearer works too).",
            "schema": {"type": "string"},
        },
        {
            "name": "anthropic-version",
            "in": "header",
            "required": False,
            "description": "Optional; when sent, a date (YYYY-MM-DD) from 2023-06-01 on.",
            "schema": {"type": "string"},
        },
    ]

    def post(
        summary: str, model: str, responses: dict[str, Any] = generation, headers: tuple[dict[str, Any], ...] = ()
    ) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "parameters": [timings_header, *headers],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}},
                },
                "responses": responses,
            }
        }

    response_id = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}

    def get(summary: str, *statuses: int, **extra: Any) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": _responses(*statuses), **extra}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "Tandem gateway", "version": "0.1.0"},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"apiKey": []}],
        "paths": {
            "/v1/chat/completions": post("Chat completion (OpenAI-compatible)", "ChatCompletionRequest"),
            "/v1/completions": post("Text completion (OpenAI-compatible)", "CompletionRequest"),
            "/v1/responses": post("Response (OpenAI Responses API)", "ResponsesRequest"),
            "/v1/responses/{response_id}": {
                **get(
                    "A stored response of the caller's tenant, in whatever status it is in (a background one: "
                    "queued, in_progress, completed, incomplete, cancelled, or failed, also once the gateway "
                    "generating it stopped and its lease ended); with stream=true, a response created with "
                    "background and stream true streamed again: its events after starting_after, then the new "
                    "ones until it ends (text/event-stream)",
                    400,
                    401,
                    404,
                    503,
                    parameters=[
                        response_id,
                        {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
                        {
                            "name": "starting_after",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "integer", "minimum": 0},
                        },
                    ],
                ),
                "delete": {
                    "summary": "Delete a stored response",
                    "parameters": [response_id],
                    "responses": _responses(401, 404, 503),
                },
            },
            "/v1/responses/{response_id}/cancel": {
                "post": {
                    "summary": "Cancel a background response (from any gateway replica): a queued or in-progress "
                    "one is aborted and answered cancelled, a finished one as it is; 400 for one not created "
                    "with background true",
                    "parameters": [response_id],
                    "responses": _responses(400, 401, 404, 503),
                }
            },
            "/v1/messages": post(
                "Message (Anthropic Messages API; errors in Anthropic's shape)",
                "MessagesRequest",
                messages,
                tuple(anthropic_headers),
            ),
            "/v1/models": get("Models this key may use", 401, 503),
            "/v1/models/{model}": get(
                "One model",
                401,
                403,
                404,
                503,
                parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            ),
            "/v1/usage": get(
                "The caller's own usage (all time, or one UTC day)",
                400,
                401,
                503,
                parameters=[{"name": "day", "in": "query", "required": False, "schema": {"type": "string"}}],
            ),
            "/healthz": get("Liveness", security=[]),
            "/readyz": get("Readiness (false while draining)", 503, security=[]),
        },
    }


async def document(request: Request) -> Response:
    return JSONResponse(build_document())
