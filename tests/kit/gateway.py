"""The gateway's doubles: scripted ``tandem.v1.Worker`` servers, an in-process
router, a readiness probe, and a tiny real tokenizer folder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tandem.common.errors import TandemError
from tandem.gateway.readiness import ReadinessReport
from tandem.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"
WORDS = [
    "system",
    "user",
    "assistant",
    "developer",
    "hello",
    "world",
    "hi",
    "there",
    "how",
    "are",
    "you",
    "one",
    "two",
    "three",
    "four",
    "five",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def make_tokenizer_dir(path: Path) -> Path:
    """Writes a real Hugging Face tokenizer folder (word-level over :data:`WORDS`, with a chat
    template) that loads in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for word in WORDS:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )
    tokenizer.save_pretrained(str(path))
    return path


@dataclass
class DecodeStep:
    text: str
    token_ids: Sequence[int]
    finish_reason: str = ""
    #: With finish_reason "stop": the stop string that ended the answer (DecodeChunk.stop_string).
    stop_string: str = ""


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A scripted tandem.v1.Worker. Records every call; reports a cancelled Decode stream."""

    worker_id: str
    first_text: str = "Hello"
    first_token_id: int = 101
    prefill_finish_reason: str = ""
    num_cached_tokens: int = 2
    prefill_error: grpc.StatusCode | None = None
    decode_steps: list[DecodeStep] = field(
        default_factory=lambda: [
            DecodeStep(" world", [102]),
            DecodeStep("", [103]),  # a token that completes no character yet
            DecodeStep("!", [104], "stop"),
        ]
    )
    decode_step_delay_s: float = 0.0
    #: DecodeStats.num_decode_cached_tokens of the last chunk (the decode worker's prefix hit: prompt tokens from
    #: the decode engine's own cache).
    num_decode_cached_tokens: int = 0
    #: After this many steps the stream stalls until cancelled (None: never).
    decode_hang_after: int | None = None
    #: After this many steps the stream fails with INTERNAL (None: never).
    decode_fail_after: int | None = None
    #: After this many steps the stream fails with UNAVAILABLE, as a worker whose engine died (None: never).
    decode_unavailable_after: int | None = None
    address: str = ""
    prefill_requests: list[worker_pb2.PrefillRequest] = field(default_factory=list)
    decode_requests: list[worker_pb2.DecodeRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    prefetch_requests: list[worker_pb2.PrefetchKVRequest] = field(default_factory=list)
    #: PrefetchKV answers accepted=False with this reason, or fails with this code.
    prefetch_refusal: str = ""
    prefetch_error: grpc.StatusCode | None = None
    decode_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    aborted_event: asyncio.Event = field(default_factory=asyncio.Event)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: Any) -> worker_pb2.PrefillResponse:
        self.prefill_requests.append(request)
        if self.prefill_error is not None:
            await context.abort(self.prefill_error, "scripted prefill failure")
        response = worker_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=self.first_token_id,
            first_text=self.first_text,
            finish_reason=self.prefill_finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
        )
        if request.keep_kv and not self.prefill_finish_reason:
            response.kv_handle.CopyFrom(
                common_pb2.KVHandle(
                    engine_id=self.worker_id,
                    kv_address="127.0.0.1:1",
                    block_ids=[7, 8],
                    num_tokens=len(request.prompt_token_ids),
                )
            )
        return response

    async def Decode(self, request: worker_pb2.DecodeRequest, context: Any) -> AsyncIterator[worker_pb2.DecodeChunk]:
        self.decode_requests.append(request)
        try:
            for index, step in enumerate(self.decode_steps):
                if self.decode_hang_after is not None and index >= self.decode_hang_after:
                    await asyncio.sleep(3600)
                if self.decode_fail_after is not None and index >= self.decode_fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, "scripted decode failure")
                if self.decode_unavailable_after is not None and index >= self.decode_unavailable_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted engine death")
                if self.decode_step_delay_s:
                    await asyncio.sleep(self.decode_step_delay_s)
                chunk = worker_pb2.DecodeChunk(
                    text=step.text,
                    token_ids=list(step.token_ids),
                    finish_reason=step.finish_reason,
                    stop_string=step.stop_string,
                )
                if step.finish_reason:
                    chunk.stats.num_output_tokens = sum(len(s.token_ids) for s in self.decode_steps)
                    chunk.stats.num_decode_cached_tokens = self.num_decode_cached_tokens
                yield chunk
        except asyncio.CancelledError:
            self.decode_cancelled.set()
            raise

    async def PrefetchKV(
        self, request: worker_pb2.PrefetchKVRequest, context: Any
    ) -> worker_pb2.PrefetchKVResponse:
        self.prefetch_requests.append(request)
        if self.prefetch_error is not None:
            await context.abort(self.prefetch_error, "scripted PrefetchKV failure")
        return worker_pb2.PrefetchKVResponse(accepted=not self.prefetch_refusal, reason=self.prefetch_refusal)

    async def Abort(self, request: worker_pb2.AbortRequest, context: Any) -> worker_pb2.AbortResponse:
        self.aborted.append(request.request_id)
        self.aborted_event.set()
        return worker_pb2.AbortResponse(found=True)

    def ref(self, role: str) -> router_pb2.WorkerRef:
        # The fake's KV address is its worker address: a decode worker's PrefetchKV names it, and a
        # real one would stream from there.
        return router_pb2.WorkerRef(
            worker_id=self.worker_id, role=role, address=self.address, kv_address=self.address
        )


@dataclass
class FakeRouter:
    """Hands out scripted placements (the last one repeats) or raises a scripted error."""

    placements: list[router_pb2.Placement] = field(default_factory=list)
    error: TandemError | None = None
    schedule_calls: list[dict[str, Any]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    released_event: asyncio.Event = field(default_factory=asyncio.Event)
    #: How long each Schedule takes (a router queueing the request).
    schedule_delay_s: float = 0.0
    #: Errors raised by the first Schedule calls, one each, before the scripted behaviour.
    fail_first: list[TandemError] = field(default_factory=list)
    #: Every call in order, as ``("schedule" | "release", request_id)``: what came between two Schedules.
    calls: list[tuple[str, str]] = field(default_factory=list)

    async def schedule(
        self,
        request_id: str,
        model: str,
        num_prompt_tokens: int,
        prompt_block_hashes: Sequence[router_pb2.PromptBlockHashes],
        max_tokens: int,
        tenant: str,
        exclude_worker_ids: Sequence[str],
        priority: str = "",
        prefill_done_on_worker_id: str = "",
        local_prefill_only: bool = False,
        adapter: str = "",
    ) -> router_pb2.Placement:
        self.calls.append(("schedule", request_id))
        self.schedule_calls.append(
            {
                "request_id": request_id,
                "model": model,
                "num_prompt_tokens": num_prompt_tokens,
                "prompt_block_hashes": list(prompt_block_hashes),
                "max_tokens": max_tokens,
                "exclude_worker_ids": list(exclude_worker_ids),
                "tenant": tenant,
                "priority": priority,
                "prefill_done_on_worker_id": prefill_done_on_worker_id,
                "local_prefill_only": local_prefill_only,
                "adapter": adapter,
            }
        )
        if self.schedule_delay_s:
            await asyncio.sleep(self.schedule_delay_s)
        if self.fail_first:
            raise self.fail_first.pop(0)
        if self.error is not None:
            raise self.error
        index = min(len(self.schedule_calls) - 1, len(self.placements) - 1)
        placement = router_pb2.Placement()
        placement.CopyFrom(self.placements[index])
        placement.request_id = request_id
        return placement

    async def release(self, request_id: str) -> None:
        self.calls.append(("release", request_id))
        self.released.append(request_id)
        self.released_event.set()


def placement(prefill: FakeWorker | router_pb2.WorkerRef, decode: FakeWorker) -> router_pb2.Placement:
    prefill_ref = prefill.ref("prefill") if isinstance(prefill, FakeWorker) else prefill
    return router_pb2.Placement(prefill=prefill_ref, decode=decode.ref("decode"), lease_s=30.0)


@dataclass
class FakeReadiness:
    report: ReadinessReport = field(default_factory=lambda: ReadinessReport(True, True, 1, 1))

    async def check(self) -> ReadinessReport:
        return self.report
