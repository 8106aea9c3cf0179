"""SIMULATED workers' adapter slots (issue 40): loaded on first use at a cost in engine time, least
recently used evicted (never one a running request uses), reported in the registry record as the real
worker reports them, refused with LoRA off; their blocks hash with the adapter, as vLLM's do."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from tandem.local.simulated_worker import (
    SimulatedLatencyModel,
    SimulatedWorker,
    SimulatedWorkerConfig,
)
from tandem.router.adapter_slots import record_columns
from tandem.v1 import worker_pb2


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.code: Any = None
        self.details = ""

    async def abort(self, code: Any, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


def make(max_adapters: int = 2, load_s: float = 0.0) -> SimulatedWorker:
    return SimulatedWorker(
        SimulatedWorkerConfig(
            worker_id="simulated-prefill-0",
            role="prefill",
            block_size_tokens=4,
            num_kv_blocks=64,
            latency=SimulatedLatencyModel(time_scale=0.0),
            serve_grpc=False,
            max_adapters=max_adapters,
            adapter_load_s=load_s,
        )
    )


async def prefill(worker: SimulatedWorker, adapter: str, prompt: list[int] | None = None) -> worker_pb2.PrefillResponse:
    request = worker_pb2.PrefillRequest(
        request_id="r", prompt_token_ids=prompt or [7, 8, 9, 10, 11, 12, 13, 14, 15], adapter=adapter
    )
    return await worker.Prefill(request, Context())  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_slots_fill_then_the_least_recently_used_is_evicted_and_the_record_says_so() -> None:
    worker = make(load_s=0.05)
    await worker.start()
    try:
        started_s = time.monotonic()
        await prefill(worker, "a@1")
        assert time.monotonic() - started_s >= 0.05  # the load's engine time
        await prefill(worker, "b@1")
        await prefill(worker, "a@1")  # a used again: b is now the least recently used
        await prefill(worker, "c@1")  # evicts b
        assert [name for _, name in worker.adapter_loads] == ["a@1", "b@1", "c@1"]
        record = worker.record()
        assert record.max_adapters == 2
        assert record.adapters == ("a@1", "c@1")  # least recently used first, as the real worker reports
        columns = record_columns([record], "b@1")
        assert columns.capable.tolist() == [True] and not columns.resident[0] and not columns.free_slot[0]
    finally:
        await worker.aclose()


@pytest.mark.asyncio
async def test_an_adapter_in_use_is_not_evicted_and_a_burst_loads_once() -> None:
    worker = make(max_adapters=1, load_s=0.05)
    await worker.start()
    try:
        holding = asyncio.Event()
        release = asyncio.Event()

        async def hold(adapter: str) -> None:
            async with worker.using_adapter(adapter):
                holding.set()
                await release.wait()

        holder = asyncio.create_task(hold("a@1"))
        await holding.wait()
        waiting = asyncio.create_task(prefill(worker, "b@1"))
        await asyncio.sleep(0.1)
        assert not waiting.done() and worker.record().adapters == ("a@1",)
        release.set()
        await asyncio.gather(holder, waiting)
        assert worker.record().adapters == ("b@1",)
        await asyncio.gather(*(prefill(worker, "c@1") for _ in range(5)))
        assert [name for _, name in worker.adapter_loads].count("c@1") == 1
    finally:
        await worker.aclose()


@pytest.mark.asyncio
async def test_lora_off_refuses_an_adapter_request_and_serves_the_base_model() -> None:
    worker = make(max_adapters=0)
    await worker.start()
    try:
        context = Context()
        with pytest.raises(Aborted, match="LoRA adapters are off"):
            await worker.Prefill(
                worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3, 4, 5], adapter="a@1"),
                context,  # type: ignore[arg-type]
            )
        assert context.code == grpc.StatusCode.FAILED_PRECONDITION
        assert worker.num_running == 0 and worker.record().adapters == () and worker.record().max_adapters == 0
        assert (await prefill(worker, "")).num_prompt_tokens == 9
    finally:
        await worker.aclose()


@pytest.mark.asyncio
async def test_two_adapters_share_no_blocks_and_one_adapter_reuses_its_own() -> None:
    worker = make()
    await worker.start()
    try:
        prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
        assert (await prefill(worker, "a@1", prompt)).num_cached_tokens == 0
        assert (await prefill(worker, "b@1", prompt)).num_cached_tokens == 0
        assert (await prefill(worker, "", prompt)).num_cached_tokens == 0
        assert (await prefill(worker, "a@1", prompt)).num_cached_tokens == 12
    finally:
        await worker.aclose()
