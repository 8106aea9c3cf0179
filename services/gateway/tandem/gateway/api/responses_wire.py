"""The OpenAI Responses API, answer side: the :class:`~tandem.gateway.api.wire.WireFormat` that writes a
generation as a ``response`` object, or as the Responses API's typed stream events.

Built per request by the ``/v1/responses`` route (:func:`responses_wire`: the response echoes the
request's parameters, and a tool-call answer is read with the request's tools); the request side is
:mod:`~tandem.gateway.api.responses_request`. Tool calls are read with chat's own
:class:`~tandem.gateway.api.tool_calls.ToolCallReader`, so every API sees the same calls in the same
text. Pure: no I/O.

* A response: ``{id: "resp_…", object: "response", created_at, status, incomplete_details, model,
  output, usage, …}`` with the request's ``tools``, ``tool_choice``, ``temperature``, ``top_p``,
  ``max_output_tokens``, ``parallel_tool_calls``, ``text``, ``store`` and ``previous_response_id``
  echoed. ``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason:
  "max_output_tokens"`` for an answer cut at its length.
  ``output`` is one ``message`` item (``msg_…``) holding one ``output_text`` part, or, when the request's
  tools constrain the answer, one ``function_call`` item (``fc_…``) per call with ``call_id``, ``name``
  and ``arguments`` (an answer that holds no complete call is a message of its text).
* ``usage``: ``input_tokens`` (the whole prompt) with ``input_tokens_details.cached_tokens`` (those read
  from the prefix cache; ``cache_write_tokens`` 0: caching is automatic and free), ``output_tokens``
  with ``output_tokens_details.reasoning_tokens`` 0, and ``total_tokens``.
* A stream: every event has an ``event:`` line and a ``sequence_number`` counting from 0:
  ``response.created`` and ``response.in_progress`` (the response without output), then for a message
  ``response.output_item.added``, ``response.content_part.added``, one ``response.output_text.delta``
  per text, ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
  for each function call ``response.output_item.added``, ``response.function_call_arguments.delta`` per
  fragment, ``response.function_call_arguments.done``, ``response.output_item.done``; and last
  ``response.completed`` or ``response.incomplete`` with the whole response and its usage. An error
  after the stream began is ``response.failed`` (``error.code`` ``server_error``, the gateway's message).
  Stage timings are not sent in a stream. Errors before it began are OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tandem.gateway.api.errors import ApiError
from tandem.gateway.api.response_chains import ChainRequest
from tandem.gateway.api.tool_calls import ToolCall, ToolCallReader, tool_calls_of
from tandem.gateway.api.tools import ToolSpec
from tandem.gateway.api.validation import ChatCompletionRequest
from tandem.gateway.conversations import ANSWER_BYTES_PER_TOKEN
from tandem.gateway.job import Finished, Usage
from tandem.gateway.sse import ResponseMeta, encode_event
from tandem.v1 import common_pb2


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def echo_of(body: ChatCompletionRequest, chain: ChainRequest | None) -> dict[str, Any]:
    """The request parameters a response repeats, in this API's shapes (from the chat request they became)."""
    tools = []
    for tool in body.tools or ():
        function = tool.function
        assert function is not None, "validation refused a function tool without its function"
        tools.append(
            {
                "type": "function",
                "name": function.name,
                "description": function.description,
                "parameters": function.parameters,
                "strict": function.strict,
            }
        )
    choice = body.tool_choice
    tool_choice: Any = choice if isinstance(choice, str) or choice is None else {"type": "function"}
    if not isinstance(choice, str) and choice is not None:
        tool_choice["name"] = choice.function.name
    fmt: dict[str, Any] = {"type": "text"}
    if body.response_format is not None and body.response_format.type == "json_object":
        fmt = {"type": "json_object"}
    elif body.response_format is not None and body.response_format.json_schema is not None:
        schema = body.response_format.json_schema
        fmt = {"type": "json_schema", "name": schema.name, "schema": schema.schema_, "strict": schema.strict}
    return {
        "instructions": chain.instructions if chain is not None else None,
        "max_output_tokens": body.max_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "tools": tools,
        "text": {"format": fmt},
        "store": chain is not None and chain.store,
        "previous_response_id": chain.previous_id if chain is not None else None,
        "background": chain is not None and chain.background,
    }


