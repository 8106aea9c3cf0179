"""Request models for the OpenAI endpoints, and the parsing that turns a raw
body into one of them or an :class:`~tandem.common.errors.InvalidRequestError`.

Called by :mod:`tandem.gateway.api.routes`; calls pydantic only. Field types
are strict (``"max_tokens": "10"`` is an error, not 10) because silently
coercing client input hides client bugs. Unknown fields are ignored, as OpenAI
does. The body must be UTF-8 JSON as RFC 8259 defines it: no ``NaN`` or
``Infinity``, no unpaired surrogate escapes, and at most
:data:`MAX_JSON_DEPTH` levels of nesting. Numbers that the wire formats
further down cannot carry (``seed`` beyond int64, ``top_k`` beyond int32) are
refused here, before any quota is charged.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from tandem.common.errors import InvalidRequestError
from tandem.gateway.api.parameters import Endpoint, check_parameters
from tandem.gateway.api.tools import ToolCallList, ToolChoice, ToolList, ToolSpec, check_exclusive, tool_spec
from tandem.gateway.sampling import SamplingParams, StructuredOutput

#: Deepest nesting of arrays and objects accepted; OpenAI requests need a handful of levels.
MAX_JSON_DEPTH = 64
#: Most messages in one chat request (OpenAI's limit).
MAX_NUM_MESSAGES = 2048
#: Most stop sequences in one request (OpenAI allows 4); every one is matched at every generated token.
MAX_NUM_STOP = 16
#: Most entries in logit_bias and stop_token_ids.
MAX_NUM_BIASED_TOKENS = 1024
#: Most alternatives per token in chat's top_logprobs (OpenAI's limit) and completions' logprobs.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_CURLY_TO_SQUARE = bytes.maketrans(b"{}", b"[]")  # depth is all that counts
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")

StrictNumber = Annotated[float, Field(strict=True)]
TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**32)]
# fail_fast: a list stops at its first bad item. Otherwise pydantic reports every bad item, and a few MiB
# of them hold the event loop for seconds (and every member of a union is tried).
StrictStrList = Annotated[list[StrictStr], Field(fail_fast=True)]
TokenIdList = Annotated[list[TokenId], Field(fail_fast=True)]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Lenient(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do: SDKs add new ones all the time.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class TextPart(_Lenient):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Lenient):
    role: Role
    content: StrictStr | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: StrictStr | None = None
    #: An assistant turn's calls (its content may then be null); a ``tool`` turn names the call it answers.
    tool_calls: ToolCallList | None = None
    tool_call_id: StrictStr | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry a tool_call_id")
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Lenient):
    name: StrictStr = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    json_object: Literal[True] | None = None
    regex: StrictStr | None = Field(None, min_length=1)
    choice: Annotated[list[StrictStr], Field(min_length=1, max_length=1024, fail_fast=True)] | None = None
    grammar: StrictStr | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError("set exactly one of json, json_object, regex, choice, grammar")
        if isinstance(self.json_, str):
            try:
                schema = json.loads(self.json_)
            except ValueError as exc:
                raise ValueError(f"json is not a JSON schema: {exc}") from exc
            if not isinstance(schema, dict):
                raise ValueError("json must be a JSON schema object")
        return self

    def to_structured_output(self) -> StructuredOutput:
        if self.json_ is not None:
            schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            return StructuredOutput("json_schema", schema)
        if self.json_object:
            return StructuredOutput("json_object", True)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", tuple(self.choice))
        return StructuredOutput("grammar", self.grammar)


class _SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: StrictStr = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)  # fitted into the context before it goes on the wire
    temperature: StrictNumber | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictNumber | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1, lt=2**31)  # int32 on the wire
    presence_penalty: StrictNumber | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictNumber | None = Field(None, ge=-2.0, le=2.0)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63)  # int64 on the wire
    stop: StrictStr | Annotated[StrictStrList, Field(max_length=MAX_NUM_STOP)] | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[StrictStr, StrictNumber] | None = Field(None, max_length=MAX_NUM_BIASED_TOKENS)
    response_format: ResponseFormat | None = None
    # vLLM's extensions (see tandem.gateway.api.parameters).
    min_p: StrictNumber | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: StrictNumber | None = Field(None, gt=0.0, le=2.0)
    min_tokens: StrictInt = Field(0, ge=0, lt=2**32)  # uint32 on the wire; at most max_tokens (prepare)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_NUM_BIASED_TOKENS, fail_fast=True)] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    structured_outputs: StructuredOutputs | None = None
    #: vLLM extension used by benchmarks (``vllm bench serve --ignore-eos``).
    ignore_eos: StrictBool = False

    ENDPOINT: ClassVar[Endpoint]

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit() and int(token) < 2**32):
                raise ValueError(f"keys must be token ids, not {token[:40]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {token} must be in [-100, 100], not {bias}")
        return value

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def num_top_logprobs(self) -> int | None:
        """None: no log-probabilities; n: the n most likely alternatives too."""
        raise NotImplementedError

    def structured_output(self) -> StructuredOutput | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.to_structured_output()
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutput("json_object", True)
        assert fmt.json_schema is not None
        return StructuredOutput("json_schema", fmt.json_schema.schema_)

    def sampling_params(self) -> SamplingParams:
        """What both workers sample with."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=tuple(self.stop_strings()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (self.logit_bias or {}).items())),
            logprobs=self.num_top_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_output=self.structured_output(),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    ENDPOINT: ClassVar[Endpoint] = "chat"

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_NUM_MESSAGES, fail_fast=True)
    #: Newer OpenAI name for ``max_tokens``; either may be sent.
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: Tandem extension: the server keeps this conversation's turns; send only the new message.
    conversation_id: StrictStr | None = Field(None, min_length=1, max_length=128)
    #: Function tools (tandem.gateway.api.tools).
    tools: ToolList | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_spec(self) -> ToolSpec | None:
        """The request's tools, checked (InvalidRequestError otherwise); None when it has none."""
        return tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_output(self) -> StructuredOutput | None:
        spec = self.tool_spec()
        if spec is not None and spec.constrains:
            return spec.constraint()
        return super().structured_output()

    def has_tool_history(self) -> bool:
        return any(m.role == "tool" or m.tool_calls for m in self.messages)


