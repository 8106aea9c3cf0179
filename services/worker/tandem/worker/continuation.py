"""What each role streams of the text vLLM detokenizes, so that the client sees
exactly one colocated engine's stream across the prefill → decode boundary.

Called by :mod:`service`; pure (no vLLM), unit-tested with the real tokenizer
in ``tests/unit/worker/test_continuation.py``.

* Prefill generates the first token and stops (``max_tokens=1``). vLLM
  returns all of its text because the request finished, but a colocated engine
  that goes on would still hold back the last characters that a stop string
  may claim (vLLM's ``output_text_buffer_length``): :func:`first_streamed_text`
  cuts them, and they reach the client through decode.
* Decode replays the first token (:mod:`tandem.worker.first_token`), so its
  detokenizer yields the first token's text again (plus whatever was held
  back). :class:`ReplaySkipper` drops the replayed token, its log-probabilities
  and exactly the characters prefill already streamed, and passes the rest.
* A local prefill (the decode worker ran the whole request) streams all of it:
  :class:`StreamAll`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def first_streamed_text(text: str, *, finished: bool, stop_buffer_chars: int) -> str:
    """The part of the first token's ``text`` a colocated engine streams after step one.

    ``finished`` means the request really ends with this token (a stop, or the
    client's ``max_tokens`` of 1); then everything is streamed, as vLLM does."""
    if finished or stop_buffer_chars <= 0:
        return text
    return text[: max(0, len(text) - stop_buffer_chars)]


class StreamAll:
    """Passes decode's delta outputs as they are: a local prefill, where this engine sampled the first
    token too and nothing was streamed before (same interface as :class:`ReplaySkipper`)."""

    mismatch = False

    def tokens(self, token_ids: Sequence[int], per_token: Sequence[T] | None = None) -> tuple[list[int], list[T]]:
        return list(token_ids), list(per_token) if per_token else []

    def text(self, delta: str) -> str:
        return delta


class ReplaySkipper:
    """Drops what the prefill worker already streamed from decode's delta outputs."""

    def __init__(self, first_token_id: int, first_text: str) -> None:
        self._first_token_id = first_token_id
        self._first_text = first_text
        self._num_tokens_to_skip = 1
        self._num_chars_to_skip = len(first_text)
        self._skipped_text: list[str] = []
        self.mismatch = False

    def tokens(self, token_ids: Sequence[int], per_token: Sequence[T] | None = None) -> tuple[list[int], list[T]]:
        """``token_ids`` (and their per-token data, e.g. log-probabilities) without the replayed token."""
        num_skip = min(self._num_tokens_to_skip, len(token_ids))
        if num_skip and token_ids[0] != self._first_token_id:
            self._mismatch(f"first output token {token_ids[0]} is not the replayed {self._first_token_id}")
        self._num_tokens_to_skip -= num_skip
        return list(token_ids[num_skip:]), list(per_token[num_skip:]) if per_token else []

    def text(self, delta: str) -> str:
        """``delta`` without the characters prefill already streamed."""
        if not self._num_chars_to_skip:
            return delta
        num_skip = min(self._num_chars_to_skip, len(delta))
        self._skipped_text.append(delta[:num_skip])
        self._num_chars_to_skip -= num_skip
        if not self._num_chars_to_skip and "".join(self._skipped_text) != self._first_text:
            self._mismatch("decode's text does not start with what prefill streamed")
        return delta[num_skip:]

    def _mismatch(self, what: str) -> None:
        # Same model, tokenizer and parameters on both sides make this impossible; if it happens the
        # two workers disagree (different model folders?), and the client's text may be off.
        if not self.mismatch:
            logger.error("replayed first token: %s", what)
        self.mismatch = True