#: A stored response object's bytes besides its echoed parameters and its text: ids, status, the output
#: item around the text, usage (~600 for a message answer, a few function calls stay under this).
RESPONSE_OBJECT_BYTES = 1024


def stored_response_bytes(body: ChatCompletionRequest, chain: ChainRequest, max_tokens: int) -> int:
    """About what a stored response's object adds to its answer turn in the tenant's storage account,
    beside the answer's text in the turn itself: the parameters it repeats (``instructions``, tools, a
    schema) as sent, the text once more at :data:`ANSWER_BYTES_PER_TOKEN` per token of ``max_tokens``, and
    :data:`RESPONSE_OBJECT_BYTES`. The preparation adds it to the chain's bytes, so that a chain near the
    tenant's limit is refused before any token rather than stored without its oldest turns."""
    echo = json.dumps(echo_of(body, chain), ensure_ascii=False).encode()
    return RESPONSE_OBJECT_BYTES + len(echo) + ANSWER_BYTES_PER_TOKEN * max_tokens


def _suffix(meta: ResponseMeta) -> str:
    return meta.id.removeprefix("resp_")


def message_item(meta: ResponseMeta, text: str | None, status: str) -> dict[str, Any]:
    """The answer's message item; ``text`` None: without its part yet."""
    content = [] if text is None else [output_text(text)]
    return {"id": f"msg_{_suffix(meta)}", "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(meta: ResponseMeta, call: ToolCall, index: int, status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{_suffix(meta)}_{index}",
        "type": "function_call",
        "status": status,
        # Of the response, not the reader's (random): the answer, its stream and its stored copy agree.
        "call_id": f"call_{_suffix(meta)}_{index}",
        "name": call.name,
        "arguments": call.arguments,
    }


def status_of(finished: Finished | None) -> str:
    if finished is None:
        return "in_progress"
    return "incomplete" if finished.finish_reason == "length" else "completed"


def response(
    meta: ResponseMeta, echo: dict[str, Any], output: list[dict[str, Any]], finished: Finished | None
) -> dict[str, Any]:
    """The response object; ``finished`` None: still in progress (no usage yet)."""
    status = status_of(finished)
    return {
        "id": meta.id,
        "object": "response",
        "created_at": meta.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": meta.model,
        "output": output,
        "reasoning": None,
        "truncation": "disabled",
        "metadata": {},
        "usage": usage_dict(finished.usage) if finished is not None else None,
        **echo,
    }


def _output(meta: ResponseMeta, text: str, calls: Sequence[ToolCall], status: str) -> list[dict[str, Any]]:
    if calls:
        return [function_call_item(meta, call, i, status) for i, call in enumerate(calls)]
    return [message_item(meta, text, status)]


