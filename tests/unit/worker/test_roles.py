"""The worker's two roles over the engine protocol, with a scripted engine (fake_engine.py):
what a decode reports about its prompt's KV comes from the finished request's own
``kv_transfer_params`` (the engine's connector), a prefill hands out the handle with its engine's
layout, an abort frees held KV through the engine, and a slow engine never stalls the heartbeat's
counters. Text includes emoji, CJK and the chat template's own control tokens."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from tandem.common.tls import TLSSettings
from tandem.v1 import common_pb2, worker_pb2
from tandem.worker.carried_penalties import CARRIED_TOKEN_IDS
from tandem.worker.first_token import REPLAY_TOKEN_ID
from tandem.worker.kv_connector.params import HANDLE, KV_LOAD, KVHandleParams, LoadRecord, PrefetchOrder, prefill_params
from tandem.worker.service import WorkerService
from tandem.worker.settings import WorkerSettings
from tests.unit.worker.fake_engine import (
    CAPABILITY,
    FIRST_TOKEN,
    Completion,
    Context,
    Output,
    Refused,
    ScriptedEngine,
    decode_outputs,
    decode_request,
    handle,
    layout,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def _service(role: str, engine: ScriptedEngine) -> WorkerService:
    settings = WorkerSettings(role=role, kv={"host": "127.0.0.1", "port": 1}, tls=TLSSettings())
    service = WorkerService(settings, engine, worker_id=f"{role}-0")
    await service.start()
    return service


async def _decode(service: WorkerService, request: worker_pb2.DecodeRequest) -> list[worker_pb2.DecodeChunk]:
    return [chunk async for chunk in service.Decode(request, Context())]  # type: ignore[arg-type]


async def test_decode_reports_the_load_the_engine_did_with_the_finished_request() -> None:
    """The first token is appended to the prompt (greedy, no stop string: the same request): the
    engine's first step samples the second token, and its text streams as it comes."""
    record = LoadRecord(num_kv_tokens_loaded=5, num_blocks_loaded=2, num_bytes=5_898_240, seconds=0.25)
    engine = ScriptedEngine(outputs=decode_outputs({KV_LOAD: record.to_dict()}, num_cached_tokens=5))
    service = await _service("decode", engine)
    chunks = await _decode(service, decode_request(kv_handle=handle(num_tokens=5)))
    assert "".join(c.text for c in chunks) == " there!"
    stats = chunks[-1].stats
    assert chunks[-1].finish_reason == "stop"
    assert stats.num_kv_tokens_loaded == 5 and stats.num_decode_cached_tokens == 0
    assert stats.num_computed_prompt_tokens == 0 and stats.num_output_tokens == 2
    assert stats.kv_transfer_bytes == 5_898_240 and stats.kv_transfer_seconds == pytest.approx(0.25)
    assert engine.prompts[0]["prompt_token_ids"] == [1, 2, 3, 4, 5, FIRST_TOKEN]
    (params,) = engine.params
    assert params.max_tokens == 2  # the client's 3 counted the first token
    # The KV is named by the Decode's own request id, as the PrefetchKV of the request names it.
    assert params.extra_args["kv_transfer_params"][HANDLE]["request_id"] == "r1"
    assert REPLAY_TOKEN_ID not in params.extra_args
    assert params.temperature == 0.0  # the client's choice beats the model's default (0.6)
    assert service.decodes_by_continuation == {"appended": 1}


async def test_a_decode_with_a_stop_string_replays_the_first_token() -> None:
    """A stop string may begin in the first token, which vLLM matches in output text only: decode
    runs the colocated request, the first token forced as its first output and not streamed again."""
    record = LoadRecord(num_kv_tokens_loaded=4, num_blocks_loaded=1, num_bytes=5_898_240, seconds=0.25)
    outputs = decode_outputs({KV_LOAD: record.to_dict()}, num_cached_tokens=4, with_first_token=True)
    engine = ScriptedEngine(outputs=outputs)
    service = await _service("decode", engine)
    sampling = common_pb2.SamplingOptions(max_tokens=3, temperature=0.0, stop=["\n\n"])
    chunks = await _decode(service, decode_request(sampling=sampling))
    assert "".join(c.text for c in chunks) == " there!"  # the replayed first token is not streamed again
    stats = chunks[-1].stats
    assert stats.num_kv_tokens_loaded == 4 and stats.num_computed_prompt_tokens == 1  # the last position
    assert stats.num_output_tokens == 2
    assert engine.prompts[0]["prompt_token_ids"] == [1, 2, 3, 4, 5]
    (params,) = engine.params
    assert params.max_tokens == 3 and params.extra_args[REPLAY_TOKEN_ID] == [FIRST_TOKEN]
    assert service.decodes_by_continuation == {"replayed": 1}


