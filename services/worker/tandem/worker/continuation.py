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
* A migrated stream (its decode worker died after k tokens) resumes on another
  decode worker: :func:`resumed_split` says how many of the k tokens it takes as
  prompt (one prefill) and how many it replays (a step each), and
  :class:`ReplaySkipper` drops what the client already has of the replayed ones.

Replay costs one engine step at the boundary: the decode engine computes the
last prompt position again only to sample the token it is told to. Where the
request's parameters make the two forms the same request, decode instead takes
the first token as the last prompt token (:func:`appends_first_token`): its
first step samples the second token, the gap between the first and second
token the client sees is one step shorter, and decode's text is streamed as it
comes (:class:`StreamAll`). The conditions, each a place where the forms
differ: stop strings (vLLM matches them in the output text only, and one may
begin in the first token); a structured-output grammar (its state would not
have advanced over the first token); a seed under random sampling (a seeded
sampler would be one draw behind); the
first token's text incomplete (part of a character: vLLM's detokenizer primed
with a prompt that ends inside a character emits prompt text) or empty; and
special tokens joined without spaces (the detokenizer would not know the
first token was one). ``min_tokens`` and ``max_tokens`` count the first token
in the colocated request and are one lower in the appended one. Presence and
frequency penalties count output tokens only (repetition penalty counts prompt
and output alike): output tokens taken as prompt carry their share of them to
the engine (:mod:`tandem.worker.carried_penalties`), so a penalised request
appends too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from tandem.v1 import common_pb2

logger = logging.getLogger(__name__)

#: vLLM samples greedily below this temperature (``vllm.sampling_params._SAMPLING_EPS``).
_GREEDY_TEMPERATURE = 1e-5

T = TypeVar("T")


def first_streamed_text(text: str, *, finished: bool, stop_buffer_chars: int) -> str:
    """The part of the first token's ``text`` a colocated engine streams after step one.

    ``finished`` means the request really ends with this token (a stop, or the
    client's ``max_tokens`` of 1); then everything is streamed, as vLLM does."""
    if finished or stop_buffer_chars <= 0:
        return text
    return text[: max(0, len(text) - stop_buffer_chars)]


def _output_state_free(options: common_pb2.SamplingOptions, effective: Mapping[str, Any]) -> bool:
    """No sampling state counts the output tokens that cannot be carried over: output tokens taken as
    prompt leave the request the same (stop strings and characters split at the boundary aside: each
    caller checks those; presence and frequency penalties are carried: tandem.worker.carried_penalties)."""
    if options.HasField("structured_output") and options.structured_output.WhichOneof("kind"):
        return False
    if effective.get("seed") is not None and effective.get("temperature", 1.0) >= _GREEDY_TEMPERATURE:
        return False
    return bool(effective.get("skip_special_tokens", True) or effective.get("spaces_between_special_tokens", True))


def appends_first_token(options: common_pb2.SamplingOptions, effective: Mapping[str, Any], first_text: str) -> bool:
    """Whether decode may take the first token as its last prompt token instead of replaying it (see
    the module docstring). ``effective``: the ``SamplingParams`` keyword arguments the worker builds
    from ``options`` (tandem.worker.sampling.sampling_kwargs: the model's defaults filled in)."""
    if options.stop or not _output_state_free(options, effective):
        return False
    # A first token that ends inside a character streams nothing (vLLM holds the partial bytes back).
    return bool(first_text)


#: At most this many prefix lengths are tried for a resumed stream (each one is decoded once).
_MAX_SPLIT_TRIES = 64


