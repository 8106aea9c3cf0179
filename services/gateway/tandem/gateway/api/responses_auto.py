"""``/v1/responses`` answers to requests whose tools leave the choice to the model (``tool_choice: "auto"``):
the :class:`~tandem.gateway.api.wire.WireFormat` the route handler picks for them instead of
:class:`~tandem.gateway.api.responses_wire.ResponsesWire`.

Called by the response writers through the ``WireFormat`` seam; reads the answer with
:class:`~tandem.gateway.api.hermes_tools.HermesReader` and writes the items and events of
:mod:`~tandem.gateway.api.responses_wire`. Pure: no I/O.

The output items follow the answer's text in order: each run of text is a ``message`` item (the first
``msg_<id>``, later ones ``msg_<id>_<k>``), each call a ``function_call`` item (``fc_<id>_<n>``,
``call_<id>_<n>`` for the n-th call, as in ``responses_wire``). An answer with neither is one empty
message. The stream announces each item as the reader hands it over (a call whole, once its block is
closed: ``output_item.added``, one ``function_call_arguments.delta``, ``.done``, ``output_item.done``),
and the whole answer is built by the same steps from the same events, so both always agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.gateway.api.errors import ApiError
from tandem.gateway.api.hermes_tools import Event, HermesReader, Text, read_whole
from tandem.gateway.api.responses_wire import (
    _ResponseStream,
    function_call_item,
    message_item,
    output_text,
    response,
    status_of,
)
from tandem.gateway.api.tools import ToolSpec
from tandem.gateway.job import Finished
from tandem.gateway.sse import ResponseMeta
from tandem.v1 import common_pb2

#: One stream event: its type and payload (without ``type`` and ``sequence_number``).
StreamEvent = tuple[str, dict[str, Any]]


class _Output:
    """The output items of an ``auto`` answer, built from its reader's events in order."""

    def __init__(self, meta: ResponseMeta) -> None:
        self._meta = meta
        self.items: list[dict[str, Any]] = []
        #: The open message item's text; None: no message item is open.
        self._text: str | None = None
        self._num_messages = 0

    def add(self, event: Event) -> list[StreamEvent]:
        if isinstance(event, Text):
            out = self._open_message() if self._text is None else []
            assert self._text is not None
            self._text += event.text
            where = self._where()
            return [*out, ("response.output_text.delta", {**where, "delta": event.text, "logprobs": []})]
        out = self._close_message("completed")
        item = function_call_item(self._meta, event.call, event.index, "completed")
        index = len(self.items)
        self.items.append(item)
        item_id = {"item_id": item["id"], "output_index": index}
        arguments = item["arguments"]
        return [
            *out,
            ("response.output_item.added", {"output_index": index, "item": {**item, "status": "in_progress"}}),
            ("response.function_call_arguments.delta", {**item_id, "delta": arguments}),
            ("response.function_call_arguments.done", {**item_id, "arguments": arguments, "name": item["name"]}),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def close(self, status: str) -> list[StreamEvent]:
        """The answer ended: the open message is done (an answer with no item gets an empty one)."""
        out = self._open_message() if not self.items else []
        return out + self._close_message(status)

    def _where(self) -> dict[str, Any]:
        index = len(self.items) - 1
        return {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}

    def _open_message(self) -> list[StreamEvent]:
        item = message_item(self._meta, None, "in_progress")
        if self._num_messages:
            item["id"] += f"_{self._num_messages}"
        self._num_messages += 1
        self.items.append(item)
        self._text = ""
        index = len(self.items) - 1
        return [
            ("response.output_item.added", {"output_index": index, "item": dict(item)}),
            ("response.content_part.added", {**self._where(), "part": output_text("")}),
        ]

    def _close_message(self, status: str) -> list[StreamEvent]:
        if self._text is None:
            return []
        text, self._text = self._text, None
        where = self._where()
        item = self.items[where["output_index"]]
        item.update(status=status, content=[output_text(text)])
        return [
            ("response.output_text.done", {**where, "text": text, "logprobs": []}),
            ("response.content_part.done", {**where, "part": output_text(text)}),
            ("response.output_item.done", {"output_index": where["output_index"], "item": item}),
        ]


class _AutoResponseStream(_ResponseStream):
    def __init__(self, meta: ResponseMeta, echo: dict[str, Any], spec: ToolSpec) -> None:
        super().__init__(meta, echo, None)
        self._hermes = HermesReader(spec)
        self._output = _Output(meta)

    def start(self) -> bytes:
        shell = response(self._meta, self._echo, [], None)
        return self._event("response.created", {"response": shell}) + self._event(
            "response.in_progress", {"response": shell}
        )

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        return self._events(self._hermes.feed(text)) if text else b""

    def finish(self, finished: Finished) -> bytes:
        status = status_of(finished)
        out = self._events(self._hermes.close())
        out += b"".join(self._event(name, payload) for name, payload in self._output.close(status))
        whole = response(self._meta, self._echo, self._output.items, finished)
        return out + self._event(f"response.{status}", {"response": whole})

    def _events(self, events: list[Event]) -> bytes:
        return b"".join(self._event(name, payload) for event in events for name, payload in self._output.add(event))


class AutoResponsesWire:
    """Answers and errors of ``/v1/responses`` for one request with ``tool_choice: "auto"``."""

    def __init__(self, echo: dict[str, Any], spec: ToolSpec) -> None:
        assert spec.mode == "auto", "only an auto answer is read in the model's own syntax"
        self._echo = echo
        self._spec = spec

    def stream_encoder(self, meta: ResponseMeta, num_prompt_tokens: int) -> _AutoResponseStream:
        return _AutoResponseStream(meta, self._echo, self._spec)

    def full_response(
        self, meta: ResponseMeta, text: str, finished: Finished, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        status = status_of(finished)
        output = _Output(meta)
        events, _, _ = read_whole(self._spec, text)
        for event in events:
            output.add(event)
        output.close(status)
        return response(meta, self._echo, output.items, finished)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()