async def test_a_failed_load_counts_as_computed_and_still_reports_its_time() -> None:
    record = LoadRecord(num_kv_tokens_loaded=4, num_blocks_loaded=1, num_bytes=0, seconds=8.0, failed=True)
    engine = ScriptedEngine(outputs=decode_outputs({KV_LOAD: record.to_dict()}, num_cached_tokens=0))
    stats = (await _decode(await _service("decode", engine), decode_request()))[-1].stats
    assert stats.num_kv_tokens_loaded == 0 and stats.num_computed_prompt_tokens == 5
    assert stats.kv_transfer_seconds == pytest.approx(8.0)


async def test_a_decode_whose_prompt_was_all_cached_here_reports_no_load() -> None:
    engine = ScriptedEngine(outputs=decode_outputs(None, num_cached_tokens=4))
    stats = (await _decode(await _service("decode", engine), decode_request()))[-1].stats
    assert stats.num_kv_tokens_loaded == 0 and stats.num_decode_cached_tokens == 4
    assert stats.kv_transfer_bytes == 0


async def test_a_handle_of_another_layout_is_refused_before_the_engine_sees_it() -> None:
    engine = ScriptedEngine()
    kv_handle = handle()
    kv_handle.layout.num_layers = 3
    context = Context()
    service = await _service("decode", engine)
    with pytest.raises(Refused):
        async for _ in service.Decode(decode_request(kv_handle=kv_handle), context):  # type: ignore[arg-type]
            pass
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION and "num_layers" in context.details
    assert engine.params == []


@pytest.mark.parametrize("text", ["Olá 👋 東京", "<|im_start|>assistant\n<|im_end|>"], ids=["non-ascii", "control"])
async def test_prefill_hands_out_the_held_blocks_with_this_engines_layout(text: str) -> None:
    handle = KVHandleParams("prefill-0", "10.0.0.7:9500", "p1", (3, 4), 200, time.time() + 60)
    engine = ScriptedEngine(
        outputs=[
            Output(
                [Completion([FIRST_TOKEN], text, finish_reason="length")],
                finished=True,
                num_cached_tokens=128,
                kv_transfer_params={HANDLE: handle.to_dict()},
            )
        ]
    )
    service = await _service("prefill", engine)
    request = worker_pb2.PrefillRequest(
        request_id="p1",
        prompt_token_ids=list(range(200)),
        keep_kv=True,
        sampling=common_pb2.SamplingOptions(),
        kv_capability=CAPABILITY,
    )
    response = await service.Prefill(request, Context())  # type: ignore[arg-type]
    assert response.first_token_id == FIRST_TOKEN and response.first_text == text
    assert response.num_cached_tokens == 128 and not response.finish_reason
    assert KVHandleParams.from_proto(response.kv_handle, "p1", "") == handle
    # The engine holds the KV under the request's id, which its connector gets beside the capability.
    assert engine.params[0].extra_args["kv_transfer_params"] == prefill_params("p1", CAPABILITY)
    assert response.kv_handle.layout == layout().to_proto()
    assert engine.params[0].max_tokens == 1


async def test_a_prefill_that_stops_on_its_first_token_finishes_without_ahandle() -> None:
    engine = ScriptedEngine(outputs=[Output([Completion([2], "", finish_reason="stop")], finished=True)])
    service = await _service("prefill", engine)
    request = worker_pb2.PrefillRequest(
        request_id="p1", prompt_token_ids=[1, 2], keep_kv=True, kv_capability=CAPABILITY
    )
    response = await service.Prefill(request, Context())  # type: ignore[arg-type]
    assert response.finish_reason == "stop" and not response.HasField("kv_handle")


