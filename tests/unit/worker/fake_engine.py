"""A scripted :class:`~tandem.worker.engine_api.WorkerEngine` for the worker's role tests: no
vLLM engine runs, but the requests' ``SamplingParams`` are vLLM's own. It streams the outputs it is
given, as vLLM's DELTA outputs do, and records what it was asked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.common import kv_capability
from tandem.common.adapters import AdapterEntry
from tandem.v1 import common_pb2, kv_transfer_pb2, worker_pb2
from tandem.worker.engine_api import EngineLoad
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.params import PrefetchOrder
from tandem.worker.validation import ModelLimits

FIRST_TOKEN, FIRST_TEXT = 11, "Hi"


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    logprobs: Any = None
    finish_reason: str | None = None
    #: vLLM's: the stop string or stop token id that ended the answer (None: end-of-sequence).
    stop_reason: int | str | None = None


@dataclass
class Output:
    outputs: list[Completion]
    finished: bool = False
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None


def layout() -> KVLayout:
    return KVLayout(model="m", dtype="float32", block_size_tokens=4, num_layers=2, block_shape=(2, 4, 1, 8))


#: The prompt's capability, as the gateway mints it (tandem.common.kv_capability).
CAPABILITY = kv_capability.mint()


def handle(num_tokens: int = 4, **fields: Any) -> common_pb2.KVHandle:
    """A prefill worker's KV handle of :func:`layout`; ``fields`` override any of it."""
    values: dict[str, Any] = {
        "engine_id": "prefill-0",
        "kv_address": "127.0.0.1:1",
        "block_ids": [0, 1],
        "num_tokens": num_tokens,
        "layout": layout().to_proto(),
        **fields,
    }
    return common_pb2.KVHandle(**values)


def decode_request(**fields: Any) -> worker_pb2.DecodeRequest:
    """A Decode after a prefill (:func:`handle`, :data:`CAPABILITY`); ``fields`` override any of it."""
    values: dict[str, Any] = {
        "request_id": "r1",
        "prompt_token_ids": [1, 2, 3, 4, 5],
        "first_token_id": FIRST_TOKEN,
        "first_text": FIRST_TEXT,
        "sampling": common_pb2.SamplingOptions(max_tokens=3, temperature=0.0),
        "kv_handle": handle(),
        "kv_capability": CAPABILITY,
        **fields,
    }
    return worker_pb2.DecodeRequest(**values)


def decode_outputs(
    kv_transfer_params: dict[str, Any] | None = None, num_cached_tokens: int = 3, *, with_first_token: bool = False
) -> list[Output]:
    """Two tokens after the first (after the first token itself, with ``with_first_token``: a replay
    or a local prefill); the last output carries ``kv_transfer_params``."""
    return [
        *([Output([Completion([FIRST_TOKEN], FIRST_TEXT)])] if with_first_token else []),
        Output([Completion([12], " there")]),
        Output(
            [Completion([13], "!", finish_reason="stop")],
            finished=True,
            num_cached_tokens=num_cached_tokens,
            kv_transfer_params=kv_transfer_params,
        ),
    ]


@dataclass
class ScriptedEngine:
    outputs: list[Output] = field(default_factory=decode_outputs)
    #: What kv_abort answers, and how long kv_stats takes.
    held: set[str] = field(default_factory=set)
    kv_stats_delay_s: float = 0.0
    params: list[Any] = field(default_factory=list)
    prompts: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    #: The request ids kv_abort was called with (a hold released or a prefetch dropped).
    kv_aborted: list[str] = field(default_factory=list)
    #: The order each kv_prefetch call was given, and what it answers.
    prefetched: list[PrefetchOrder] = field(default_factory=list)
    prefetch_refusal: str = ""
    #: What is_dead answers.
    dead: bool = False
    #: decode_tokens' tokenizer: token id -> text (ids it lacks decode to U+FFFD, a split character).
    vocab: dict[int, str] = field(default_factory=dict)
    #: The adapter of each generate call ("" for the base model), and the engine's add/remove calls.
    adapters_used: list[str] = field(default_factory=list)
    adapter_calls: list[tuple[str, str]] = field(default_factory=list)

    async def add_adapter(self, entry: AdapterEntry) -> None:
        self.adapter_calls.append(("add", entry.engine_name))

    async def remove_adapter(self, entry: AdapterEntry) -> None:
        self.adapter_calls.append(("remove", entry.engine_name))

    async def generate(
        self, prompt: dict[str, Any], params: Any, request_id: str, adapter: AdapterEntry | None = None
    ) -> AsyncIterator[Any]:
        self.params.append(params)
        self.prompts.append(prompt)
        self.adapters_used.append(adapter.engine_name if adapter is not None else "")
        for out in self.outputs:
            yield out

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def sampling_defaults(self) -> dict[str, Any]:
        return {"temperature": 0.6, "max_tokens": 99}

    async def kv_layout(self) -> KVLayout:
        return layout()

    async def kv_abort(self, request_id: str) -> bool:
        self.kv_aborted.append(request_id)
        if request_id in self.held:
            self.held.discard(request_id)
            return True
        return False

    async def kv_prefetch(self, order: PrefetchOrder) -> str:
        self.prefetched.append(order)
        if not self.prefetch_refusal:
            self.held.add(order.request_id)
        return self.prefetch_refusal

    def load(self) -> EngineLoad:
        return EngineLoad(num_waiting_requests=2, kv_usage=0.25, num_kv_blocks=64)

    def decode_tokens(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return "".join(self.vocab.get(t, "\ufffd") for t in token_ids)

    def limits(self) -> ModelLimits:
        return ModelLimits(vocab_size=50_000, max_model_len=4096, max_logprobs=20, block_size_tokens=4)

    def is_dead(self) -> bool:
        return self.dead

    async def probe(self) -> None:
        return None

    async def kv_stats(self) -> kv_transfer_pb2.KVStats:
        await asyncio.sleep(self.kv_stats_delay_s)
        return kv_transfer_pb2.KVStats(num_held_requests=len(self.held), bytes_sent_total=123)


class Refused(Exception):
    pass


class Context:
    """The part of ``grpc.aio.ServicerContext`` the service uses: abort raises, as gRPC's does."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Refused(details)
