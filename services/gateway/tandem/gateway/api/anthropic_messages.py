"""The Anthropic Messages API (``POST /v1/messages``), request side: the Anthropic body validated and
translated once into the gateway's chat request, which then runs the one generation pipeline of
:mod:`~tandem.gateway.api.routes` (drain, authentication, tenancy, prompt policy, quota, the same
response writers); the answer is written back by :mod:`~tandem.gateway.api.anthropic_wire`.

Called by the ``/v1/messages`` route (:data:`DIALECT` through :func:`~tandem.gateway.api.prepare.prepare`);
calls pydantic and :func:`~tandem.gateway.api.validation.validate_body`, so every check of a chat request
applies to the translation too. The translation is exact: a conversation sent here and the same
conversation sent to ``/v1/chat/completions`` make the same prompt tokens and sampling parameters.

* ``system`` (a string or text blocks) becomes the first system message, subject to the tenant's prompt
  policy exactly as a chat system message is; ``messages`` (``user`` / ``assistant``, a string or
  ``text`` blocks, joined as chat joins text parts) follow in order. Text is data: the chat template's
  control tokens inside it stay text (:mod:`tandem.gateway.prompt`).
* ``max_tokens`` is required (as Anthropic requires it); ``temperature`` 0..1, ``top_p``, ``top_k`` and
  ``stop_sequences`` map onto their chat counterparts (the ``anthropic`` SDK sends the first three through
  ``extra_body`` since they left its signature); ``output_config.format`` (a JSON schema) is chat's
  ``response_format`` ``json_schema``; ``metadata`` and ``output_config.effort`` are accepted and not read.
* Tools are chat's function tools (:mod:`tandem.gateway.api.tools`, which checks them): ``tools``
  (``name``, ``description``, ``input_schema``) are functions with those ``parameters``;
  ``tool_choice`` ``any`` is chat's ``"required"``, ``tool`` a named function, ``none`` ``"none"``
  and ``auto`` (the default with tools) chat's ``"auto"`` (for a model with a tool chat template; refused
  in this API's terms for others); ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
  An assistant's ``tool_use`` blocks are its ``tool_calls`` (``input`` as the JSON arguments); a
  user's ``tool_result`` blocks are ``tool`` turns, in order, before the user turn of its text.
  The answer is read back by :mod:`~tandem.gateway.api.anthropic_tool_wire`.
* Refused with a 400 that says so, rather than silently ignored: content blocks other than ``text``,
  ``tool_use`` (assistant) and ``tool_result`` (user) (images, documents, thinking), a final
  ``assistant`` message (Anthropic's answer prefill: the chat template would close that turn instead
  of continuing it), ``thinking`` enabled, MCP servers, containers and server tools.
* The ``anthropic-version`` header is optional; when sent it must be a date from 2023-06-01 on
  (:func:`check_version`). Fields this gateway does not know are ignored, as for the OpenAI endpoints.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from tandem.common.errors import InvalidRequestError
from tandem.gateway.api.prepare import Dialect
from tandem.gateway.api.validation import (
    MAX_NUM_MESSAGES,
    MAX_NUM_STOP,
    ChatCompletionRequest,
    StrictNumber,
    parse_json_object,
    to_invalid_request,
    validate_body,
)

#: The oldest ``anthropic-version`` whose Messages API this endpoint speaks (the version the SDKs send).
OLDEST_VERSION = datetime.date(2023, 6, 1)

#: Anthropic request fields that ask for something this gateway does not do, with the value that asks
#: for nothing (None: any value is refused).
_REFUSED: dict[str, tuple[str, Any]] = {
    "thinking": ("Extended thinking is not supported.", {"type": "disabled"}),
    "mcp_servers": ("MCP servers are not supported.", []),
    "container": ("Containers are not supported.", None),
}
#: Anthropic's tool_choice types as chat's tool_choice ("tool" is a named function).
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class _Lenient(BaseModel):
    # Unknown fields are ignored, as for the OpenAI endpoints; cache_control, citations and the like among them.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class TextBlock(_Lenient):
    type: Literal["text"]
    text: StrictStr


class ContentBlock(_Lenient):
    """Any content block; ``text``, ``tool_use`` and ``tool_result`` ones are served (:func:`_turns`)."""

    type: StrictStr
    text: StrictStr | None = None
    #: tool_use: the call's id, the tool's name and the arguments it was called with.
    id: StrictStr | None = None
    name: StrictStr | None = None
    input: dict[str, Any] | None = None
    #: tool_result: the call it answers and what the tool returned (text, or text blocks).
    tool_use_id: StrictStr | None = None
    content: StrictStr | Annotated[list[TextBlock], Field(fail_fast=True)] | None = None
    is_error: StrictBool | None = None


class AnthropicTool(_Lenient):
    """A client tool; Anthropic's server tools (web search, bash, …: a ``type`` of their own) are refused."""

    type: StrictStr | None = None
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: StrictStr | Annotated[list[ContentBlock], Field(min_length=1, fail_fast=True)]


class JsonOutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    """Anthropic's ``output_config``: ``format`` is honoured (structured outputs); ``effort`` asks for
    nothing this model can give more or less of, and is not read."""

    format: JsonOutputFormat | None = None