class CompletionRequest(_SamplingFields):
    ENDPOINT: ClassVar[Endpoint] = "completions"

    prompt: StrictStr | StrictStrList | TokenIdList = Field(min_length=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_top_logprobs(self) -> int | None:
        return self.logprobs


RequestT = TypeVar("RequestT", bound=_SamplingFields)


def check_content_type(content_type: str | None) -> None:
    """A body that names its media type must name JSON; one that names none is read as JSON."""
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        raise InvalidRequestError(
            f"Content-Type must be application/json, not {content_type[:100]!r}.", code="unsupported_content_type"
        )


def parse_body(body: bytes, model_cls: type[RequestT]) -> RequestT:
    """Parse and validate a JSON body; every failure is an InvalidRequestError."""
    return validate_body(parse_json_object(body), model_cls)


def validate_body(data: dict[str, Any], model_cls: type[RequestT]) -> RequestT:
    """Validate a parsed body (a client's, or one translated from another API); every failure is an
    InvalidRequestError."""
    check_parameters(data, model_cls.ENDPOINT)
    try:
        request = model_cls.model_validate(data)
    except ValidationError as exc:
        raise to_invalid_request(exc) from exc
    _check_supported(request)
    return request


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an InvalidRequestError (``invalid_json`` or ``invalid_body``)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid_json(f"Request body is not valid UTF-8 (byte {exc.start}: {exc.reason}).") from exc
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:  # the C decoder's own limit, ~1000 levels: cheap to hit, not worth more
        raise _too_deep() from exc
    except ValueError as exc:
        raise _invalid_json(f"Request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError("Request body must be a JSON object.", code="invalid_body")
    # Cheap guards first: a body with few brackets cannot be deep, one without surrogate escapes cannot
    # hold an unpaired one (strict UTF-8 decoding already refused encoded surrogates).
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _nesting_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(data):
        raise _invalid_json("Request body is not valid JSON: a string holds an unpaired UTF-16 surrogate escape.")
    return data


def _invalid_json(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_json")


def _too_deep() -> InvalidRequestError:
    return _invalid_json(f"Request body is nested deeper than {MAX_JSON_DEPTH} levels.")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (RFC 8259)")


def _nesting_exceeds(body: bytes, max_depth: int) -> bool:
    """Whether the arrays and objects of the valid JSON ``body`` nest deeper than ``max_depth``.

    On the bytes rather than the parsed value, so that the work is a few C-speed passes (strings out, then
    everything but brackets, then one pass per level removing the innermost pairs), not a Python step per
    node. UTF-8 never puts a quote or backslash byte inside a multi-byte character, so this is exact."""
    brackets = _STRING.sub(b"", body).translate(_CURLY_TO_SQUARE, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def _has_lone_surrogate(data: dict[str, Any]) -> bool:
    # json joins an escaped pair into one code point, so a surrogate left in a string stands alone, and
    # UTF-8 cannot encode it. Re-encoding is C all the way; walking the value would be a Python step per node.
    try:
        json.dumps(data, ensure_ascii=False, check_circular=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def to_invalid_request(exc: ValidationError) -> InvalidRequestError:
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
    if request.response_format is not None and request.structured_outputs is not None:
        raise InvalidRequestError(
            "Send either response_format or structured_outputs, not both.",
            param="structured_outputs",
            code="invalid_value",
        )
    if isinstance(request, ChatCompletionRequest):
        spec = request.tool_spec()
        fmt = request.response_format
        has_format = request.structured_outputs is not None or (fmt is not None and fmt.type != "text")
        check_exclusive(spec, has_response_format=has_format)
        if request.conversation_id is not None and (spec is not None or request.has_tool_history()):
            raise InvalidRequestError(
                "conversation_id cannot be combined with tools or tool messages: send the whole history instead.",
                param="conversation_id",
                code="unsupported_value",
            )
    if isinstance(request, CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str):
            raise InvalidRequestError(
                "Only one prompt per request is supported.", param="prompt", code="unsupported_value"
            )