async def test_abort_on_a_prefill_worker_frees_held_kv_through_the_engine() -> None:
    engine = ScriptedEngine(held={"p1"})
    service = await _service("prefill", engine)
    first = await service.Abort(worker_pb2.AbortRequest(request_id="p1"), Context())  # type: ignore[arg-type]
    again = await service.Abort(worker_pb2.AbortRequest(request_id="p1"), Context())  # type: ignore[arg-type]
    assert first.found and not again.found
    assert engine.aborted == ["p1", "p1"] and engine.kv_aborted == ["p1", "p1"]


async def test_abort_on_a_decode_worker_aborts_the_request_and_drops_its_prefetch() -> None:
    engine = ScriptedEngine()
    service = await _service("decode", engine)
    request = worker_pb2.PrefetchKVRequest(
        request_id="d1", kv_address="p:1", num_prompt_tokens=300, kv_capability=CAPABILITY
    )
    started = await service.PrefetchKV(request, Context())  # type: ignore[arg-type]
    first = await service.Abort(worker_pb2.AbortRequest(request_id="d1"), Context())  # type: ignore[arg-type]
    again = await service.Abort(worker_pb2.AbortRequest(request_id="d1"), Context())  # type: ignore[arg-type]
    assert started.accepted and first.found and not again.found
    assert engine.aborted == ["d1", "d1"] and engine.kv_aborted == ["d1", "d1"]


async def test_a_prefetch_reaches_the_engine_and_a_refusal_is_an_answer() -> None:
    engine = ScriptedEngine(prefetch_refusal="staging is full")
    service = await _service("decode", engine)
    request = worker_pb2.PrefetchKVRequest(
        request_id="d2", kv_address="p:1", num_prompt_tokens=300, num_decode_cached_tokens=128, kv_capability=CAPABILITY
    )
    response = await service.PrefetchKV(request, Context())  # type: ignore[arg-type]
    assert not response.accepted and response.reason == "staging is full"
    assert engine.prefetched == [
        PrefetchOrder(
            request_id="d2",
            kv_address="p:1",
            num_prompt_tokens=300,
            num_decode_cached_tokens=128,
            capability=CAPABILITY,
            adapter="",
        )
    ]
    assert service.prefetches_by_outcome == {"refused": 1}


async def test_a_decode_worker_dials_only_registered_prefill_workers() -> None:
    """Issue 38: PrefetchKV dialled whatever address the caller named (SSRF) and staged what came back. Now a
    decode worker dials only the KV servers the registry lists as prefill workers of its model: a prefetch
    to any other address is refused before the engine hears of it, and a Decode whose handle names one
    computes the prompt itself (its engine gets no KV transfer to make)."""
    from tandem.common.registry import WorkerRecord
    from tandem.worker.peers import PrefillPeers

    reads: list[int] = []

    async def registry() -> list[WorkerRecord]:
        reads.append(1)
        return [WorkerRecord("prefill-0", "prefill", "m", "10.0.0.5:50051", kv_address="10.0.0.5:50061")]

    engine = ScriptedEngine()
    service = await _service("decode", engine)
    service.use_kv_peers(PrefillPeers(registry, min_refresh_interval_s=0.0))
    hostile = worker_pb2.PrefetchKVRequest(
        request_id="d3", kv_address="169.254.169.254:80", num_prompt_tokens=300, kv_capability=CAPABILITY
    )
    refused = await service.PrefetchKV(hostile, Context())  # type: ignore[arg-type]
    assert not refused.accepted and "not a registered prefill worker" in refused.reason
    assert engine.prefetched == []
    listed = worker_pb2.PrefetchKVRequest(
        request_id="d3", kv_address="10.0.0.5:50061", num_prompt_tokens=300, kv_capability=CAPABILITY
    )
    assert (await service.PrefetchKV(listed, Context())).accepted  # type: ignore[arg-type]
    # The whole order's fields as the engine gets them: test_a_prefetch_reaches_the_engine_and_a_refusal_is_an_answer.
    assert [(order.request_id, order.kv_address) for order in engine.prefetched] == [("d3", "10.0.0.5:50061")]

    kv_handle = handle(num_tokens=5)
    kv_handle.kv_address = "169.254.169.254:80"
    await _decode(service, decode_request(kv_handle=kv_handle))
    assert "kv_transfer_params" not in (engine.params[-1].extra_args or {})
    await _decode(service, decode_request(kv_handle=handle(num_tokens=5)))  # 127.0.0.1:1: not listed either
    kv_handle.kv_address = "10.0.0.5:50061"
    await _decode(service, decode_request(kv_handle=kv_handle))
    pulled = engine.params[-1].extra_args["kv_transfer_params"][HANDLE]
    assert pulled["kv_address"] == "10.0.0.5:50061" and pulled["capability"] == CAPABILITY


