"""Maps ``tandem.v1.SamplingOptions`` to vLLM ``SamplingParams`` keyword
arguments, and vLLM's log-probabilities and stop reason back to ``tandem.v1``.

Called by :mod:`service` for both roles; imports nothing from vLLM, so it is
unit-testable without an engine. Both roles build their parameters here from
the same options, so the prefill's first token and decode's continuation are
sampled under the same rules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.common.sampling_options import OPTIONAL_SCALAR_FIELDS
from tandem.v1 import common_pb2


def sampling_kwargs(
    options: common_pb2.SamplingOptions,
    *,
    max_tokens: int,
    model_defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``SamplingParams`` (except ``structured_outputs``: see
    :func:`structured_output_spec`). Unset options take the model's default, then vLLM's."""
    defaults = model_defaults or {}
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "ignore_eos": options.ignore_eos,
        "min_tokens": min(options.min_tokens, max_tokens),
        "include_stop_str_in_output": options.include_stop_str_in_output,
    }
    # An option the client left unset takes the model's generation default (its
    # generation_config.json, read by vLLM's ModelConfig.get_diff_sampling_param) if
    # it has one, else vLLM's: as vLLM's own OpenAI server does.
    for name in OPTIONAL_SCALAR_FIELDS:
        if options.HasField(name):
            kwargs[name] = getattr(options, name)
        elif name in defaults:
            kwargs[name] = defaults[name]
    if options.stop:
        kwargs["stop"] = list(options.stop)
    if options.stop_token_ids:
        kwargs["stop_token_ids"] = [int(t) for t in options.stop_token_ids]
    if options.logit_bias:
        kwargs["logit_bias"] = {int(t): float(b) for t, b in options.logit_bias.items()}
    return kwargs


def structured_output_spec(options: common_pb2.SamplingOptions) -> dict[str, Any] | None:
    """Keyword arguments for vLLM's ``StructuredOutputsParams``, or None."""
    if not options.HasField("structured_output"):
        return None
    spec = options.structured_output
    kind = spec.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return {"json": json.loads(spec.json_schema)}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        return {"choice": list(spec.choice.choices)}
    return {kind: getattr(spec, kind)}  # regex, grammar


def token_logprobs(token_id: int, position: Mapping[int, Any], num_top: int) -> common_pb2.TokenLogprobs:
    """One position of vLLM's ``SampleLogprobs`` (token id → ``Logprob``) as a wire message.

    vLLM's dict holds the sampled token (with its rank in the vocabulary) and
    the ``num_top`` most likely ones (ranks 1..num_top); the sampled token is
    among those only when its rank is that small."""
    sampled = position[token_id]
    top = sorted(((tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num_top), key=_rank)
    return common_pb2.TokenLogprobs(
        token_id=int(token_id),
        logprob=_finite(sampled.logprob),
        token=sampled.decoded_token or "",
        top=[
            common_pb2.TopLogprob(token_id=int(tid), logprob=_finite(lp.logprob), token=lp.decoded_token or "")
            for tid, lp in top
        ],
    )


def logprobs_messages(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None, num_top: int
) -> list[common_pb2.TokenLogprobs]:
    if not logprobs:
        return []
    return [token_logprobs(tid, pos, num_top) for tid, pos in zip(token_ids, logprobs, strict=True)]


def _rank(item: tuple[int, Any]) -> int:
    return int(item[1].rank)


def _finite(logprob: float) -> float:
    # -inf (a token masked out) is not JSON; OpenAI reports -9999.0 for such tokens.
    return max(float(logprob), -9999.0)


def stop_string(stop_reason: int | str | None) -> str:
    """The stop string that ended an answer, from vLLM's ``CompletionOutput.stop_reason`` (the matched stop
    string, or the id of a stop token, or None for end-of-sequence); "" when no stop string did."""
    return stop_reason if isinstance(stop_reason, str) else ""
