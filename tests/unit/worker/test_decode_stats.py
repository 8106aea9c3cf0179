"""A finished decode whose KV load figures the KV server cannot give in time still ends
normally: the figures are for timings and counters, never a reason to fail an answer
(the churn fault test once lost a complete answer to a GetStats DEADLINE_EXCEEDED).

The engine is a scripted stand-in for ``AsyncLLM.generate`` (this test is about the
service around it); the KV server is a real gRPC server that answers too late."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from tandem.common.tls import TLSSettings
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.service import WorkerService
from tandem.worker.settings import WorkerSettings

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

FIRST_TOKEN, FIRST_TEXT = 11, "Hi"


@dataclass
class _Completion:
    token_ids: list[int]
    text: str
    logprobs: Any = None
    finish_reason: str | None = None


@dataclass
class _Output:
    outputs: list[_Completion]
    finished: bool = False
    num_cached_tokens: int = 0


@dataclass
class ScriptedEngine:
    """Streams the replayed first token, then two more, as vLLM's DELTA outputs do."""

    model_config: Any = field(default_factory=lambda: type("Cfg", (), {"get_diff_sampling_param": lambda self: {}})())

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[_Output]:
        yield _Output([_Completion([FIRST_TOKEN], FIRST_TEXT)])
        yield _Output([_Completion([12], " there")])
        yield _Output([_Completion([13], "!", finish_reason="stop")], finished=True, num_cached_tokens=3)

    async def abort(self, request_id: str) -> None:
        pass


class SlowKVServer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def GetStats(self, request: kv_transfer_pb2.KVStatsRequest, context: Any) -> kv_transfer_pb2.KVStats:
        await asyncio.sleep(self.delay_s)
        return kv_transfer_pb2.KVStats(
            request_found=True, request=kv_transfer_pb2.KVRequestStats(num_kv_tokens_loaded=3)
        )


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


def _layout() -> KVLayout:
    return KVLayout(model="m", dtype="float32", block_size_tokens=4, num_layers=2, block_shape=(2, 4, 1, 8))


async def _decode(delay_s: float) -> tuple[list[worker_pb2.DecodeChunk], WorkerService]:
    server = grpc.aio.server()
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(SlowKVServer(delay_s), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        settings = WorkerSettings(role="decode", kv={"host": "127.0.0.1", "port": port}, tls=TLSSettings())
        service = WorkerService(settings, ScriptedEngine(), worker_id="decode-0")
        service.layout = layout = _layout()
        request = worker_pb2.DecodeRequest(
            request_id="r1",
            prompt_token_ids=[1, 2, 3, 4],
            first_token_id=FIRST_TOKEN,
            first_text=FIRST_TEXT,
            sampling=common_pb2.SamplingOptions(max_tokens=3, temperature=0.0),
            kv_handle=common_pb2.KVHandle(
                engine_id="prefill-0",
                kv_address="127.0.0.1:1",
                remote_request_id="r1",
                block_ids=[0],
                num_tokens=4,
                layout=layout.to_proto(),
            ),
        )
        chunks = [chunk async for chunk in service.Decode(request, Context())]  # type: ignore[arg-type]
        return chunks, service
    finally:
        await server.stop(grace=None)


async def test_decode_reports_the_kv_figures_when_the_kv_server_answers() -> None:
    chunks, service = await _decode(delay_s=0.0)
    assert "".join(c.text for c in chunks) == " there!"
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].stats.num_kv_tokens_loaded == 3
    assert service.num_decode_stats_unavailable == 0


async def test_a_kv_server_too_slow_for_the_figures_does_not_fail_the_answer() -> None:
    chunks, service = await _decode(delay_s=4.0)  # past the service's 2 s wait for the figures
    assert "".join(c.text for c in chunks) == " there!"
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].stats.num_output_tokens == 2
    assert chunks[-1].stats.num_kv_tokens_loaded == 0  # unknown, not made up
    assert service.num_decode_stats_unavailable == 1
