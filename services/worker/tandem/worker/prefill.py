"""The prefill role: run the prompt, return the first token and, when the
request continues on a decode worker, the handle of the KV blocks this
engine's KV server now holds for it (under a lease)."""

from __future__ import annotations

import time

import grpc

from tandem.v1 import worker_pb2
from tandem.worker.continuation import first_streamed_text
from tandem.worker.handling import Ctx, Role, engine_errors, engine_prompt, sampling_params
from tandem.worker.kv_connector.params import HANDLE, KVHandleParams, prefill_params
from tandem.worker.sampling import logprobs_messages, stop_string


class PrefillRole(Role):
    async def prefill(self, request: worker_pb2.PrefillRequest, context: Ctx) -> worker_pb2.PrefillResponse:
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = list(request.prompt_token_ids)
        params = await sampling_params(
            context,
            request.sampling,
            max_tokens=1,
            model_defaults=self._model_defaults,
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args=(
                {"kv_transfer_params": prefill_params(request.request_id, request.kv_capability)}
                if request.keep_kv
                else None
            ),
        )
        started = time.perf_counter()
        final = None
        self._counters.num_running += 1
        self._counters.num_prompt_tokens_in_flight += len(prompt_ids)
        try:
            async with self.adapter(context, request.adapter) as adapter, engine_errors(context):
                async for out in self._engine.generate(
                    engine_prompt(prompt_ids, request.cache_salt), params, request.request_id, adapter
                ):
                    final = out
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
            response.stop_string = stop_string(completion.stop_reason)
        elif handle_dict is not None:
            # The blocks are held, under their lease, by this engine's KV server, which alone tracks them.
            response.kv_handle.CopyFrom(KVHandleParams.from_dict(handle_dict).to_proto(self._layout.to_proto()))
        # else: continue on decode without a handle; decode recomputes the prompt.
        return response
