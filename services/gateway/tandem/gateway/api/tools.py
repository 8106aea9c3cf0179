"""Function tools: what a request's ``tools`` and ``tool_choice`` ask for, checked,
and the grammar that makes any model answer with a tool call.

Called by :mod:`tandem.gateway.api.validation` (the request models embed
:class:`ChatTool`, :class:`NamedToolChoice` and :class:`AssistantToolCall`, and
:meth:`ChatCompletionRequest.tool_spec` calls :func:`tool_spec`); the answer is
read back into tool calls by :mod:`tandem.gateway.api.tool_calls`. Calls pydantic
only. Written for every endpoint that carries function tools (chat completions
today; the Responses and Messages endpoints map their own shapes onto
:func:`tool_spec` and :class:`ToolSpec`).

Tools are honoured the way vLLM's OpenAI server honours them for a model without
a tool-call parser (``vllm/tool_parsers/utils.py``, ``get_json_schema_from_tools``),
through structured outputs, so they work across prefill and decode exactly as
``response_format`` does:

* a named choice (``{"type": "function", "function": {"name": N}}``): the answer is
  N's ``parameters`` JSON schema (an empty object schema when it has none), and the
  whole answer is that call's ``arguments``;
* ``"required"``: the answer is a JSON array of ``{"name", "parameters"}`` objects,
  ``minItems`` 1, each item ``anyOf`` the tools (``maxItems`` 1 when
  ``parallel_tool_calls`` is false); each item is one call;
* ``"none"``: the tools constrain nothing (the chat template still gets them);
* ``"auto"`` (OpenAI's default when tools are given) constrains nothing either: the
  model decides for itself whether to call, in its own syntax. It needs a chat
  template that presents the tools and a parser for that syntax: a served model
  configured with a tool chat template (``ServedModel.tool_chat_template``; Tandem
  ships a Hermes-style one for the default model, and the Qwen2.5 and Llama 3.1
  families' own) is rendered with it and its answer read by
  :mod:`tandem.gateway.api.hermes_tools` in the model's format
  (:data:`ToolCallFormat`); for any other model
  :mod:`tandem.gateway.api.prepare` refuses ``auto`` with 400 (:data:`AUTO_REFUSED`),
  naming the choices that work.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from tandem.common.errors import InvalidRequestError
from tandem.gateway.sampling import StructuredOutput

#: Most tools in one request (OpenAI's limit).
MAX_NUM_TOOLS = 128
#: Most tool calls in one assistant message of the history.
MAX_NUM_TOOL_CALLS = 128
#: OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

ToolMode = Literal["none", "auto", "required", "named"]
#: How a model writes a tool call in its own words (``tool_choice: "auto"``, :mod:`tandem.gateway.api.hermes_tools`):
#: ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the text (SmolLM2 with
#: Tandem's template, Qwen2.5); ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}``
#: objects separated by ``;``, after an optional ``<|python_tag|>`` (Llama 3.1 with vLLM's JSON template).
ToolCallFormat = Literal["hermes", "llama3_json"]

#: Chat's refusal of ``"auto"`` for a model without a tool chat template (each API words its own).
AUTO_REFUSED = (
    'tool_choice: "auto" (the default when tools are given) needs a model with a tool-call format, and this '
    'model has none; send tool_choice "required" (the model calls one or more of the tools) or name a function: '
    '{"type": "function", "function": {"name": "..."}}.'
)


class _Lenient(BaseModel):
    # As the request models: unknown fields are ignored, values are never coerced.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class FunctionDefinition(_Lenient):
    name: StrictStr
    description: StrictStr | None = None
    #: A JSON schema of an object; None or absent: the function takes no arguments.
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(_Lenient):
    """One entry of ``tools``."""

    type: StrictStr
    function: FunctionDefinition | None = None


class NamedFunction(_Lenient):
    name: StrictStr


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Lenient):
    name: StrictStr
    #: The arguments as the model wrote them: a JSON text, kept as text.
    arguments: StrictStr


class AssistantToolCall(_Lenient):
    """One entry of an assistant message's ``tool_calls`` in the history the client sends back."""

    id: StrictStr = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: CalledFunction


ToolList = Annotated[list[ChatTool], Field(max_length=MAX_NUM_TOOLS, fail_fast=True)]
ToolCallList = Annotated[list[AssistantToolCall], Field(max_length=MAX_NUM_TOOL_CALLS, fail_fast=True)]


