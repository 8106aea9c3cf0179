"""The decode engine replays the prefill's first token as its own first output,
and a migrated stream's tokens as its first outputs.

Loaded by vLLM's engine (``logits_processors`` in :mod:`tandem.worker.engine`,
by fully qualified name) inside the model-runner process; configured per
request by :mod:`tandem.worker.decode` through ``SamplingParams.extra_args``.

Why replay rather than append the first token to decode's prompt: a decode
engine that sees the first token as *prompt* has a different request from the
one a colocated engine runs. Its detokenizer starts after that token (a
character split across the boundary comes out wrong, and vLLM's fast
detokenizer can emit prompt text), stop strings cannot begin in it,
``min_tokens``, penalties and structured-output grammars do not count it, and a
seeded sampler is one draw behind. Replaying makes the decode request the very
request a colocated engine runs: same prompt, same output tokens, so every
sampling parameter, the text and the grammar state continue exactly. The price
is one decode step at the boundary (the last prompt position is computed on
the decode engine, as vLLM always does for a fully cached prompt).

Where the two forms are the same request after all, decode appends instead
(:mod:`tandem.worker.continuation` says when; presence and frequency penalties
then carry the appended tokens' counts: :mod:`tandem.worker.carried_penalties`).

A migrated stream (a decode worker died after k tokens) is the same thing at
token k: the new decode engine replays the tokens the client has received that
it cannot take as prompt, one step each, and so continues as the very request
that died, its grammar's state and its seeded sampler's draws included (a
forced step still draws from the request's generator, as the original step did).

Contract: for a request whose ``extra_args`` carry :data:`REPLAY_TOKEN_ID` (a
list of token ids), while it has fewer output tokens than the list, every logit
except the next listed token's is ``-inf``, so greedy and random sampling, under
any temperature, top-p/top-k, min-p, penalty, bias or grammar mask, pick it. vLLM computes the returned log
probabilities from the raw logits (``logprobs_mode`` ``raw_logprobs``, its
default), so they are the model's own, not this mask's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

#: ``SamplingParams.extra_args`` key: the token ids the first outputs must be.
REPLAY_TOKEN_ID = "tandem_replay_token_ids"


def replay_args(token_ids: Sequence[int]) -> dict[str, Any]:
    """``extra_args`` entries that make the first outputs ``token_ids``."""
    return {REPLAY_TOKEN_ID: [int(t) for t in token_ids]}


class ReplayFirstToken(LogitsProcessor):  # type: ignore[misc]  # vLLM ships no type information
    """Forces the first output tokens of the requests that ask for it (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        #: batch index → (token ids to force, the request's live output-token list)
        self._forced: dict[int, tuple[list[int], Sequence[int]]] = {}
        self._vocab_size = int(vllm_config.model_config.get_vocab_size())

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        token_ids = (sampling_params.extra_args or {}).get(REPLAY_TOKEN_ID)
        if token_ids is not None and (
            not isinstance(token_ids, list) or not all(isinstance(t, int) and t >= 0 for t in token_ids)
        ):
            raise ValueError(f"{REPLAY_TOKEN_ID} must be a list of token ids, not {token_ids!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy sampling picks

    def _new_state(
        self, params: SamplingParams, _prompt_ids: list[int] | None, output_ids: list[int]
    ) -> tuple[list[int], Sequence[int]] | None:
        token_ids = (params.extra_args or {}).get(REPLAY_TOKEN_ID)
        if not token_ids or len(output_ids) >= len(token_ids):
            return None
        # The worker checks token ids against the vocabulary (tandem.worker.validation); a logit index past
        # it would kill the engine, so this last line of defence refuses to force one rather than crash.
        if max(token_ids) >= self._vocab_size:
            return None
        return list(token_ids), output_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._forced, batch_update, self._new_state)
        for index in [i for i, (token_ids, output_ids) in self._forced.items() if len(output_ids) >= len(token_ids)]:
            del self._forced[index]  # replayed: from now on the request samples freely

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (token_ids, output_ids) in self._forced.items():
            logits[index].fill_(float("-inf"))
            logits[index, token_ids[len(output_ids)]] = 0.0
        return logits
