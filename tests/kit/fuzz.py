"""What the two generated-body fuzzers share (tests/unit/gateway/test_openapi_fuzz.py against fake workers
with the real workers' checks, tests/faults/test_hostile_input.py against real engines): the generation
endpoints, the shape a refusal must have on each, how a valid body's answer is kept short, and the loop that
generates and sends them (:func:`fuzz_endpoint`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass
class FuzzResult:
    """What the generated requests of :func:`fuzz_endpoint` met."""

    #: Answers by HTTP status.
    statuses: dict[int, int] = field(default_factory=dict)
    #: Each answer that was a 5xx, or a refusal not in the endpoint's error shape, in a line.
    wrong: list[str] = field(default_factory=list)

    def add(self, other: FuzzResult) -> None:
        for status, num in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + num
        self.wrong.extend(other.wrong)


#: Sends one generated request: (method, path, body bytes) → the answer's status code and body bytes.
Send = Callable[[str, str, bytes], tuple[int, bytes]]


def fuzz_endpoint(
    schema_url: str, path: str, send: Send, *, negative: bool, examples: int, model: str, max_tokens: int | None = None
) -> FuzzResult:
    """Schemathesis generates ``examples`` request bodies of ``path`` from the gateway's own document at
    ``schema_url`` (valid by the schema, or invalid where ``negative``) and ``send`` sends each: every answer
    must be 200 or a 4xx in the endpoint's error shape. A valid body names ``model`` (else nearly every one is
    a 404 for an unknown model) and, with ``max_tokens``, asks for at most that many tokens. Runs hypothesis
    in the calling thread (not on an event loop's)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.core import NotSet
    from schemathesis.core.result import Err
    from schemathesis.generation import GenerationMode

    mode = GenerationMode.NEGATIVE if negative else GenerationMode.POSITIVE
    schema = schemathesis.openapi.from_url(schema_url)
    operations = []
    for found in schema.get_all_operations():
        if isinstance(found, Err):
            raise found.err()  # an operation the schema does not describe well: the document's fault
        operations.append(found.ok())
    [op] = [o for o in operations if o.path == path]
    result = FuzzResult()

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        body = None if isinstance(case.body, NotSet) else case.body
        if not negative and isinstance(body, dict):
            body["model"] = model
            if max_tokens is not None:
                body = capped(path, body, max_tokens)
        content = body if isinstance(body, bytes) else json.dumps(body, default=str).encode()
        status, answer = send(op.method.upper(), path, content)
        result.statuses[status] = result.statuses.get(status, 0) + 1
        if status >= 500 or (status != 200 and error_shape(path, status, answer)):
            text = answer[:200].decode(errors="replace")
            result.wrong.append(f"{path} {mode.value}: {status} {text} body={str(body)[:300]}")

    check()
    return result