async def test_a_prefetch_on_a_prefill_worker_is_refused() -> None:
    service = await _service("prefill", ScriptedEngine())
    context = Context()
    request = worker_pb2.PrefetchKVRequest(
        request_id="p2", kv_address="p:1", num_prompt_tokens=300, kv_capability=CAPABILITY
    )
    with pytest.raises(Refused):
        await service.PrefetchKV(request, context)  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_request_for_the_other_role_is_refused() -> None:
    service = await _service("decode", ScriptedEngine())
    context = Context()
    with pytest.raises(Refused):
        await service.Prefill(worker_pb2.PrefillRequest(request_id="p1", prompt_token_ids=[1]), context)  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_worker_not_started_refuses_with_unavailable() -> None:
    settings = WorkerSettings(role="decode", kv={"host": "127.0.0.1", "port": 1}, tls=TLSSettings())
    service = WorkerService(settings, ScriptedEngine(), worker_id="decode-0")
    context = Context()
    with pytest.raises(Refused):
        await _decode(service, decode_request())
    health = await service.Health(worker_pb2.HealthRequest(), context)  # type: ignore[arg-type]
    assert not health.ready


async def test_kv_counters_from_a_busy_engine_fall_back_to_the_last_ones_read() -> None:
    engine = ScriptedEngine(held={"a", "b"})
    service = await _service("prefill", engine)
    assert (await service.refresh_kv_stats()).num_held_requests == 2
    engine.held.clear()
    engine.kv_stats_delay_s = 5.0  # a long engine step
    started = time.monotonic()
    stats = await service.refresh_kv_stats(timeout_s=0.2)
    assert time.monotonic() - started < 2.0
    assert stats.num_held_requests == 2 and stats.bytes_sent_total == 123


async def test_get_load_reports_the_engines_own_queue_and_kv_usage() -> None:
    service = await _service("decode", ScriptedEngine())
    report = await service.GetLoad(worker_pb2.LoadRequest(), Context())  # type: ignore[arg-type]
    assert (report.num_waiting_requests, report.kv_usage, report.num_kv_blocks_total) == (2, 0.25, 64)


