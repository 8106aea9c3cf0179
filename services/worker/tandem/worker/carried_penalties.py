"""Presence and frequency penalties for output tokens a decode engine takes as prompt.

Loaded by vLLM's engine (``logits_processors`` in :mod:`tandem.worker.engine`, by
fully qualified name) inside the model-runner process; configured per request by
:mod:`tandem.worker.decode` through ``SamplingParams.extra_args``.

Why: a migrated stream resumes on a new decode engine with the k tokens the
client already has. Taking them as prompt costs one prefill; replaying them
(:mod:`tandem.worker.first_token`) costs one engine step each, about 25 ms a
token on a 2-core CPU (3.8 s at k = 158 in ``make bench-migration``), which is
the gap the client sees. What kept penalised streams on the slow path is that
vLLM's presence and frequency penalties count *output* tokens only: as prompt,
the k tokens would stop counting, and the answer would change. This processor
puts exactly their share back, so that the request taking them as prompt
samples as the one that generated them.

The arithmetic, for a token t the carried tokens hold ``c`` times, with ``n``
occurrences in the new engine's own output, presence ``p``, frequency ``f``,
repetition ``r`` (vLLM's ``apply_penalties``, which runs right after the
non-argmax-invariant logits processors, this one among them)::

    wanted:  rep(x) - f*(c + n) - p*[c + n > 0]
    vLLM:    rep(x') - f*n - p*[n > 0]

so ``rep(x') = rep(x) - f*c - p*[n = 0]``. The repetition penalty (``rep``:
divide a positive logit by r, multiply another by r) applies to t in both
forms, since it counts prompt and output tokens alike; with r = 1 the
correction is a subtraction, otherwise ``x'`` is ``rep``'s inverse of the
corrected value. Floating-point rounding can differ in the last bit from the
colocated sum, as any re-ordered sum does; ``tests/unit/worker/test_carried_penalties.py``
checks the result against vLLM's own ``apply_penalties`` on both forms of the
same request.

Not carried here: a seed under random sampling (the generator's draws so far
cannot be re-made) and a grammar's state; :mod:`tandem.worker.continuation`
replays those streams.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

#: ``SamplingParams.extra_args`` key: the output token ids the request took as prompt.
CARRIED_TOKEN_IDS = "tandem_carried_output_token_ids"


def carries_penalties(effective: Mapping[str, Any]) -> bool:
    """Whether a request built from ``effective`` (the ``SamplingParams`` keyword arguments) has output
    penalties that output tokens taken as prompt must carry."""
    return bool(effective.get("presence_penalty", 0.0) or effective.get("frequency_penalty", 0.0))


def carried_args(token_ids: Sequence[int], effective: Mapping[str, Any]) -> dict[str, Any]:
    """``extra_args`` entries that keep ``token_ids`` (output taken as prompt) counted by the penalties;
    none where the request has no presence or frequency penalty."""
    if not token_ids or not carries_penalties(effective):
        return {}
    return {CARRIED_TOKEN_IDS: [int(t) for t in token_ids]}


@dataclass(slots=True)
class _Carried:
    token_ids: torch.Tensor  # int64, the distinct carried token ids
    counts: torch.Tensor  # float32, how often each occurs among the carried tokens
    presence: float
    frequency: float
    repetition: float
    output_ids: Sequence[int]  # the request's live output-token list (vLLM appends to it)


class CarriedPenalties(LogitsProcessor):  # type: ignore[misc]  # vLLM ships no type information
    """Applies the carried tokens' share of the presence and frequency penalties (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._carried: dict[int, _Carried] = {}
        self._vocab_size = int(vllm_config.model_config.get_vocab_size())
        self._device = device

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        token_ids = (sampling_params.extra_args or {}).get(CARRIED_TOKEN_IDS)
        if token_ids is not None and (
            not isinstance(token_ids, list) or not all(isinstance(t, int) and t >= 0 for t in token_ids)
        ):
            raise ValueError(f"{CARRIED_TOKEN_IDS} must be a list of token ids, not {token_ids!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy sampling picks, and must run before vLLM's penalties

    def _new_state(
        self, params: SamplingParams, _prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _Carried | None:
        token_ids = (params.extra_args or {}).get(CARRIED_TOKEN_IDS)
        if not token_ids or not (params.presence_penalty or params.frequency_penalty):
            return None
        # The worker checks token ids against the vocabulary (tandem.worker.validation); an index past it
        # would kill the engine, so this last line of defence carries nothing rather than crash.
        if max(token_ids) >= self._vocab_size:
            return None
        distinct, counts = torch.tensor(token_ids, dtype=torch.int64).unique(return_counts=True)
        return _Carried(
            token_ids=distinct.to(self._device),
            counts=counts.to(dtype=torch.float32, device=self._device),
            presence=float(params.presence_penalty),
            frequency=float(params.frequency_penalty),
            repetition=float(params.repetition_penalty),
            output_ids=output_ids,
        )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._carried, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, carried in self._carried.items():
            row = logits[index]  # a view: assigning into it changes the batch's logits
            row[carried.token_ids] = _corrected(row, carried, self._device)
        return logits


def _corrected(row: torch.Tensor, carried: _Carried, device: torch.device) -> torch.Tensor:
    """The carried tokens' logits in ``row``, their penalty share applied so that vLLM's penalties
    finish it."""
    # -1: a placeholder vLLM's async scheduling puts in the output list; no token.
    output = [t for t in carried.output_ids if t >= 0]
    if output:
        unseen = ~torch.isin(carried.token_ids, torch.tensor(output, dtype=torch.int64, device=device))
    else:
        unseen = torch.ones_like(carried.token_ids, dtype=torch.bool)
    share = carried.frequency * carried.counts + carried.presence * unseen.to(row.dtype)
    values = row[carried.token_ids]
    r = carried.repetition
    if r == 1.0:
        corrected = values - share
    else:  # rep(x') = rep(x) - share, with vLLM's rep: x * (1/r) if x > 0 else x * r
        wanted = torch.where(values > 0, values * (1.0 / r), values * r) - share
        corrected = torch.where(wanted > 0, wanted * r, wanted * (1.0 / r))
    return corrected.to(row.dtype)
