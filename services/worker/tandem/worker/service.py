"""The gRPC ``tandem.v1.Worker`` service around one ``AsyncLLM``.

Called by the gateway (Prefill, Decode, Abort). GetLoad and Health answer
people and tools (``grpcurl``); no Tandem component calls them: the router
reads load from the registry heartbeat, Kubernetes probes the gRPC port.
Calls the engine, and this engine's own KV server
(``tandem.v1.KVTransfer`` in the model-runner process) for layout, counters
and releasing held blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.common.tls import aio_channel
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc
from tandem.worker.continuation import ReplaySkipper, StreamAll, first_streamed_text
from tandem.worker.first_token import replay_args
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.params import HANDLE, KVHandleParams, decode_params, prefill_params
from tandem.worker.sampling import logprobs_messages, sampling_kwargs, structured_output_spec
from tandem.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

#: How long a finished decode waits for its KV load figures before it reports without them.
_STATS_TIMEOUT_S = 2.0

_Ctx = grpc.aio.ServicerContext[Any, Any]


def _engine_refusals() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses (4xx in its own server): the client's fault."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, VLLMClientError)


@dataclass
class _Counters:
    num_running: int = 0
    num_prompt_tokens_in_flight: int = 0
    num_kv_tokens_in_flight: int = 0
    prompt_tokens_computed: int = 0
    #: Decodes whose KV load figures could not be read from the KV server in time.
    decode_stats_unavailable: int = 0


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """One role's request handling. ``engine`` is a started ``AsyncLLM``."""

    def __init__(self, settings: WorkerSettings, engine: Any, *, worker_id: str) -> None:
        self._settings = settings
        self._engine = engine
        self._worker_id = worker_id
        self._role = settings.role
        self._model = settings.engine.served_model_name
        self.kv_address = f"{settings.kv.host}:{settings.kv.port}"
        self._kv_channel = aio_channel(self.kv_address, settings.tls)
        self._kv = kv_transfer_pb2_grpc.KVTransferStub(self._kv_channel)
        self.layout: KVLayout | None = None
        self._counters = _Counters()
        self.draining = False
        #: The model's sampling defaults (generation_config.json), applied to options the client left unset.
        self._model_defaults: dict[str, Any] = dict(engine.model_config.get_diff_sampling_param())
        self._model_defaults.pop("max_tokens", None)  # the gateway decides max_tokens

    async def start(self) -> None:
        """Learn this engine's KV layout from its KV server (it is up once the engine is)."""
        self.layout = KVLayout.from_proto(await self._kv.Describe(kv_transfer_pb2.DescribeRequest(), timeout=10))

    @property
    def role(self) -> str:
        return self._role

    @property
    def num_running(self) -> int:
        return self._counters.num_running

    @property
    def num_prompt_tokens_in_flight(self) -> int:
        """Prompt tokens of the prefills running now (reported to the router to correct its budgets)."""
        return self._counters.num_prompt_tokens_in_flight

    @property
    def num_kv_tokens_in_flight(self) -> int:
        """Prompt plus max_tokens of the decodes running now."""
        return self._counters.num_kv_tokens_in_flight

    @property
    def num_decode_stats_unavailable(self) -> int:
        """Finished decodes reported without their KV load figures (the KV server did not answer in time)."""
        return self._counters.decode_stats_unavailable

    async def kv_stats(self, request_id: str = "", *, timeout_s: float = 5.0) -> kv_transfer_pb2.KVStats:
        stats: kv_transfer_pb2.KVStats = await self._kv.GetStats(
            kv_transfer_pb2.KVStatsRequest(request_id=request_id), timeout=timeout_s
        )
        return stats

    # -- helpers -----------------------------------------------------------------

    async def _check(self, context: _Ctx, role: str, prompt_len: int) -> None:
        if self._role != role:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"worker {self._worker_id} is a {self._role} worker, not {role}"
            )
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self._worker_id} is draining")
        if prompt_len == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        if prompt_len >= self._settings.engine.max_model_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt of {prompt_len} tokens does not fit max_model_len {self._settings.engine.max_model_len}",
            )

    @staticmethod
    def _prompt(token_ids: list[int], cache_salt: str) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        return prompt

    async def _sampling_params(
        self, context: _Ctx, options: common_pb2.SamplingOptions, *, max_tokens: int, **extra: Any
    ) -> Any:
        """vLLM ``SamplingParams`` for ``options``; parameters vLLM refuses abort the call (INVALID_ARGUMENT)."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        try:
            structured = structured_output_spec(options)
            return SamplingParams(
                **sampling_kwargs(options, max_tokens=max_tokens, model_defaults=self._model_defaults),
                structured_outputs=StructuredOutputsParams(**structured) if structured else None,
                **extra,
            )
        except _engine_refusals() as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling parameters: {exc}")
            raise  # unreachable: abort raises

    # -- RPCs --------------------------------------------------------------------

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: _Ctx) -> worker_pb2.PrefillResponse:
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = list(request.prompt_token_ids)
        await self._check(context, "prefill", len(prompt_ids))
        params = await self._sampling_params(
            context,
            request.sampling,
            max_tokens=1,
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args={"kv_transfer_params": prefill_params()} if request.keep_kv else None,
        )
        started = time.perf_counter()
        final = None
        self._counters.num_running += 1
        self._counters.num_prompt_tokens_in_flight += len(prompt_ids)
        try:
            async for out in self._engine.generate(
                self._prompt(prompt_ids, request.cache_salt), params, request.request_id
            ):
                final = out
        except _engine_refusals() as exc:  # the engine refused the request's parameters (e.g. a bad grammar)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"engine refused the request: {exc}")
        finally:
            self._counters.num_running -= 1
            self._counters.num_prompt_tokens_in_flight -= len(prompt_ids)
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            await context.abort(grpc.StatusCode.INTERNAL, "engine returned no token")
        assert final is not None
        completion = final.outputs[0]
        num_cached = int(final.num_cached_tokens or 0)
        self._counters.prompt_tokens_computed += len(prompt_ids) - num_cached
        first_token_id = int(completion.token_ids[0])
        finished = completion.finish_reason == "stop" or not request.keep_kv
        response = worker_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=first_token_id,
            first_text=first_streamed_text(
                completion.text, finished=finished, stop_buffer_chars=params.output_text_buffer_length
            ),
            num_prompt_tokens=len(prompt_ids),
            num_cached_tokens=num_cached,
            engine_seconds=time.perf_counter() - started,
        )
        if completion.logprobs:
            (first_logprobs,) = logprobs_messages([first_token_id], completion.logprobs[:1], params.logprobs or 0)
            response.first_logprobs.CopyFrom(first_logprobs)
        handle_dict = (final.kv_transfer_params or {}).get(HANDLE)
        if finished:
            response.finish_reason = completion.finish_reason or "length"
        elif handle_dict is not None:
            # The blocks are held, under their lease, by this engine's KV server, which alone tracks them.
            assert self.layout is not None
            response.kv_handle.CopyFrom(KVHandleParams.from_dict(handle_dict).to_proto(self.layout.to_proto()))
        # else: continue on decode without a handle; decode recomputes the prompt.
        return response

    async def Decode(self, request: worker_pb2.DecodeRequest, context: _Ctx) -> AsyncIterator[worker_pb2.DecodeChunk]:
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = list(request.prompt_token_ids)
        await self._check(context, "decode", len(prompt_ids))
        local = request.local_prefill
        if local and (request.HasField("kv_handle") or request.first_token_id or request.first_text):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a local prefill carries no kv_handle, first_token_id or first_text (no prefill worker ran)",
            )
        # The first token is replayed, not appended to the prompt: see tandem.worker.first_token.
        extra_args: dict[str, Any] = {} if local else replay_args(request.first_token_id)
        if request.HasField("kv_handle"):
            assert self.layout is not None
            try:
                self.layout.check_compatible(KVLayout.from_proto(request.kv_handle.layout))
            except Exception as exc:  # KVLayoutMismatchError
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            extra_args["kv_transfer_params"] = decode_params(KVHandleParams.from_proto(request.kv_handle))
        max_tokens = request.sampling.max_tokens
        if max_tokens < (1 if local else 2):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_tokens must be at least 1"
                if local
                else "max_tokens must be at least 2 (the first token is replayed)",
            )
        params = await self._sampling_params(
            context,
            request.sampling,
            max_tokens=max_tokens,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra_args or None,
        )
        skipper: ReplaySkipper | StreamAll = (
            StreamAll() if local else ReplaySkipper(request.first_token_id, request.first_text)
        )
        num_top_logprobs = params.logprobs or 0
        num_output = 0
        started = time.perf_counter()
        first_token_s = 0.0
        num_kv_tokens = len(prompt_ids) + max_tokens
        self._counters.num_running += 1
        self._counters.num_kv_tokens_in_flight += num_kv_tokens
        try:
            async for out in self._engine.generate(
                self._prompt(prompt_ids, request.cache_salt), params, request.request_id
            ):
                completion = out.outputs[0]
                token_ids, logprobs = skipper.tokens(completion.token_ids, completion.logprobs)
                if not num_output and token_ids:
                    first_token_s = time.perf_counter() - started
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
                    stats = await self._decode_stats(request, out, len(prompt_ids), num_output)
                    stats.first_token_seconds = first_token_s
                    chunk.stats.CopyFrom(stats)
                yield chunk
        except _engine_refusals() as exc:  # the engine refused the request's parameters (e.g. a bad grammar)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"engine refused the request: {exc}")
        finally:
            self._counters.num_running -= 1
            self._counters.num_kv_tokens_in_flight -= num_kv_tokens

    async def _decode_stats(
        self, request: worker_pb2.DecodeRequest, out: Any, num_prompt: int, num_output: int
    ) -> worker_pb2.DecodeStats:
        num_kv_loaded, kv_seconds, kv_bytes = 0, 0.0, 0
        if request.HasField("kv_handle"):
            try:
                stats = await self.kv_stats(request.request_id, timeout_s=_STATS_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                # The figures are for timings and counters only: a starved KV server (its
                # thread waits on the engine's process) must not fail an answer that is complete.
                self._counters.decode_stats_unavailable += 1
                logger.warning(
                    "decode %s: KV load figures unavailable (%s); reported without them",
                    request.request_id,
                    exc.code().name,
                )
                stats = kv_transfer_pb2.KVStats()
            if stats.request_found:
                kv_seconds, kv_bytes = stats.request.seconds, stats.request.num_bytes
                if not stats.request.failed:
                    num_kv_loaded = stats.request.num_kv_tokens_loaded
        num_cached_total = int(out.num_cached_tokens or 0)
        num_local_cached = max(0, num_cached_total - num_kv_loaded)
        num_computed = num_prompt - num_local_cached - num_kv_loaded
        self._counters.prompt_tokens_computed += num_computed
        return worker_pb2.DecodeStats(
            num_kv_tokens_loaded=num_kv_loaded,
            num_computed_prompt_tokens=num_computed,
            num_local_cached_tokens=num_local_cached,
            num_output_tokens=num_output,
            kv_transfer_seconds=kv_seconds,
            kv_transfer_bytes=kv_bytes,
        )

    async def Abort(self, request: worker_pb2.AbortRequest, context: _Ctx) -> worker_pb2.AbortResponse:
        """Abort the request in the engine and, on a prefill worker, free the KV blocks its KV server
        holds for it (found: blocks were held). Unknown ids are not an error."""
        await self._engine.abort(request.request_id)
        if self._role != "prefill":
            return worker_pb2.AbortResponse(found=False)
        response = await self._kv.Release(
            kv_transfer_pb2.ReleaseBlocksRequest(remote_request_id=request.request_id), timeout=5
        )
        return worker_pb2.AbortResponse(found=response.found)

    async def GetLoad(self, request: worker_pb2.LoadRequest, context: _Ctx) -> worker_pb2.LoadReport:
        stats = await self.kv_stats()
        return worker_pb2.LoadReport(
            worker_id=self._worker_id,
            num_running_requests=self._counters.num_running,
            num_held_kv_requests=stats.num_held_requests,
            kv_bytes_sent_total=stats.bytes_sent_total,
            kv_bytes_received_total=stats.bytes_received_total,
            kv_tokens_loaded_total=stats.kv_tokens_loaded_total,
            prompt_tokens_computed_total=self._counters.prompt_tokens_computed,
        )

    async def Health(self, request: worker_pb2.HealthRequest, context: _Ctx) -> worker_pb2.HealthResponse:
        return worker_pb2.HealthResponse(
            worker_id=self._worker_id,
            role=self._role,
            model=self._model,
            ready=self.layout is not None and not self.draining,
        )

    async def aclose(self) -> None:
        await self._kv_channel.close()


async def wait_idle(service: WorkerService, timeout_s: float) -> None:
    """Wait until no request is running, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while service.num_running and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