class MessagesRequest(_Lenient):
    model: StrictStr = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_NUM_MESSAGES, fail_fast=True)
    system: StrictStr | Annotated[list[TextBlock], Field(fail_fast=True)] | None = None
    temperature: StrictNumber | None = Field(None, ge=0.0, le=1.0)
    top_p: StrictNumber | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=1, lt=2**31)
    stop_sequences: (
        Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=MAX_NUM_STOP, fail_fast=True)]
        | None
    ) = None
    stream: StrictBool = False
    output_config: OutputConfig | None = None
    tools: Annotated[list[AnthropicTool], Field(fail_fast=True)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    #: Anthropic's ``{"user_id": ...}``: accepted, never read nor logged.
    metadata: dict[str, Any] | None = None


def check_version(version: str | None) -> None:
    """The ``anthropic-version`` header: absent, or a date (YYYY-MM-DD) from :data:`OLDEST_VERSION` on."""
    if version is None:
        return
    try:
        day = datetime.date.fromisoformat(version.strip())
    except ValueError:
        day = None
    if day is None or day < OLDEST_VERSION:
        raise InvalidRequestError(
            f"anthropic-version must be a date from {OLDEST_VERSION.isoformat()} on, not {version[:40]!r}.",
            param="anthropic-version",
            code="invalid_value",
        )


def parse_messages(raw: bytes) -> ChatCompletionRequest:
    """The chat request an Anthropic Messages body means; InvalidRequestError for anything else."""
    data = parse_json_object(raw)
    for name, (message, neutral) in _REFUSED.items():
        value = data.get(name)
        if value is not None and (neutral is None or value != neutral):
            raise InvalidRequestError(message, param=name, code="unsupported_parameter")
    try:
        request = MessagesRequest.model_validate(data)
    except ValidationError as exc:
        raise to_invalid_request(exc) from exc
    return validate_body(to_chat(request), ChatCompletionRequest)


def to_chat(request: MessagesRequest) -> dict[str, Any]:
    """The chat completions body of the same conversation and sampling (checked by the caller)."""
    if request.messages[-1].role == "assistant":
        raise InvalidRequestError(
            "The last message must be the user's: continuing a final assistant message is not supported.",
            param=f"messages.{len(request.messages) - 1}.role",
            code="unsupported_value",
        )
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        messages.append({"role": "system", "content": _parts(request.system, "system")})
    for i, message in enumerate(request.messages):
        messages.extend(_turns(message, f"messages.{i}.content"))
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_tokens,
        "stream": request.stream,
    }
    for name, value in (("temperature", request.temperature), ("top_p", request.top_p), ("top_k", request.top_k)):
        if value is not None:
            body[name] = value
    if request.stop_sequences:
        body["stop"] = list(request.stop_sequences)
    body.update(_chat_tools(request))
    if request.output_config is not None and request.output_config.format is not None:
        schema = request.output_config.format.schema_
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    return body


def _turns(message: AnthropicMessage, param: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat turns: an assistant's ``tool_use`` blocks are its ``tool_calls``; a
    user's ``tool_result`` blocks are ``tool`` turns, in order, before the user turn of its text (if any)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(message.content):
        where = f"{param}.{i}"
        if block.type == "text":
            texts.append({"type": "text", "text": _required(block.text, f"{where}.text")})
        elif block.type == "tool_use" and message.role == "assistant":
            arguments = json.dumps(_required(block.input, f"{where}.input"), ensure_ascii=False)
            call = {"name": _required(block.name, f"{where}.name"), "arguments": arguments}
            calls.append({"id": _required(block.id, f"{where}.id"), "type": "function", "function": call})
        elif block.type == "tool_result" and message.role == "user":
            result = block.content if block.content is not None else ""
            content = result if isinstance(result, str) else _parts(result, f"{where}.content")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": _required(block.tool_use_id, f"{where}.tool_use_id"),
                    "content": content,
                }
            )
        else:
            raise InvalidRequestError(
                f"{where}: content blocks of type {block.type[:40]!r} are not supported in {message.role} messages.",
                param=where,
                code="unsupported_value",
            )
    turns = results
    if calls:
        turns.append({"role": "assistant", "content": texts or None, "tool_calls": calls})
    elif texts or not results:
        turns.append({"role": message.role, "content": texts})
    return turns


def _parts(content: str | Sequence[TextBlock], param: str) -> str | list[dict[str, str]]:
    """A string as it is; text blocks as chat's text parts, which chat joins as one text."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": block.text} for block in content]


def _chat_tools(request: MessagesRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request (checked by chat's rules)."""
    body: dict[str, Any] = {}
    if request.tools is not None:
        for i, tool in enumerate(request.tools):
            if tool.type not in (None, "custom"):
                raise InvalidRequestError(
                    f"tools.{i}.type: server tools ({tool.type[:40]!r}) are not supported; send client tools "
                    "(name, description, input_schema).",
                    param=f"tools.{i}.type",
                    code="unsupported_value",
                )
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            name = _required(choice.name, "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
        else:
            body["tool_choice"] = _TOOL_CHOICES[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body


def _required(value: Any, param: str) -> Any:
    if value is None:
        raise InvalidRequestError(f"{param}: Field required", param=param, code="missing_required_parameter")
    return value


DIALECT = Dialect(
    parse=parse_messages,
    request_id_prefix="msg_",
    # Chat's refusal names chat's choices; this one says it in this API's words.
    auto_refused='tool_choice {"type": "auto"} (the default when tools are given) needs a model with a tool-call '
    'format, and this model has none: send {"type": "any"} (the model calls one or more of the tools) or '
    '{"type": "tool", "name": "..."}.',
)
