"""Requests naming a LoRA adapter, through the worker service with a scripted engine (fake_engine.py):
the adapter reaches the engine with the request and is held while it runs, the prefill's KV handle
names the adapter its engine ran with, a decode refuses a handle of another adapter (like the layout
check), a worker with LoRA off refuses adapters, and the registry record shows the adapters loaded.
Residency itself: test_adapter_residency.py; the real engines: tests/integration/test_adapters_real.py
(test_the_workers_keep_adapters_apart_over_grpc)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import grpc
import pytest

from tandem.common.adapters import AdapterEntry
from tandem.common.tls import TLSSettings
from tandem.v1 import common_pb2, worker_pb2
from tandem.worker.adapters import AdapterResidency
from tandem.worker.kv_connector.params import HANDLE, KVHandleParams
from tandem.worker.metrics import KVCollector
from tandem.worker.registration import _current, build_record
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
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

MODEL = "SmolLM2-135M-Instruct"
ADAPTER = AdapterEntry("tandem-test-a", MODEL, "/adapters/a", 3)
OTHER = AdapterEntry("tandem-test-b", MODEL, "/adapters/b", 4)


def _settings(role: str, max_adapters: int) -> WorkerSettings:
    return WorkerSettings(
        role=role,
        kv={"host": "127.0.0.1", "port": 1},
        tls=TLSSettings(),
        engine={"served_model_name": MODEL},
        adapters={"max_adapters": max_adapters},
    )


async def _service(role: str, engine: ScriptedEngine, *, max_adapters: int = 2) -> WorkerService:
    service = WorkerService(_settings(role, max_adapters), engine, worker_id=f"{role}-0")
    if max_adapters:

        async def read() -> Mapping[str, AdapterEntry]:
            return {ADAPTER.name: ADAPTER, OTHER.name: OTHER}

        service.use_adapters(AdapterResidency(engine, read, model=MODEL, max_adapters=max_adapters))
    await service.start()
    return service


def _prefill_request(adapter: str) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id="p1",
        prompt_token_ids=list(range(40)),
        keep_kv=True,
        sampling=common_pb2.SamplingOptions(),
        kv_capability=CAPABILITY,
        adapter=adapter,
    )


def _decode_request(adapter: str, handle_adapter: str) -> worker_pb2.DecodeRequest:
    return decode_request(adapter=adapter, kv_handle=handle(adapter=handle_adapter))


async def test_prefill_runs_with_the_adapter_and_its_handle_names_it() -> None:
    handle = KVHandleParams(
        "prefill-0", "10.0.0.7:9500", "p1", (3, 4), 40, time.time() + 60, adapter=ADAPTER.engine_name
    )
    engine = ScriptedEngine(
        outputs=[
            Output(
                [Completion([FIRST_TOKEN], "日本 🗼", finish_reason="length")],
                finished=True,
                kv_transfer_params={HANDLE: handle.to_dict()},
            )
        ]
    )
    service = await _service("prefill", engine)
    response = await service.Prefill(_prefill_request(ADAPTER.engine_name), Context())  # type: ignore[arg-type]
    assert engine.adapters_used == [ADAPTER.engine_name]
    assert engine.adapter_calls == [("add", ADAPTER.engine_name)]
    assert response.kv_handle.adapter == ADAPTER.engine_name
    assert service.loaded_adapters == (ADAPTER.engine_name,)
    assert service.adapters is not None and service.adapters.in_use(ADAPTER.engine_name) == 0


async def test_decode_runs_with_the_adapter_of_a_matching_handle() -> None:
    engine = ScriptedEngine(outputs=decode_outputs())
    service = await _service("decode", engine)
    request = _decode_request(ADAPTER.engine_name, ADAPTER.engine_name)
    chunks = [c async for c in service.Decode(request, Context())]  # type: ignore[arg-type]
    assert chunks[-1].finish_reason == "stop"
    assert engine.adapters_used == [ADAPTER.engine_name]
    assert service.adapters is not None and service.adapters.in_use(ADAPTER.engine_name) == 0


@pytest.mark.parametrize(
    ("adapter", "handle_adapter"),
    [(ADAPTER.engine_name, OTHER.engine_name), (ADAPTER.engine_name, ""), ("", ADAPTER.engine_name)],
)
async def test_decode_refuses_a_handle_of_another_adapter(adapter: str, handle_adapter: str) -> None:
    engine = ScriptedEngine(outputs=decode_outputs())
    service = await _service("decode", engine)
    context = Context()
    with pytest.raises(Refused):
        [c async for c in service.Decode(_decode_request(adapter, handle_adapter), context)]  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "adapter" in context.details
    assert engine.params == [] and engine.adapter_calls == []


async def test_a_worker_with_lora_off_refuses_adapters() -> None:
    engine = ScriptedEngine(outputs=decode_outputs())
    service = await _service("decode", engine, max_adapters=0)
    context = Context()
    request = _decode_request(ADAPTER.engine_name, ADAPTER.engine_name)
    with pytest.raises(Refused):
        [c async for c in service.Decode(request, context)]  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION and "no LoRA adapters" in context.details
    assert engine.params == []
    assert service.num_running == 0


@pytest.mark.parametrize("adapter", ["tandem-test-a", "a@b", "<|im_start|>@1", "café@2", "a@1" + "0" * 400])
async def test_a_malformed_adapter_is_invalid(adapter: str) -> None:
    engine = ScriptedEngine()
    service = await _service("prefill", engine)
    context = Context()
    with pytest.raises(Refused):
        await service.Prefill(_prefill_request(adapter), context)  # type: ignore[arg-type]
    assert context.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert engine.params == []


async def test_an_unknown_adapter_is_not_found() -> None:
    engine = ScriptedEngine()
    service = await _service("prefill", engine)
    context = Context()
    with pytest.raises(Refused):
        await service.Prefill(_prefill_request("gone@99"), context)  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.NOT_FOUND and "gone" in context.details


def _prefetch_request(adapter: str) -> worker_pb2.PrefetchKVRequest:
    return worker_pb2.PrefetchKVRequest(
        request_id="d1", kv_address="p:1", num_prompt_tokens=40, kv_capability=CAPABILITY, adapter=adapter
    )


async def test_a_prefetch_streams_for_its_adapter() -> None:
    """The engine's prefetch is told the adapter, which its stream names to the prefill worker's KV server
    and the staged KV keeps (tandem.worker.kv_connector.puller; the real pull: test_kv_prefetch.py)."""
    engine = ScriptedEngine()
    service = await _service("decode", engine)
    for adapter in (ADAPTER.engine_name, ""):
        assert (await service.PrefetchKV(_prefetch_request(adapter), Context())).accepted  # type: ignore[arg-type]
    assert [order.adapter for order in engine.prefetched] == [ADAPTER.engine_name, ""]


async def test_a_prefetch_for_an_adapter_is_refused_on_a_worker_with_lora_off_and_a_malformed_one_is_invalid() -> None:
    engine = ScriptedEngine()
    off = await _service("decode", engine, max_adapters=0)
    refused = await off.PrefetchKV(_prefetch_request(ADAPTER.engine_name), Context())  # type: ignore[arg-type]
    assert not refused.accepted and "no LoRA adapters" in refused.reason
    assert off.prefetches_by_outcome == {"refused": 1} and engine.prefetched == []
    service = await _service("decode", engine)
    context = Context()
    with pytest.raises(Refused):
        await service.PrefetchKV(_prefetch_request("<|im_start|>@1"), context)  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "adapter" in context.details
    assert engine.prefetched == []


async def test_the_registry_record_carries_max_adapters_and_the_loaded_ones() -> None:
    engine = ScriptedEngine(outputs=decode_outputs())
    service = await _service("decode", engine, max_adapters=2)
    record = build_record(_settings("decode", 2), "decode-0", num_kv_blocks=10, block_size_tokens=16)
    assert record.max_adapters == 2 and record.adapters == ()
    for adapter in (ADAPTER, OTHER, ADAPTER):
        engine.outputs = decode_outputs()
        request: Any = _decode_request(adapter.engine_name, adapter.engine_name)
        [c async for c in service.Decode(request, Context())]
    current = await _current(record, service)
    assert current.adapters == (OTHER.engine_name, ADAPTER.engine_name)  # least recently used first
    assert type(current).from_json(current.to_json()).adapters == current.adapters


async def test_the_adapter_slots_are_in_the_workers_metrics() -> None:
    engine = ScriptedEngine(outputs=decode_outputs())
    service = await _service("decode", engine, max_adapters=2)
    [c async for c in service.Decode(_decode_request(ADAPTER.engine_name, ADAPTER.engine_name), Context())]  # type: ignore[arg-type]
    samples = {
        (sample.name, sample.labels.get("role")): sample.value
        for family in KVCollector(service).collect()
        for sample in family.samples
    }
    assert samples[("tandem_worker_adapter_loads_total", "decode")] == 1
    assert samples[("tandem_worker_adapter_evictions_total", "decode")] == 0
    assert samples[("tandem_worker_adapter_load_failures_total", "decode")] == 0
    assert samples[("tandem_worker_adapters_loaded", "decode")] == 1
    assert samples[("tandem_worker_adapter_slots", "decode")] == 2
    off = await _service("decode", ScriptedEngine(), max_adapters=0)
    assert not [f for f in KVCollector(off).collect() if f.name.startswith("tandem_worker_adapter")]
