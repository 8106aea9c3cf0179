"""The decode role: continue a request from a prefill worker's KV (pulled by
the engine's KV connector; the first token appended to the prompt where that
is the same request, else replayed: tandem.worker.continuation) or, for a local prefill,
run the whole request here; stream the new tokens, and end with what the
request cost (prompt tokens loaded, computed and cached, the KV pull's time
and bytes, from the finished request's own ``kv_transfer_params``)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tandem.v1 import worker_pb2
from tandem.worker.carried_penalties import carried_args
from tandem.worker.continuation import (
    ReplaySkipper,
    StreamAll,
    appended_options,
    appends_first_token,
    resumed_split,
)
from tandem.worker.first_token import replay_args
from tandem.worker.handling import Ctx, Role, engine_errors, engine_prompt, sampling_params
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.params import KVHandleParams, PrefetchOrder, decode_params, load_record_of
from tandem.worker.peers import PrefillPeers
from tandem.worker.sampling import logprobs_messages, sampling_kwargs, stop_string

logger = logging.getLogger(__name__)


class DecodeRole(Role):
    #: The KV servers this worker may dial (set by ``__main__``; None only in tests of one piece).
    peers: PrefillPeers | None = None

    async def _dials(self, kv_address: str) -> bool:
        return self.peers is None or await self.peers.allows(kv_address)

    async def prefetch(self, request: worker_pb2.PrefetchKVRequest, context: Ctx) -> worker_pb2.PrefetchKVResponse:
        """Start streaming a running prefill's KV into staging (see the puller), under the request's id and
        for its adapter (the prefill worker's KV server refuses a prompt computed with another; a Decode of
        another adapter does not use what was staged); the Decode of the same request id loads from there.
        A refusal is an answer, not an error: the Decode pulls as usual."""
        reason = ""
        if not await self._dials(request.kv_address):
            reason = "kv_address is not a registered prefill worker of this model"
        elif request.adapter and self._adapters is None:
            # Its Decode will be refused here (LoRA off): staging its KV would only waste memory.
            reason = "this worker serves no LoRA adapters"
        if reason:
            self._counters.prefetches_by_outcome["refused"] += 1
            return worker_pb2.PrefetchKVResponse(accepted=False, reason=reason)
        reason = await self._engine.kv_prefetch(PrefetchOrder.from_proto(request))
        self._counters.prefetches_by_outcome["started" if not reason else "refused"] += 1
        return worker_pb2.PrefetchKVResponse(accepted=not reason, reason=reason)

    async def decode(self, request: worker_pb2.DecodeRequest, context: Ctx) -> AsyncIterator[worker_pb2.DecodeChunk]:
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = list(request.prompt_token_ids)
        local = request.local_prefill  # the request's shape is checked already (tandem.worker.validation)
        max_tokens = request.sampling.max_tokens
        # What the client has received already: the prefill's first token, or a migrated stream's tokens so
        # far. This engine takes them as prompt where that is the same request, and replays the rest
        # (tandem.worker.continuation, tandem.worker.first_token); a plain local prefill has none.
        resumed = list(request.resume_token_ids)
        options = request.sampling
        effective = sampling_kwargs(options, max_tokens=max_tokens, model_defaults=self._model_defaults)
        appended: list[int]
        replayed: list[int]
        if resumed:
            skip_special = bool(effective.get("skip_special_tokens", True))
            num_appended, num_chars = resumed_split(
                options,
                effective,
                resumed,
                request.resume_text,
                lambda ids: self._engine.decode_tokens(ids, skip_special_tokens=skip_special),
            )
            appended, replayed = resumed[:num_appended], resumed[num_appended:]
            streamed_text = request.resume_text[num_chars:]
        elif local:
            appended, replayed, streamed_text = [], [], ""
        elif appends_first_token(options, effective, request.first_text):
            appended, replayed, streamed_text = [request.first_token_id], [], ""
        else:
            appended, replayed, streamed_text = [], [request.first_token_id], request.first_text
        engine_prompt_ids = [*prompt_ids, *appended]
        # The stats' prompt: the client's, and a resumed stream's tokens this engine computed as prompt
        # (its prefix cache may hold them too); an appended first token stays the output it is.
        num_prompt = len(prompt_ids) + (len(appended) if resumed else 0)
        if appended:
            options, max_tokens = appended_options(options, len(appended)), max_tokens - len(appended)
        extra_args: dict[str, Any] = {
            **carried_args(appended, effective),
            **(replay_args(replayed) if replayed else {}),
        }
        if request.HasField("kv_handle"):
            try:
                self._layout.check_compatible(KVLayout.from_proto(request.kv_handle.layout))
            except Exception as exc:  # KVLayoutMismatchError
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            if request.kv_handle.adapter != request.adapter:
                # Blocks computed with other weights: loading them would answer with neither adapter.
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the KV handle's adapter {request.kv_handle.adapter or '(base model)'!r} is not the "
                    f"request's {request.adapter or '(base model)'!r}",
                )
            # The KV is this request's, by its one id: staged under it by PrefetchKV, or held under it by
            # the prefill worker's KV server (tandem.worker.kv_connector.params).
            handle = KVHandleParams.from_proto(request.kv_handle, request.request_id, request.kv_capability)
            if await self._dials(handle.kv_address):
                extra_args["kv_transfer_params"] = decode_params(handle)
            else:
                # Not a prefill worker of this model in the registry: never dialled. The engine computes
                # the prompt itself (the first token is replayed as usual); the hold's lease frees it there.
                logger.warning(
                    "KV handle names an unregistered prefill worker; computing the prompt here",
                    extra={"request_id": request.request_id},
                )
        params = await sampling_params(
            context,
            options,
            max_tokens=max_tokens,
            model_defaults=self._model_defaults,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args or None,
        )
        skipper: ReplaySkipper | StreamAll = ReplaySkipper(replayed, streamed_text) if replayed else StreamAll()
        mode = "resumed" if resumed else "local" if local else "appended" if appended else "replayed"
        self._counters.decodes_by_continuation[mode] += 1
        num_top_logprobs = params.logprobs or 0
        num_output = 0
        started = time.perf_counter()
        started_monotonic = time.monotonic()  # vLLM's engine stamps its request events on this clock
        first_token_s = 0.0
        timeline: tuple[float, float, float] | None = None
        num_kv_tokens = len(engine_prompt_ids) + max_tokens
        self._counters.num_running += 1
        self._counters.num_kv_tokens_in_flight += num_kv_tokens
        try:
            async with self.adapter(context, request.adapter) as adapter, engine_errors(context):
                async for out in self._engine.generate(
                    engine_prompt(engine_prompt_ids, request.cache_salt), params, request.request_id, adapter
                ):
                    completion = out.outputs[0]
                    token_ids, logprobs = skipper.tokens(completion.token_ids, completion.logprobs)
                    if not num_output and token_ids:
                        first_token_s = time.perf_counter() - started
                        timeline = _engine_timeline(getattr(out, "metrics", None), started_monotonic)
                    num_output += len(token_ids)
                    chunk = worker_pb2.DecodeChunk(
                        text=skipper.text(completion.text),
                        token_ids=token_ids,
                        logprobs=logprobs_messages(token_ids, logprobs, num_top_logprobs),
                    )
                    if not (chunk.text or token_ids or out.finished):
                        continue  # the replayed first token alone: prefill streamed it already
                    if out.finished:
                        chunk.finish_reason = completion.finish_reason or "stop"
                        chunk.stop_string = stop_string(completion.stop_reason)
                        chunk.stats.CopyFrom(self._stats(out, num_prompt, num_output))
                        chunk.stats.first_token_seconds = first_token_s
                        if timeline is not None:
                            (
                                chunk.stats.engine_queued_after_seconds,
                                chunk.stats.engine_scheduled_after_seconds,
                                chunk.stats.engine_first_token_after_seconds,
                            ) = timeline
                    yield chunk
        finally:
            self._counters.num_running -= 1
            self._counters.num_kv_tokens_in_flight -= num_kv_tokens

    def _stats(self, out: Any, num_prompt: int, num_output: int) -> worker_pb2.DecodeStats:
        """Where the prompt's KV came from: loaded (the engine's connector reports its pull with the
        finished request), found in this engine's prefix cache, or computed here."""
        load = load_record_of(out.kv_transfer_params)
        num_loaded = load.num_kv_tokens_loaded if load is not None and not load.failed else 0
        num_cached_total = int(out.num_cached_tokens or 0)
        num_decode_cached = max(0, num_cached_total - num_loaded)
        num_computed = num_prompt - num_decode_cached - num_loaded
        self._counters.prompt_tokens_computed += num_computed
        return worker_pb2.DecodeStats(
            num_kv_tokens_loaded=num_loaded,
            num_computed_prompt_tokens=num_computed,
            num_decode_cached_tokens=num_decode_cached,
            num_output_tokens=num_output,
            kv_transfer_seconds=load.seconds if load is not None else 0.0,
            kv_transfer_bytes=load.num_bytes if load is not None else 0,
            kv_prefetched=load is not None and load.prefetched,
            kv_reported_after_seconds=load.reported_after_s if load is not None else 0.0,
            kv_prefetch_wait_seconds=load.prefetch_wait_s if load is not None else 0.0,
        )


def _engine_timeline(metrics: Any, started_monotonic: float) -> tuple[float, float, float] | None:
    """(Decode call → engine queued, queued → scheduled, scheduled → first token sent) in seconds, from
    vLLM's per-request stats (``RequestStateStats``: engine-core ``time.monotonic()`` stamps); None
    where the engine keeps no stats or has not stamped all three."""
    queued_s = getattr(metrics, "queued_ts", 0.0)
    scheduled_s = getattr(metrics, "scheduled_ts", 0.0)
    first_token_s = getattr(metrics, "first_token_ts", 0.0)
    if not (queued_s and scheduled_s and first_token_s):
        return None
    return queued_s - started_monotonic, scheduled_s - queued_s, first_token_s - scheduled_s
