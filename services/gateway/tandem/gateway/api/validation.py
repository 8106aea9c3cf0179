"""Request models for the OpenAI endpoints, and the parsing that turns a raw
body into one of them or an :class:`~tandem.common.errors.InvalidRequestError`.

Called by :mod:`tandem.gateway.api.routes`; calls pydantic only. Field types
are strict (``"max_tokens": "10"`` is an error, not 10) because silently
coercing client input hides client bugs.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from tandem.common.errors import InvalidRequestError

StrictNumber = Annotated[float, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**32)]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Lenient(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do: SDKs add new ones all the time.
    model_config = ConfigDict(extra="ignore", frozen=True)


class TextPart(_Lenient):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Lenient):
    role: Role
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class _SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: StrictStr = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictNumber | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictNumber | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    presence_penalty: StrictNumber | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictNumber | None = Field(None, ge=-2.0, le=2.0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    #: vLLM extension used by benchmarks (``vllm bench serve --ignore-eos``).
    ignore_eos: StrictBool = False

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    #: Newer OpenAI name for ``max_tokens``; either may be sent.
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    tools: list[Any] | None = None
    #: Tandem extension: the server keeps this conversation's turns; send only the new message.
    conversation_id: StrictStr | None = Field(None, min_length=1, max_length=128)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[TokenId] = Field(min_length=1)
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


RequestT = TypeVar("RequestT", bound=_SamplingFields)


def parse_body(body: bytes, model_cls: type[RequestT]) -> RequestT:
    """Parse and validate a JSON body; every failure is an InvalidRequestError."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError("Request body must be a JSON object.", code="invalid_body")
    try:
        request = model_cls.model_validate(data)
    except ValidationError as exc:
        raise _to_invalid_request(exc) from exc
    _check_supported(request)
    return request


def _to_invalid_request(exc: ValidationError) -> InvalidRequestError:
    # A union reports one error per member; the member that got furthest, with a value error rather
    # than a type error, is the one the client meant.
    first = max(
        exc.errors(include_url=False),
        key=lambda e: (len(e["loc"]), not str(e["type"]).endswith("_type")),
    )
    # Member names ("str", "list[TextPart]") are not part of the location clients know.
    loc = [str(part) for part in first["loc"] if not _is_type_tag(part)]
    param = ".".join(loc) or None
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    return InvalidRequestError(message, param=param, code=code)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "list[str]", "list[int]", "list[TextPart]"}
        or part.startswith(("function-", "list[", "constrained-"))
    )


def _check_supported(request: _SamplingFields) -> None:
    """Reject valid OpenAI options this gateway does not implement, rather than ignore them."""
    if request.n is not None and request.n != 1:
        raise InvalidRequestError("Only n=1 is supported.", param="n", code="unsupported_value")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true.",
            param="stream_options",
            code="invalid_value",
        )
    if isinstance(request, ChatCompletionRequest):
        if request.logprobs:
            raise InvalidRequestError("logprobs are not supported.", param="logprobs", code="unsupported_value")
        if request.tools:
            raise InvalidRequestError("tools are not supported.", param="tools", code="unsupported_value")
    elif isinstance(request, CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str):
            raise InvalidRequestError(
                "Only one prompt per request is supported.", param="prompt", code="unsupported_value"
            )
        if request.echo:
            raise InvalidRequestError("echo is not supported.", param="echo", code="unsupported_value")
        if request.logprobs is not None:
            raise InvalidRequestError("logprobs are not supported.", param="logprobs", code="unsupported_value")
        if request.best_of is not None and request.best_of != 1:
            raise InvalidRequestError("Only best_of=1 is supported.", param="best_of", code="unsupported_value")
        if request.suffix:
            raise InvalidRequestError("suffix is not supported.", param="suffix", code="unsupported_value")
