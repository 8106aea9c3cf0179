"""A request as the orchestrator runs it, and the events it yields.

Built by the route handlers (:mod:`tandem.gateway.api.routes`) and read by the orchestrator, the
placer and the response writers; plain frozen data, no logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.common import kv_capability
from tandem.gateway.sampling import SamplingParams
from tandem.gateway.timings import StageClock
from tandem.v1 import common_pb2


@dataclass(frozen=True)
class GenerationJob:
    """A validated, tokenized request, ready to be placed."""

    request_id: str
    model: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    cache_salt: str = ""
    #: The tenant's priority class for the router's admission queue ("": the router's default).
    priority: str = ""
    #: The LoRA adapter to apply, by engine name (``NAME@VERSION``, tandem.common.adapters; "" for the base
    #: model ``model``): sent in every Schedule, Prefill and Decode of this request, retries included.
    adapter: str = ""
    #: The adapter's files as its engines load them: part of the prompt's block hashes, as in vLLM's.
    adapter_path: str = ""
    #: Marks scheduled / prefill_done and collects the workers' timings (mutable, owned by this request).
    clock: StageClock = field(default_factory=StageClock)
    #: What reads and releases the prompt's KV on the prefill worker, sent only to it and to the decode
    #: worker (tandem.common.kv_capability); never logged.
    kv_capability: str = field(default_factory=kv_capability.mint, repr=False)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TextDelta:
    """Newly generated tokens and their text (may be empty: a character not complete yet, or text a
    stop string may still claim), with one log-probability entry per token when the client asked."""

    text: str
    num_tokens: int
    logprobs: tuple[common_pb2.TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    usage: Usage
    #: With finish_reason "stop": the stop string that ended the answer ("" for an end-of-sequence token).
    stop_string: str = ""


GenerationEvent = TextDelta | Finished
