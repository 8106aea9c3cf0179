"""Log-probabilities in OpenAI's two shapes.

Called by :mod:`tandem.gateway.sse` for each streamed delta and for the whole
response; calls nothing. The workers send one ``tandem.v1.TokenLogprobs`` per
generated token (the prefill's first token included); vLLM computes them from
the model's raw logits, so they are the same whichever worker sampled.

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``
* completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.v1 import common_pb2


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Sequence[common_pb2.TokenLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            {**_entry(e.token, e.logprob), "top_logprobs": [_entry(t.token, t.logprob) for t in e.top]} for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[common_pb2.TokenLogprobs], text_offset: int) -> dict[str, Any]:
    """``text_offset`` is where the first of these tokens starts in the answer (characters)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }
