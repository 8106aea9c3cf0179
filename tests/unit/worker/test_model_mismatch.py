"""Two base models in one deployment (issue 40): a decode worker of model X refuses a KV handle made by
model Y's prefill worker, even when the two models' KV blocks have the same shape (a fine-tune of the
same architecture, as SmolLM2-135M-Instruct-tandem-merged is of SmolLM2-135M-Instruct): the handle's
layout names its model (KVLayout.model, the engine's served model name), and only the model differs.
FAILED_PRECONDITION naming the model, before the engine runs or the prefill worker is dialled. The same
check on the KV server over real gRPC (a pull of another model's blocks):
test_kv_connector.py::test_mismatched_layout_is_refused_and_reported_as_failed_load."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from tandem.common.tls import TLSSettings
from tandem.v1 import worker_pb2
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.service import WorkerService
from tandem.worker.settings import WorkerSettings
from tests.unit.worker.fake_engine import Context, Refused, ScriptedEngine, decode_request, handle, layout

pytestmark = pytest.mark.timeout(60)

MODEL_X = "SmolLM2-135M-Instruct"
MODEL_Y = "SmolLM2-135M-Instruct-tandem-merged"


@dataclasses.dataclass
class ModelEngine(ScriptedEngine):
    """The scripted engine, its KV layout that of the model it serves."""

    model: str = MODEL_X

    async def kv_layout(self) -> KVLayout:
        return dataclasses.replace(layout(), model=self.model)


async def _decode_service(engine: ModelEngine) -> WorkerService:
    settings = WorkerSettings(
        role="decode",
        kv={"host": "127.0.0.1", "port": 1},
        tls=TLSSettings(),
        engine={"served_model_name": engine.model},
    )
    service = WorkerService(settings, engine, worker_id="decode-x")
    await service.start()
    return service


def _decode_request(handle_model: str) -> worker_pb2.DecodeRequest:
    """A Decode whose handle comes from model ``handle_model``'s prefill worker."""
    return decode_request(
        kv_handle=handle(engine_id="prefill-y", layout=dataclasses.replace(layout(), model=handle_model).to_proto())
    )


async def test_a_decode_worker_refuses_a_handle_of_another_models_prefill() -> None:
    engine = ModelEngine(model=MODEL_X)
    service = await _decode_service(engine)
    context = Context()
    with pytest.raises(Refused):
        [c async for c in service.Decode(_decode_request(MODEL_Y), context)]  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION
    # Only the model differs, and the refusal says so.
    assert "model" in context.details and MODEL_Y in context.details
    for field in ("dtype", "block_size_tokens", "num_layers", "block_shape"):
        assert field not in context.details
    # Nothing ran: the engine generated nothing and pulled nothing.
    assert engine.prompts == [] and engine.prefetched == []


async def test_a_decode_worker_takes_a_handle_of_its_own_models_prefill() -> None:
    """The same request with a handle of the worker's own model runs (the refusal above is the model's)."""
    engine = ModelEngine(model=MODEL_Y)
    service = await _decode_service(engine)
    chunks = [c async for c in service.Decode(_decode_request(MODEL_Y), Context())]  # type: ignore[arg-type]
    assert chunks[-1].finish_reason == "stop"
    assert len(engine.prompts) == 1
