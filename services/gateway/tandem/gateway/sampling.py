"""The client's sampling options as the gateway carries them to both workers.

Built by :mod:`tandem.gateway.api.validation` from a validated request; read by
the :mod:`tandem.gateway.orchestrator`, which sends the same options to the
prefill worker (first token) and to the decode worker (the rest), so both
sample under the same rules. ``None`` means "the model's default, else vLLM's".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tandem.common.sampling_options import OPTIONAL_SCALAR_FIELDS
from tandem.v1 import common_pb2

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar every generated token must follow (vLLM's structured outputs)."""

    kind: StructuredKind
    #: json_schema: the schema (a JSON object); regex/grammar: the text; choice: the options; json_object: True.
    value: Any

    def to_proto(self) -> common_pb2.StructuredOutput:
        if self.kind == "json_schema":
            return common_pb2.StructuredOutput(json_schema=json.dumps(self.value, ensure_ascii=False))
        if self.kind == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        if self.kind == "choice":
            return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=list(self.value)))
        if self.kind == "regex":
            return common_pb2.StructuredOutput(regex=str(self.value))
        return common_pb2.StructuredOutput(grammar=str(self.value))


@dataclass(frozen=True)
class SamplingParams:
    """The client's sampling options; ``None`` means the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    #: token id → bias, as sorted pairs (hashable, deterministic).
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: None: no log-probabilities; n: the sampled token's and the n most likely alternatives.
    logprobs: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    structured_output: StructuredOutput | None = None
    #: vLLM's extension: generate ``max_tokens`` even past end-of-sequence (benchmarks).
    ignore_eos: bool = False

    def to_proto(self, max_tokens: int) -> common_pb2.SamplingOptions:
        options = common_pb2.SamplingOptions(
            max_tokens=max_tokens,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=dict(self.logit_bias),
            ignore_eos=self.ignore_eos,
        )
        for name in OPTIONAL_SCALAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(options, name, value)
        if self.structured_output is not None:
            options.structured_output.CopyFrom(self.structured_output.to_proto())
        return options
