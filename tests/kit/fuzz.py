"""What the two generated-body fuzzers share (tests/unit/gateway/test_openapi_fuzz.py against fake workers
with the real workers' checks, tests/faults/test_hostile_input.py against real engines): the generation
endpoints, the shape a refusal must have on each, and how a valid body's answer is kept short."""

from __future__ import annotations

import json
from typing import Any

#: The endpoints that generate, each fuzzed with valid and invalid bodies.
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
#: The field that bounds the answer's length, per endpoint (chat also takes max_completion_tokens).
ANSWER_LENGTH_FIELDS = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/messages": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}


def error_shape(path: str, status_code: int, content: bytes) -> str:
    """'' when the answer is a refusal in the endpoint's error shape (OpenAI's; Anthropic's on /v1/messages),
    else what is wrong with it."""
    try:
        body = json.loads(content)
        error = body["error"]
        if path == "/v1/messages" and body["type"] != "error":
            return f"{status_code} without Anthropic's error type: {content[:200]!r}"
    except (ValueError, KeyError, TypeError):
        return f"{status_code} without an error body: {content[:200]!r}"
    if not (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)):
        return f"{status_code} with a malformed error: {error!r}"[:300]
    return ""


def capped(path: str, body: Any, max_tokens: int) -> Any:
    """A valid generated body of ``path`` with its answer at most ``max_tokens`` long (invalid values stay)."""
    if not isinstance(body, dict):
        return body
    fields = ANSWER_LENGTH_FIELDS[path]
    for name in fields:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_tokens:
            body[name] = max_tokens
    if all(body.get(name) is None for name in fields):
        body[fields[0]] = max_tokens
    return body
