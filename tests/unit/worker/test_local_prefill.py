"""Decode with ``local_prefill``: the decode engine runs the whole request (no replayed token, no
KV to pull) and streams every token, the first included. The engine is a scripted stand-in
(fake_engine.py); the request's vLLM ``SamplingParams`` are real."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tandem.common.tls import TLSSettings
from tandem.v1 import common_pb2, worker_pb2
from tandem.worker.first_token import REPLAY_TOKEN_ID
from tandem.worker.service import WorkerService
from tandem.worker.settings import WorkerSettings
from tests.unit.worker.fake_engine import FIRST_TEXT, FIRST_TOKEN, Context, Refused, ScriptedEngine, decode_outputs

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def _service(engine: ScriptedEngine) -> WorkerService:
    settings = WorkerSettings(role="decode", kv={"host": "127.0.0.1", "port": 1}, tls=TLSSettings())
    service = WorkerService(settings, engine, worker_id="decode-0")
    await service.start()
    return service


def _request(**fields: Any) -> worker_pb2.DecodeRequest:
    values: dict[str, Any] = {
        "request_id": "r1",
        "prompt_token_ids": [1, 2, 3, 4],
        "sampling": common_pb2.SamplingOptions(max_tokens=3, temperature=0.0),
        "local_prefill": True,
        **fields,
    }
    return worker_pb2.DecodeRequest(**values)


async def test_every_token_is_streamed_and_nothing_is_replayed_or_pulled() -> None:
    engine = ScriptedEngine(outputs=decode_outputs(with_first_token=True))
    service = await _service(engine)
    chunks = [chunk async for chunk in service.Decode(_request(), Context())]  # type: ignore[arg-type]
    assert "".join(c.text for c in chunks) == FIRST_TEXT + " there!"
    assert [t for c in chunks for t in c.token_ids] == [FIRST_TOKEN, 12, 13]
    stats = chunks[-1].stats
    assert chunks[-1].finish_reason == "stop"
    assert stats.num_output_tokens == 3
    assert stats.num_kv_tokens_loaded == 0 and stats.kv_transfer_bytes == 0
    assert stats.num_decode_cached_tokens == 3 and stats.num_computed_prompt_tokens == 1
    (params,) = engine.params
    assert not (params.extra_args or {}).get(REPLAY_TOKEN_ID)
    assert "kv_transfer_params" not in (params.extra_args or {})
    assert params.max_tokens == 3


async def test_one_token_is_enough_for_a_local_prefill() -> None:
    engine = ScriptedEngine(outputs=decode_outputs(with_first_token=True))
    service = await _service(engine)
    request = _request(sampling=common_pb2.SamplingOptions(max_tokens=1, temperature=0.0))
    chunks = [chunk async for chunk in service.Decode(request, Context())]  # type: ignore[arg-type]
    assert chunks[0].token_ids == [FIRST_TOKEN]
    assert engine.params[0].max_tokens == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"first_token_id": FIRST_TOKEN},
        {"first_text": FIRST_TEXT},
        {"kv_handle": common_pb2.KVHandle(engine_id="prefill-0", kv_address="127.0.0.1:1")},
    ],
    ids=["first_token_id", "first_text", "kv_handle"],
)
async def test_a_local_prefill_that_carries_a_prefill_workers_output_is_refused(fields: dict[str, Any]) -> None:
    engine = ScriptedEngine(outputs=decode_outputs(with_first_token=True))
    service = await _service(engine)
    context = Context()
    with pytest.raises(Refused):
        async for _ in service.Decode(_request(**fields), context):  # type: ignore[arg-type]
            pass
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert engine.params == []  # nothing reached the engine
