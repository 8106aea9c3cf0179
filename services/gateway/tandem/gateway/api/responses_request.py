"""The OpenAI Responses API (``POST /v1/responses``), request side: the Responses body validated and
translated once into the gateway's chat request, which then runs the one generation pipeline of
:mod:`~tandem.gateway.api.routes` (drain, authentication, tenancy, prompt policy, quota, the same
response writers); the answer is written back by :mod:`~tandem.gateway.api.responses_wire`.

Called by the ``/v1/responses`` route (:data:`DIALECT` through :func:`~tandem.gateway.api.prepare.prepare`);
calls pydantic and :func:`~tandem.gateway.api.validation.validate_body`, so every check of a chat request
applies to the translation too. The translation is exact: a conversation sent here and the same
conversation sent to ``/v1/chat/completions`` make the same prompt tokens and sampling parameters.

* ``instructions`` becomes the first system message, under the tenant's prompt policy exactly as a chat
  system message is. ``input`` is a string (one user message) or items, in order: ``message`` items
  (role ``user`` / ``assistant`` / ``system`` / ``developer``; content a string or ``input_text`` /
  ``output_text`` parts, joined as chat joins text parts); ``function_call`` items are the ``tool_calls``
  of one assistant turn (consecutive ones together, joined to the assistant message just before them);
  ``function_call_output`` items are ``tool`` turns. Text is data: the chat template's control tokens
  inside it stay text (:mod:`tandem.gateway.prompt`).
* ``max_output_tokens``, ``temperature`` and ``top_p`` are chat's ``max_tokens``, ``temperature`` and
  ``top_p``; ``tools`` (``type: "function"``, flat: ``name``, ``description``, ``parameters``, ``strict``),
  ``tool_choice`` and ``parallel_tool_calls`` are chat's function tools (:mod:`tandem.gateway.api.tools`:
  ``"auto"`` for a model with a tool chat template, refused for others); ``text.format`` ``json_schema`` /
  ``json_object`` is chat's ``response_format``.
* ``store`` (default ``true``) keeps the response, and ``previous_response_id`` continues a stored one:
  the chain's turns come before the new input (:mod:`~tandem.gateway.api.response_chains`, read by
  :func:`parse_chain`); ``background: true`` (with ``store``, without ``stream``) answers at once and
  generates on (:mod:`~tandem.gateway.api.background_responses`). Refused with a 400 naming the
  parameter, rather than ignored: ``reasoning`` with an effort (the served models do not reason), built-in tools
  (``web_search``, ``file_search``, …), ``include`` values, ``conversation``, ``prompt`` templates,
  content parts other than text (images, files, audio) and items other than the three above.
  ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key`` and ``truncation: "disabled"``
  are accepted and not read; fields this gateway does not know are ignored, as for the OpenAI endpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from tandem.common.errors import InvalidRequestError
from tandem.gateway.api.prepare import Dialect
from tandem.gateway.api.response_chains import ChainRequest
from tandem.gateway.api.tools import MAX_NUM_TOOLS
from tandem.gateway.api.validation import (
    MAX_NUM_MESSAGES,
    ChatCompletionRequest,
    StrictNumber,
    parse_json_object,
    to_invalid_request,
    validate_body,
)
from tandem.gateway.conversations import RESPONSE_ID_PREFIX

#: Request fields that ask for something this gateway does not do, with the values that ask for nothing.
_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "conversation": ("Conversations are not supported by /v1/responses.", ()),
    "prompt": ("Prompt templates are not supported.", ()),
    "include": ("No include values are supported.", ([],)),
    "truncation": ('Only truncation "disabled" is supported.', ("disabled",)),
    "max_tool_calls": ("max_tool_calls is not supported.", ()),
    "top_logprobs": ("Log-probabilities are not supported by /v1/responses.", (0,)),
}
_TEXT_PARTS = ("input_text", "output_text")


class _Lenient(BaseModel):
    # Unknown fields are ignored, as for the OpenAI endpoints (annotations, status, id of items among them).
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class ContentPart(_Lenient):
    """A content part; ``input_text`` and ``output_text`` ones are served."""

    type: StrictStr
    text: StrictStr | None = None


class InputItem(_Lenient):
    """Any input item; ``message`` (also without ``type``), ``function_call`` and ``function_call_output``
    ones are served (:func:`_turns`)."""

    type: StrictStr = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: StrictStr | Annotated[list[ContentPart], Field(fail_fast=True)] | None = None
    #: function_call: the call's id (the one its output names), the function and its JSON arguments.
    call_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    name: StrictStr | None = None
    arguments: StrictStr | None = None
    #: function_call_output: what the function returned (text, or text parts).
    output: StrictStr | Annotated[list[ContentPart], Field(fail_fast=True)] | None = None


class ResponsesTool(_Lenient):
    """A tool; only ``function`` tools are served (the built-in ones are refused by :func:`_chat_tools`)."""

    type: StrictStr
    name: StrictStr | None = None
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(_Lenient):
    type: StrictStr
    name: StrictStr | None = None


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    #: Output verbosity: one level only for these models; accepted, not read.
    verbosity: StrictStr | None = None


class Reasoning(_Lenient):
    effort: StrictStr | None = None
    summary: StrictStr | None = None


class ResponsesRequest(_Lenient):
    model: StrictStr = Field(min_length=1)
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_NUM_MESSAGES, fail_fast=True)]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictNumber | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictNumber | None = Field(None, gt=0.0, le=1.0)
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_NUM_TOOLS, fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: StrictBool = False
    store: StrictBool = True
    #: Answer at once with the response queued; the generation runs on (tandem.gateway.api.background_responses).
    background: StrictBool = False
    previous_response_id: StrictStr | None = Field(None, min_length=1, max_length=128)
    #: Accepted, never read nor logged.
    metadata: dict[str, StrictStr] | None = None


def parse_responses(raw: bytes) -> ChatCompletionRequest:
    """The chat request a Responses body means; InvalidRequestError for anything else."""
    data = parse_json_object(raw)
    for name, (message, neutral) in _REFUSED.items():
        value = data.get(name)
        if value is not None and value not in neutral:
            raise InvalidRequestError(message, param=name, code="unsupported_parameter")
    try:
        request = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise to_invalid_request(exc) from exc
    if request.background and not request.store:
        raise InvalidRequestError(
            "background can only be used when `store` is true", param="background", code="invalid_value"
        )
    if request.reasoning is not None and request.reasoning.effort not in (None, "none"):
        raise InvalidRequestError(
            f"reasoning.effort: the model {request.model[:80]!r} does not reason; leave reasoning out.",
            param="reasoning.effort",
            code="unsupported_parameter",
        )
    chat = to_chat(request)
    try:
        return validate_body(chat, ChatCompletionRequest)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param=_param(exc.param), code=exc.code) from exc


def _param(param: str | None) -> str | None:
    """A chat parameter's name as this API's (the rest of the message stays chat's)."""
    if param is None:
        return None
    for chat, ours in (("max_tokens", "max_output_tokens"), ("response_format", "text.format"), ("messages", "input")):
        if param == chat or param.startswith(chat + "."):
            return ours + param[len(chat) :]
    return param


def to_chat(request: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body of the same conversation and sampling (checked by the caller)."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        for i, item in enumerate(request.input):
            _add_turn(messages, item, f"input.{i}")
    body: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream}
    for name, value in (
        ("max_tokens", request.max_output_tokens),
        ("temperature", request.temperature),
        ("top_p", request.top_p),
    ):
        if value is not None:
            body[name] = value
    body.update(_chat_tools(request))
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        json_schema: dict[str, Any] = {
            "name": _required(fmt.name, "text.format.name"),
            "schema": _required(fmt.schema_, "text.format.schema"),
        }
        if fmt.strict is not None:
            json_schema["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": json_schema}
    return body


def _add_turn(messages: list[dict[str, Any]], item: InputItem, where: str) -> None:
    """One input item onto the chat turns: a message; a function call joins the assistant turn before it
    (or opens one); a function call's output is a tool turn."""
    if item.type == "message":
        role = _required(item.role, f"{where}.role")
        content = _required(item.content, f"{where}.content")
        messages.append({"role": role, "content": _text(content, f"{where}.content")})
    elif item.type == "function_call":
        function = {
            "name": _required(item.name, f"{where}.name"),
            "arguments": _required(item.arguments, f"{where}.arguments"),
        }
        call = {"id": _required(item.call_id, f"{where}.call_id"), "type": "function", "function": function}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif item.type == "function_call_output":
        output = _required(item.output, f"{where}.output")
        messages.append(
            {
                "role": "tool",
                "tool_call_id": _required(item.call_id, f"{where}.call_id"),
                "content": _text(output, f"{where}.output"),
            }
        )
    else:
        raise InvalidRequestError(
            f"{where}: input items of type {item.type[:40]!r} are not supported.",
            param=f"{where}.type",
            code="unsupported_value",
        )


def _text(content: str | Sequence[ContentPart], param: str) -> str | list[dict[str, str]]:
    """A string as it is; text parts as chat's text parts, which chat joins as one text."""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise InvalidRequestError(
                f"{param}.{i}: content parts of type {part.type[:40]!r} are not supported; send input_text.",
                param=f"{param}.{i}.type",
                code="unsupported_value",
            )
        parts.append({"type": "text", "text": _required(part.text, f"{param}.{i}.text")})
    return parts


def _chat_tools(request: ResponsesRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request (checked by chat's rules)."""
    body: dict[str, Any] = {}
    if request.tools is not None:
        functions = []
        for i, tool in enumerate(request.tools):
            if tool.type != "function":
                raise InvalidRequestError(
                    f"tools.{i}.type: built-in tools ({tool.type[:40]!r}) are not supported; send function tools.",
                    param=f"tools.{i}.type",
                    code="unsupported_value",
                )
            function: dict[str, Any] = {"name": _required(tool.name, f"tools.{i}.name")}
            for name, value in (("description", tool.description), ("parameters", tool.parameters)):
                if value is not None:
                    function[name] = value
            if tool.strict is not None:
                function["strict"] = tool.strict
            functions.append({"type": "function", "function": function})
        body["tools"] = functions
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        if choice.type != "function":
            raise InvalidRequestError(
                f"tool_choice: choices of type {choice.type[:40]!r} are not supported; name a function tool.",
                param="tool_choice.type",
                code="unsupported_value",
            )
        body["tool_choice"] = {"type": "function", "function": {"name": _required(choice.name, "tool_choice.name")}}
    elif choice is not None:
        body["tool_choice"] = choice
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return body


def _required(value: Any, param: str) -> Any:
    if value is None:
        raise InvalidRequestError(f"{param}: Field required", param=param, code="missing_required_parameter")
    return value


def parse_chain(raw: bytes) -> ChainRequest:
    """The store fields of a body :func:`parse_responses` accepted, and the instructions its response repeats."""
    data = parse_json_object(raw)
    instructions = data.get("instructions")
    return ChainRequest(
        previous_id=data.get("previous_response_id"),
        store=data.get("store") is not False,
        instructions=instructions if isinstance(instructions, str) else None,
        background=data.get("background") is True,
    )


DIALECT = Dialect(
    parse=parse_responses,
    request_id_prefix=RESPONSE_ID_PREFIX,
    chain=parse_chain,
    auto_refused='tool_choice "auto" (the default when tools are given) needs a model with a tool-call format, and '
    'this model has none: send "required" or {"type": "function", "name": "..."}.',
)
