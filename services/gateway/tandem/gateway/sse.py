"""OpenAI wire encoding of generation results: Server-Sent Event chunks for
``stream: true`` and whole objects otherwise.

Called by :mod:`tandem.gateway.api.routes`; calls nothing. The chunk shapes
follow OpenAI exactly (field order included) so that SDKs and UIs written
against OpenAI parse them unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tandem.gateway.orchestrator import Usage

DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Kind = Literal["chat", "text"]


#: Characters that JSON may carry raw but that many clients' line readers (Python's str.splitlines,
#: httpx's aiter_lines, JavaScript before ES2019) take for line ends: sent as JSON escapes instead.
_LINE_BREAKERS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def encode_event(payload: dict[str, Any]) -> bytes:
    """One SSE ``data:`` event, on one line whichever way a client splits lines."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKERS)
    return b"data: " + text.encode() + b"\n\n"


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str
    kind: Kind
    include_usage: bool = False


class ChunkEncoder:
    """Encodes the events of one streamed response."""

    def __init__(self, meta: ResponseMeta) -> None:
        self._meta = meta

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        meta = self._meta
        payload: dict[str, Any] = {
            "id": meta.id,
            "object": "chat.completion.chunk" if meta.kind == "chat" else "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [choice] if choice is not None else [],
        }
        if meta.include_usage:
            # OpenAI: with include_usage every chunk carries "usage": null except the last one.
            payload["usage"] = None
        return payload

    def _choice(self, content: str | None, *, role: bool = False, finish_reason: str | None = None) -> dict[str, Any]:
        if self._meta.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish_reason}

    def start(self) -> bytes:
        """The role chunk of a chat stream; text completions have none."""
        if self._meta.kind != "chat":
            return b""
        return encode_event(self._chunk(self._choice("", role=True)))

    def delta(self, text: str) -> bytes:
        return encode_event(self._chunk(self._choice(text)))

    def finish(self, finish_reason: str) -> bytes:
        return encode_event(self._chunk(self._choice(None, finish_reason=finish_reason)))

    def usage(self, usage: Usage) -> bytes:
        if not self._meta.include_usage:
            return b""
        payload = self._chunk(None)
        payload["usage"] = usage_dict(usage)
        return encode_event(payload)

    @staticmethod
    def error(body: dict[str, Any]) -> bytes:
        return encode_event(body)


def full_response(meta: ResponseMeta, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
    """The non-streamed response object."""
    if meta.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage_dict(usage),
    }