@dataclass(frozen=True)
class FunctionTool:
    """A checked function tool."""

    name: str
    description: str | None
    #: Its parameters' JSON schema; None: it takes no arguments.
    parameters: dict[str, Any] | None

    def as_openai(self) -> dict[str, Any]:
        """The tool in OpenAI's ``tools`` shape, as chat templates read it (vLLM passes the same)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSpec:
    """What a request asks of its tools, checked."""

    tools: tuple[FunctionTool, ...]
    mode: ToolMode
    #: The function a named choice forces (mode "named" only).
    name: str | None = None
    #: False: at most one call (``"required"`` only; a named choice is one call by construction).
    parallel_tool_calls: bool = True
    #: The served model's tool-call format (``"auto"`` only; set once the model is known).
    call_format: ToolCallFormat = "hermes"

    @property
    def constrains(self) -> bool:
        """Whether the answer must be a tool call (its grammar is :meth:`constraint`)."""
        return self.mode in ("required", "named")

    @property
    def reads_calls(self) -> bool:
        """Whether the answer is read for tool calls (``"auto"``: by the model's own syntax, which may be absent)."""
        return self.mode != "none"

    def constraint(self) -> StructuredOutput | None:
        """The structured output that makes the answer a tool call; None for ``"none"`` and ``"auto"``."""
        if self.mode == "named":
            (tool,) = (t for t in self.tools if t.name == self.name)
            return StructuredOutput("json_schema", _parameters_or_empty_object(tool.parameters))
        if self.mode == "required":
            return StructuredOutput("json_schema", required_schema(self.tools, self.parallel_tool_calls))
        return None

    def template_tools(self) -> list[dict[str, Any]]:
        """``tools=`` for the chat template; a template that does not present tools ignores it, as in vLLM."""
        return [tool.as_openai() for tool in self.tools]


def required_schema(tools: tuple[FunctionTool, ...], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: an array of one or more ``{"name", "parameters"}``
    objects, each one of the tools (``_get_json_schema_from_tools``, ``$defs`` hoisted to the top)."""
    items = []
    defs: dict[str, Any] = {}
    for tool in tools:
        parameters = dict(_parameters_or_empty_object(tool.parameters))
        for def_name, def_schema in parameters.pop("$defs", {}).items():
            defs[def_name] = def_schema  # tool_spec refused two tools that define one name differently
        items.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters_or_empty_object(parameters: dict[str, Any] | None) -> dict[str, Any]:
    # As vLLM: missing or empty parameters still make the arguments a JSON object.
    return parameters if parameters else {"type": "object", "properties": {}}


def tool_spec(
    tools: list[ChatTool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None
) -> ToolSpec | None:
    """The request's tools, checked; None when it has none. Every refusal is a 400 that names the parameter."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise _invalid("tool_choice is only allowed when tools are given.", "tool_choice")
        return None
    checked: list[FunctionTool] = []
    defs: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        param = f"tools.{index}"
        if tool.type == "function" and tool.function is None:
            raise InvalidRequestError(
                f"{param}.function: a function tool needs its function (name, parameters).",
                param=f"{param}.function",
                code="missing_required_parameter",
            )
        if tool.type != "function" or tool.function is None:
            raise InvalidRequestError(
                f"{param}.type: only function tools are supported, not {tool.type[:40]!r}.",
                param=f"{param}.type",
                code="unsupported_value",
            )
        function = tool.function
        if not _FUNCTION_NAME.fullmatch(function.name):
            raise _invalid(
                f"{param}.function.name: a function name is 1 to 64 letters, digits, '_' or '-'.",
                f"{param}.function.name",
            )
        if any(t.name == function.name for t in checked):
            raise _invalid(f"{param}.function.name: two tools are named {function.name!r}.", f"{param}.function.name")
        _check_parameters_schema(function.parameters, f"{param}.function.parameters", defs)
        checked.append(FunctionTool(function.name, function.description, function.parameters))
    choice = "auto" if tool_choice is None else tool_choice
    parallel = parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not any(t.name == name for t in checked):
            raise _invalid(f"tool_choice: no tool is named {name[:64]!r}.", "tool_choice.function.name")
        return ToolSpec(tuple(checked), "named", name, parallel)
    return ToolSpec(tuple(checked), choice, None, parallel)


def _check_parameters_schema(parameters: dict[str, Any] | None, param: str, defs: dict[str, Any]) -> None:
    """A function's parameters must be a JSON schema of an object (what OpenAI accepts); a malformed one
    fails here, not in the grammar compiler on a worker."""
    if parameters is None:
        return
    kind = parameters.get("type", "object")
    if kind != "object":
        raise _invalid(f"{param}: must be a JSON schema of type 'object', not {str(kind)[:40]!r}.", param)
    for key in ("properties", "$defs"):
        if not isinstance(parameters.get(key, {}), dict):
            raise _invalid(f"{param}.{key}: must be an object.", f"{param}.{key}")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _invalid(f"{param}.required: must be a list of property names.", f"{param}.required")
    for def_name, def_schema in parameters.get("$defs", {}).items():
        if defs.setdefault(def_name, def_schema) != def_schema:
            raise _invalid(f"{param}.$defs: two tools define {def_name[:64]!r} differently.", f"{param}.$defs")


def check_exclusive(spec: ToolSpec | None, *, has_response_format: bool) -> None:
    """A tool call is itself a structured output: it cannot be combined with another one."""
    if spec is not None and spec.constrains and has_response_format:
        raise _invalid(
            "tools with tool_choice 'required' or a named function cannot be combined with response_format or "
            "structured_outputs: the answer is the tool call's JSON.",
            "tools",
        )


def arguments_text_size(tool_calls: list[AssistantToolCall] | None) -> int:
    """Bytes of client text in a history message's tool calls (the prompt's size check counts them)."""
    return sum(len(c.function.name.encode()) + len(c.function.arguments.encode()) for c in tool_calls or ())


def tools_text_size(spec: ToolSpec | None) -> int:
    """Bytes of the tools as a chat template may render them."""
    if spec is None:
        return 0
    return len(json.dumps(spec.template_tools(), ensure_ascii=False).encode())


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_value")