def resumed_split(
    options: common_pb2.SamplingOptions,
    effective: Mapping[str, Any],
    resumed: Sequence[int],
    resume_text: str,
    decode: Callable[[Sequence[int]], str],
) -> tuple[int, int]:
    """How a migrated stream resumes: (n, c): the first ``n`` of the ``resumed`` tokens become prompt,
    the rest are replayed, and the first ``c`` characters of ``resume_text`` are those prompt tokens'.

    Replaying costs an engine step a token (a hundred tokens take seconds on a CPU); taking tokens as
    prompt costs one prefill for all of them. Taking them is the same request where no sampling state
    counts output tokens but the penalties the caller carries over (:func:`_output_state_free`) and
    the tokens replayed still hold what vLLM
    checks in the output alone: the prefix must end on a whole character (``decode``, the engine's
    tokenizer, gives exactly the start of ``resume_text``, no U+FFFD), and the replayed text must hold
    at least a stop string's length less one character, so that a stop string that began before the
    failure and ends after it is still matched in the output. (0, 0): replay them all."""
    if not resumed or not _output_state_free(options, effective):
        return 0, 0
    min_tail_chars = max((len(s) for s in options.stop), default=1) - 1
    for n in range(len(resumed), max(0, len(resumed) - _MAX_SPLIT_TRIES), -1):
        prefix = decode(resumed[:n])
        if prefix.endswith("\ufffd") or not resume_text.startswith(prefix):
            continue
        if len(resume_text) - len(prefix) >= min_tail_chars:
            return n, len(prefix)
    return 0, 0


def appended_options(options: common_pb2.SamplingOptions, num_appended: int = 1) -> common_pb2.SamplingOptions:
    """``options`` for a decode request with ``num_appended`` output tokens taken as prompt:
    ``min_tokens`` that much lower (they counted towards it); the caller lowers ``max_tokens`` the same
    way."""
    appended = common_pb2.SamplingOptions()
    appended.CopyFrom(options)
    appended.min_tokens = max(0, options.min_tokens - num_appended)
    return appended


class StreamAll:
    """Passes decode's delta outputs as they are: a local prefill, where this engine sampled the first
    token too and nothing was streamed before, or an appended first token, which the engine does not
    output (same interface as :class:`ReplaySkipper`)."""

    mismatch = False

    def tokens(self, token_ids: Sequence[int], per_token: Sequence[T] | None = None) -> tuple[list[int], list[T]]:
        return list(token_ids), list(per_token) if per_token else []

    def text(self, delta: str) -> str:
        return delta


class ReplaySkipper:
    """Drops what the client already received from decode's delta outputs: the replayed tokens (the
    prefill's first token; a migrated stream's tokens so far) and exactly the text streamed of them."""

    def __init__(self, replayed_token_ids: Sequence[int], streamed_text: str) -> None:
        self._replayed = list(replayed_token_ids)
        self._first_text = streamed_text
        self._num_tokens_skipped = 0
        self._num_chars_to_skip = len(streamed_text)
        self._skipped_text: list[str] = []
        self.mismatch = False

    def tokens(self, token_ids: Sequence[int], per_token: Sequence[T] | None = None) -> tuple[list[int], list[T]]:
        """``token_ids`` (and their per-token data, e.g. log-probabilities) without the replayed tokens."""
        num_skip = min(len(self._replayed) - self._num_tokens_skipped, len(token_ids))
        expected = self._replayed[self._num_tokens_skipped : self._num_tokens_skipped + num_skip]
        if list(token_ids[:num_skip]) != expected:
            self._mismatch(f"output tokens {list(token_ids[:num_skip])} are not the replayed {expected}")
        self._num_tokens_skipped += num_skip
        return list(token_ids[num_skip:]), list(per_token[num_skip:]) if per_token else []

    def text(self, delta: str) -> str:
        """``delta`` without the characters prefill already streamed."""
        if not self._num_chars_to_skip:
            return delta
        num_skip = min(self._num_chars_to_skip, len(delta))
        self._skipped_text.append(delta[:num_skip])
        self._num_chars_to_skip -= num_skip
        if not self._num_chars_to_skip and "".join(self._skipped_text) != self._first_text:
            self._mismatch("decode's text does not start with what the client received")
        return delta[num_skip:]

    def _mismatch(self, what: str) -> None:
        # Same model, tokenizer and parameters on both sides make this impossible; if it happens the
        # two workers disagree (different model folders?), and the client's text may be off.
        if not self.mismatch:
            logger.error("replayed tokens: %s", what)
        self.mismatch = True