class _ResponseStream:
    """The typed events of one streamed response (the order is the module docstring's)."""

    def __init__(self, meta: ResponseMeta, echo: dict[str, Any], spec: ToolSpec | None) -> None:
        self._meta = meta
        self._echo = echo
        self._reader = ToolCallReader(spec) if spec is not None else None
        self._num_events = 0
        self._text = ""
        #: The output items begun so far (a message, or the calls read so far).
        self._num_items = 0

    def _event(self, name: str, payload: dict[str, Any]) -> bytes:
        payload = {"type": name, "sequence_number": self._num_events, **payload}
        self._num_events += 1
        return f"event: {name}\n".encode() + encode_event(payload)

    def start(self) -> bytes:
        shell = response(self._meta, self._echo, [], None)
        out = self._event("response.created", {"response": shell})
        out += self._event("response.in_progress", {"response": shell})
        if self._reader is None:
            out += self._open_message()
        return out

    def _open_message(self) -> bytes:
        self._num_items = 1
        item = message_item(self._meta, None, "in_progress")
        out = self._event("response.output_item.added", {"output_index": 0, "item": item})
        return out + self._event(
            "response.content_part.added",
            {"item_id": item["id"], "output_index": 0, "content_index": 0, "part": output_text("")},
        )

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        if not text:  # log-probabilities are not served by this API
            return b""
        if self._reader is None:
            self._text += text
            return self._text_delta(text)
        out = b""
        for delta in self._reader.feed(text):
            index = delta["index"]
            if "id" in delta:  # a call's first delta: its item begins (the one before it is done)
                out += self._close_call()
                call = ToolCall(delta["id"], delta["function"]["name"])
                item = function_call_item(self._meta, call, index, "in_progress")
                out += self._event("response.output_item.added", {"output_index": index, "item": item})
                self._num_items = index + 1
            fragment = delta["function"].get("arguments", "")
            if fragment:
                item_id = f"fc_{_suffix(self._meta)}_{index}"
                out += self._event(
                    "response.function_call_arguments.delta",
                    {"item_id": item_id, "output_index": index, "delta": fragment},
                )
        return out

    def _text_delta(self, text: str) -> bytes:
        item_id = f"msg_{_suffix(self._meta)}"
        return self._event(
            "response.output_text.delta",
            {"item_id": item_id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []},
        )

    def _close_call(self, status: str = "completed") -> bytes:
        """The last call begun is done (its arguments are whole: the reader has begun the next, or ended)."""
        assert self._reader is not None
        if self._num_items == 0:
            return b""
        index = self._num_items - 1
        item = function_call_item(self._meta, self._reader.calls[index], index, status)
        done = {"item_id": item["id"], "output_index": index, "arguments": item["arguments"], "name": item["name"]}
        out = self._event("response.function_call_arguments.done", done)
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def finish(self, finished: Finished) -> bytes:
        status = status_of(finished)
        out = b""
        calls: Sequence[ToolCall] = ()
        if self._reader is not None:
            calls = self._reader.calls
            if calls:
                out += self._close_call(status)
            else:  # no call could be read: the text is the answer
                self._text = self._reader.text
                out += self._open_message() + (self._text_delta(self._text) if self._text else b"")
        if not calls:
            item = message_item(self._meta, self._text, status)
            where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
            out += self._event("response.output_text.done", {**where, "text": self._text, "logprobs": []})
            out += self._event("response.content_part.done", {**where, "part": output_text(self._text)})
            out += self._event("response.output_item.done", {"output_index": 0, "item": item})
        whole = response(self._meta, self._echo, _output(self._meta, self._text, calls, status), finished)
        return out + self._event(f"response.{status}", {"response": whole})

    def end(self, timings: dict[str, Any] | None) -> bytes:
        return b""

    def error(self, error: ApiError) -> bytes:
        failed = response(self._meta, self._echo, [], None)
        failed["status"] = "failed"
        failed["error"] = {"code": "server_error", "message": error.message}
        return self._event("response.failed", {"response": failed})


class ResponsesWire:
    """Answers and errors of ``/v1/responses`` for one request."""

    def __init__(self, echo: dict[str, Any], spec: ToolSpec | None) -> None:
        self._echo = echo
        #: The request's tools when they constrain the answer (it is then read as tool calls).
        self._spec = spec if spec is not None and spec.constrains else None

    def stream_encoder(self, meta: ResponseMeta, num_prompt_tokens: int) -> _ResponseStream:
        return _ResponseStream(meta, self._echo, self._spec)

    def full_response(
        self, meta: ResponseMeta, text: str, finished: Finished, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        calls = tool_calls_of(self._spec, text) if self._spec is not None else []
        return response(meta, self._echo, _output(meta, text, calls, status_of(finished)), finished)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()


def responses_wire(body: ChatCompletionRequest, spec: ToolSpec | None, chain: ChainRequest | None) -> ResponsesWire:
    """The wire format of one ``/v1/responses`` request, from the chat request it became."""
    return ResponsesWire(echo_of(body, chain), spec)