async def test_metrics_count_decodes_by_how_they_continued() -> None:
    from tandem.worker.metrics import KVCollector

    engine = ScriptedEngine()
    service = await _service("decode", engine)
    await _decode(service, decode_request())
    engine.outputs = decode_outputs(with_first_token=True)
    await _decode(service, decode_request(sampling=common_pb2.SamplingOptions(max_tokens=3, seed=1, temperature=1.0)))
    (family,) = [m for m in KVCollector(service).collect() if m.name == "tandem_decode_continuations"]
    by_mode = {s.labels["mode"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert by_mode == {"appended": 1.0, "replayed": 1.0, "local": 0.0, "resumed": 0.0}


class _DyingEngine(ScriptedEngine):
    """Streams one token, then raises vLLM's EngineDeadError, as every request of a dead engine gets."""

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str, adapter: Any = None):  # type: ignore[no-untyped-def,override]
        from vllm.v1.engine.exceptions import EngineDeadError

        self.params.append(params)
        yield Output([Completion([12], " there")])
        raise EngineDeadError()


async def test_an_engine_that_dies_mid_stream_is_unavailable_and_names_nothing_inside() -> None:
    service = await _service("decode", _DyingEngine())
    context = Context()
    chunks = []
    with pytest.raises(Refused):
        async for chunk in service.Decode(decode_request(), context):  # type: ignore[arg-type]
            chunks.append(chunk)
    assert [c.text for c in chunks] == [" there"]
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert "EngineDead" not in context.details and "127.0.0.1" not in context.details


async def test_once_the_engine_died_every_call_is_unavailable_and_health_says_not_ready() -> None:
    engine = ScriptedEngine()
    service = await _service("decode", engine)
    service.engine_died()
    for call in (
        lambda ctx: _decode_collect(service, ctx),
        lambda ctx: service.PrefetchKV(
            worker_pb2.PrefetchKVRequest(
                request_id="r1", kv_address="127.0.0.1:1", num_prompt_tokens=3, kv_capability=CAPABILITY
            ),
            ctx,
        ),
        lambda ctx: service.GetLoad(worker_pb2.LoadRequest(), ctx),
    ):
        context = Context()
        with pytest.raises(Refused):
            await call(context)  # type: ignore[no-untyped-call]
        assert context.code == grpc.StatusCode.UNAVAILABLE
    assert engine.params == [] and engine.prefetched == []
    assert not (await service.Health(worker_pb2.HealthRequest(), Context())).ready  # type: ignore[arg-type]
    # Abort is still answered (the gateway's cleanup), and touches nothing: the dead engine holds nothing.
    answer = await service.Abort(worker_pb2.AbortRequest(request_id="r1"), Context())  # type: ignore[arg-type]
    assert not answer.found and engine.aborted == []


async def _decode_collect(service: WorkerService, context: Context) -> list[worker_pb2.DecodeChunk]:
    return [c async for c in service.Decode(decode_request(), context)]  # type: ignore[arg-type]


async def test_a_first_token_beyond_the_vocabulary_never_reaches_the_engine() -> None:
    engine = ScriptedEngine()
    service = await _service("decode", engine)
    context = Context()
    with pytest.raises(Refused):
        await _decode_collect_request(service, decode_request(first_token_id=4_000_000_000), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "first_token_id" in context.details
    assert engine.params == []


def _resumed_request(sampling: common_pb2.SamplingOptions) -> worker_pb2.DecodeRequest:
    """A migrated stream's Decode: prompt [1, 2, 3], the client holds tokens 11-13 ("Olá 👋 東")."""
    return worker_pb2.DecodeRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        local_prefill=True,
        resume_token_ids=[11, 12, 13],
        resume_text="Olá 👋 東",
        sampling=sampling,
    )


async def _decode_collect_request(
    service: WorkerService, request: worker_pb2.DecodeRequest, context: Context
) -> list[worker_pb2.DecodeChunk]:
    return [c async for c in service.Decode(request, context)]  # type: ignore[arg-type]


async def test_a_resumed_decode_replays_what_the_client_has_and_streams_only_what_follows() -> None:
    """A migrated stream: the prompt is computed here, the tokens the client received are forced as the
    engine's first outputs (so penalties, seeds and grammars continue), and neither their ids nor their
    text (emoji and CJK here) are streamed again."""
    engine = ScriptedEngine(
        outputs=[
            Output([Completion([11], "Olá")]),
            Output([Completion([12, 13], " 👋 東")]),  # the client has 東 already, as the 3rd token's text
            Output([Completion([14], "京!", finish_reason="stop")], finished=True),
        ]
    )
    service = await _service("decode", engine)
    # Seeded random sampling: the generator's draws so far cannot be re-made, so every token is replayed.
    request = _resumed_request(common_pb2.SamplingOptions(max_tokens=8, temperature=0.7, presence_penalty=1.0, seed=7))
    chunks = await _decode(service, request)
    assert [(c.text, list(c.token_ids)) for c in chunks] == [("京!", [14])]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stats.num_output_tokens == 1
    (params,) = engine.params
    assert params.extra_args[REPLAY_TOKEN_ID] == [11, 12, 13] and params.max_tokens == 8
    assert engine.prompts == [{"prompt_token_ids": [1, 2, 3]}]
    assert service.decodes_by_continuation["resumed"] == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"local_prefill": False, "first_token_id": 11}, "come with local_prefill"),
        ({"sampling": common_pb2.SamplingOptions(max_tokens=3)}, "max_tokens must be at least 1 more"),
        ({"resume_token_ids": [4_000_000_000]}, "resume_token_ids"),
        ({"resume_text": "x" * 1000}, "resume_text"),
    ],
)
async def test_a_resumed_decode_the_engine_could_not_run_is_refused(fields: dict[str, Any], message: str) -> None:
    engine = ScriptedEngine()
    service = await _service("decode", engine)
    values: dict[str, Any] = {
        "request_id": "r1",
        "prompt_token_ids": [1, 2, 3],
        "local_prefill": True,
        "resume_token_ids": [11, 12, 13],
        "resume_text": "Hi",
        "sampling": common_pb2.SamplingOptions(max_tokens=8),
        **fields,
    }
    context = Context()
    with pytest.raises(Refused):
        await _decode_collect_request(service, worker_pb2.DecodeRequest(**values), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and message in context.details, context.details
    assert engine.params == []


async def test_a_greedy_resumed_decode_takes_the_tokens_so_far_as_prompt_and_replays_only_a_stop_tail() -> None:
    """Greedy, no output-counting state: the resumed tokens become prompt (one prefill, not a step each),
    except the tail a stop string could still end in, which is replayed and not streamed again."""
    engine = ScriptedEngine(
        vocab={11: "Olá", 12: " 👋", 13: " 東"},
        outputs=[
            Output([Completion([13], " 東")]),
            Output([Completion([14], "京")]),
            # This engine's prefix cache held the prompt and the two appended tokens (it had served the
            # same answer before): more cached tokens than the client's prompt has.
            Output([Completion([15], "!", finish_reason="stop")], finished=True, num_cached_tokens=5),
        ],
    )
    service = await _service("decode", engine)
    request = _resumed_request(common_pb2.SamplingOptions(max_tokens=8, temperature=0.0, min_tokens=4, stop=["END"]))
    chunks = await _decode(service, request)
    stats = chunks[-1].stats
    assert (stats.num_decode_cached_tokens, stats.num_computed_prompt_tokens) == (5, 0)
    assert "".join(c.text for c in chunks) == "京!" and [t for c in chunks for t in c.token_ids] == [14, 15]
    (params,) = engine.params
    assert engine.prompts == [{"prompt_token_ids": [1, 2, 3, 11, 12]}]
    assert params.extra_args[REPLAY_TOKEN_ID] == [13]
    assert (params.max_tokens, params.min_tokens) == (6, 2)
    assert CARRIED_TOKEN_IDS not in params.extra_args  # no penalty to carry


async def test_a_penalised_greedy_resumed_decode_takes_the_tokens_as_prompt_and_carries_their_counts() -> None:
    """Presence and frequency penalties count output tokens: the tokens taken as prompt go to the engine
    as carried counts (tandem.worker.carried_penalties), not as a replay of one step each."""
    engine = ScriptedEngine(
        vocab={11: "Olá", 12: " 👋", 13: " 東"},
        outputs=[Output([Completion([14], "京", finish_reason="stop")], finished=True)],
    )
    service = await _service("decode", engine)
    sampling = common_pb2.SamplingOptions(max_tokens=8, temperature=0.0, presence_penalty=0.6, frequency_penalty=0.2)
    request = _resumed_request(sampling)
    chunks = await _decode(service, request)
    assert "".join(c.text for c in chunks) == "京"
    (params,) = engine.params
    assert engine.prompts == [{"prompt_token_ids": [1, 2, 3, 11, 12, 13]}]
    assert params.extra_args[CARRIED_TOKEN_IDS] == [11, 12, 13] and REPLAY_TOKEN_ID not in params.extra_args
    assert params.max_tokens == 5


@pytest.mark.parametrize(("stop_reason", "stop_string"), [("###", "###"), (None, ""), (2, "")])
async def test_the_stop_string_that_ended_the_answer_is_reported(
    stop_reason: int | str | None, stop_string: str
) -> None:
    """vLLM's stop_reason is the matched stop string, a stop token's id, or None (end-of-sequence): only a
    string is a stop string, on either role."""
    finished = Completion([13], "!", finish_reason="stop", stop_reason=stop_reason)
    decode = await _service(
        "decode", ScriptedEngine(outputs=[Output([Completion([12], " there")]), Output([finished], finished=True)])
    )
    chunks = await _decode(decode, decode_request(kv_handle=handle(num_tokens=5)))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_string == stop_string
    prefill = await _service("prefill", ScriptedEngine(outputs=[Output([finished], finished=True)]))
    request = worker_pb2.PrefillRequest(
        request_id="p1", prompt_token_ids=[1, 2], keep_kv=True, kv_capability=CAPABILITY
    )
    response = await prefill.Prefill(request, Context())  # type: ignore[arg-type]
    assert response.finish_reason == "stop" and response.stop_string == stop_string
