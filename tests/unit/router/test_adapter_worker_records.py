"""The router places adapter requests by records the real worker's registration code builds (issue 40):
WorkerService with a fake engine (tests/unit/worker/fake_engine.py) runs requests with adapters through
its real adapter residency, and ``tandem.worker.registration`` (``build_record``, then ``_current`` as
every heartbeat sends it) turns it into the record the registry stores; the router reads that JSON."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tandem.common.registry import WorkerRecord
from tandem.router.budget import BudgetConfig, BudgetView
from tandem.router.policy import CacheAwarePolicy, ScheduleRequest
from tandem.router.reservations import ReservationTable
from tandem.worker.kv_connector.params import HANDLE, KVHandleParams
from tandem.worker.registration import _current, build_record
from tandem.worker.service import WorkerService
from tests.kit import router as kit
from tests.unit.worker.fake_engine import FIRST_TOKEN, Completion, Context, Output, ScriptedEngine, decode_outputs
from tests.unit.worker.test_adapter_roles import (
    ADAPTER,
    OTHER,
    _decode_request,
    _prefill_request,
    _service,
    _settings,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def _prefill_with(adapter: str) -> WorkerService:
    handle = KVHandleParams("prefill-0", "10.0.0.7:9500", "p1", (3, 4), 40, time.time() + 60, adapter=adapter)
    engine = ScriptedEngine(
        outputs=[
            Output(
                [Completion([FIRST_TOKEN], "é 🙂 <|im_start|>", finish_reason="length")],
                finished=True,
                kv_transfer_params={HANDLE: handle.to_dict()},
            )
        ]
    )
    service = await _service("prefill", engine)
    await service.Prefill(_prefill_request(adapter), Context())  # type: ignore[arg-type]
    return service


async def _decode_with(adapter: str) -> WorkerService:
    service = await _service("decode", ScriptedEngine(outputs=decode_outputs()))
    request: Any = _decode_request(adapter, adapter)
    [c async for c in service.Decode(request, Context())]
    return service


async def _registered(role: str, worker_id: str, service: WorkerService, max_adapters: int = 2) -> WorkerRecord:
    record = build_record(_settings(role, max_adapters), worker_id, num_kv_blocks=1000, block_size_tokens=16)
    current = await _current(record, service)
    return WorkerRecord.from_json(current.to_json())  # what the registry stores and the router reads


async def test_the_router_prefers_the_real_workers_that_report_the_adapter() -> None:
    workers = [
        await _registered("prefill", "p0", await _prefill_with(OTHER.engine_name)),
        await _registered("prefill", "p1", await _prefill_with(ADAPTER.engine_name)),
        await _registered("decode", "d0", await _decode_with(ADAPTER.engine_name)),
        await _registered("decode", "d1", await _decode_with(OTHER.engine_name)),
    ]
    assert [w.adapters for w in workers] == [
        (OTHER.engine_name,),
        (ADAPTER.engine_name,),
        (ADAPTER.engine_name,),
        (OTHER.engine_name,),
    ]
    assert {w.max_adapters for w in workers} == {2}
    view = BudgetView(ReservationTable(lease_s=60), BudgetConfig())
    policy = CacheAwarePolicy()
    for i in range(20):
        request = ScheduleRequest(f"r{i}", workers[0].model, num_prompt_tokens=40, adapter=ADAPTER.engine_name)
        prefill = policy.choose(request, "prefill", workers, view)
        decode = policy.choose(request, "decode", workers, view)
        assert prefill is not None and decode is not None
        assert (prefill.worker.worker_id, decode.worker.worker_id) == ("p1", "d0")
    decision = kit.make_scheduler(workers).place_now(
        ScheduleRequest("s", workers[0].model, num_prompt_tokens=40, adapter=OTHER.engine_name), workers
    )
    assert decision.prefill is not None and (decision.prefill.worker_id, decision.decode.worker_id) == ("p0", "d1")


async def test_a_real_worker_with_lora_off_gets_no_adapter_request() -> None:
    lora_off = await _service("prefill", ScriptedEngine(outputs=[]), max_adapters=0)
    workers = [
        await _registered("prefill", "p0", lora_off, max_adapters=0),
        await _registered("prefill", "p1", await _prefill_with(OTHER.engine_name)),
    ]
    assert workers[0].max_adapters == 0 and workers[0].adapters == ()
    table = ReservationTable(lease_s=60)
    table.reserve("busy", ("p1",), {"p1": 12_000})
    request = ScheduleRequest("r", workers[0].model, num_prompt_tokens=40, adapter=ADAPTER.engine_name)
    scored = CacheAwarePolicy().choose(request, "prefill", workers, BudgetView(table, BudgetConfig()))
    assert scored is not None and scored.worker.worker_id == "p1"
