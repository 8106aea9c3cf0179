"""The gRPC KV connector's halves in isolation: the scheduler side's plans,
and two worker sides moving real tensors over a real gRPC server."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tandem.common import kv_capability
from tandem.common.errors import KVLayoutMismatchError
from tandem.v1 import common_pb2
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.metadata import (
    IDLE_STEP_WAIT_S,
    GrpcKVMetadata,
    GrpcKVWorkerMeta,
    HoldSpec,
    LoadSpec,
)
from tandem.worker.kv_connector.params import (
    HANDLE,
    KVHandleParams,
    LoadRecord,
    decode_params,
    load_record_of,
    prefill_params,
)
from tandem.worker.kv_connector.scheduler_side import SchedulerSide
from tandem.worker.kv_connector.worker_side import WorkerSide
from tests.kit.net import free_port

BLOCK = 4
NUM_BLOCKS = 16
LAYERS = 3
SHAPE = (NUM_BLOCKS, 2, BLOCK, 8)  # blocks, kv heads, block tokens, head content
CAPABILITY = kv_capability.mint()
#: The gateway's request id, which names the prompt's KV between engines; vLLM's own ids of its prefill and
#: of its decode request, which each engine alone knows. vLLM makes them of the gateway's id and a random
#: suffix, but nothing may read one back out of them: here they have nothing in common with it.
REQUEST = "req-1"
PREFILL_ENGINE_ID = "prefill-engine-7"
DECODE_ENGINE_ID = "decode-engine-9"


# -- factories -------------------------------------------------------------------


@dataclass
class FakeBlock:
    block_id: int
    block_hash: bytes | None = None
    is_null: bool = False


@dataclass
class FakeBlocks:
    blocks: tuple[list[FakeBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g] for g in self.blocks)


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    status: Any = None
    num_computed_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    #: vLLM's LoRARequest (its lora_name is the adapter's engine name), None for the base model.
    lora_request: Any = None


def make_handle(block_ids: tuple[int, ...], num_tokens: int, kv_address: str = "127.0.0.1:1") -> KVHandleParams:
    return KVHandleParams(
        engine_id="p",
        kv_address=kv_address,
        request_id=REQUEST,
        block_ids=block_ids,
        num_tokens=num_tokens,
        lease_expires_unix_s=time.time() + 60,
        capability=CAPABILITY,
    )


def holds_of(
    handle: KVHandleParams, engine_request_id: str = PREFILL_ENGINE_ID, expiry_unix_s: float | None = None
) -> dict[str, HoldSpec]:
    """The step metadata's announcement of ``handle``'s hold by the prefill engine's request ``engine_request_id``."""
    expiry = time.time() + 60 if expiry_unix_s is None else expiry_unix_s
    return {engine_request_id: HoldSpec(handle.request_id, handle.block_ids, expiry, handle.capability)}


def make_side(
    port: int,
    model: str = "m",
    shape: tuple[int, ...] = SHAPE,
    dtype: torch.dtype = torch.float32,
    fill: float | None = None,
    **options: Any,
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """A KV server over ``LAYERS`` caches of ``shape`` (random, or all ``fill``); ``options`` go to WorkerSide
    (``tls=``, ``max_chunk_bytes=``: two blocks of one layer per chunk unless given)."""
    side = WorkerSide(
        **{
            "model": model,
            "num_blocks": NUM_BLOCKS,
            "block_size_tokens": BLOCK,
            "tp_size": 1,
            "tp_rank": 0,
            "kv_host": "127.0.0.1",
            "kv_port": port,
            "max_chunk_bytes": 2 * 2 * BLOCK * 8 * 4,
            "pull_timeout_s": 5,
            **options,
        }
    )
    caches = {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
        )
        for i in range(LAYERS)
    }
    side.register_kv_caches(caches)
    return side, caches


def wait_until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


# -- scheduler side --------------------------------------------------------------


def test_decode_plans_a_load_of_only_the_blocks_not_cached_locally() -> None:
    side = SchedulerSide(engine_id="d", kv_address="x:1", block_size_tokens=BLOCK, lease_s=60)
    handle = make_handle((10, 11, 12), num_tokens=10)
    req = FakeRequest("r", num_prompt_tokens=11, kv_transfer_params=decode_params(handle))
    # 4 tokens (one block) are in the local prefix cache already.
    assert side.get_num_new_matched_tokens(req, num_computed_tokens=4) == (6, True)  # type: ignore[arg-type]
    blocks = FakeBlocks(([FakeBlock(7, b"h"), FakeBlock(8), FakeBlock(9)],))
    side.update_state_after_alloc(req, blocks, 6)  # type: ignore[arg-type]
    meta = side.build_connector_meta()
    assert meta.loads == [LoadSpec("r", handle, (11, 12), (8, 9), 6, 1)]
    assert meta.loads[0].handle.request_id == REQUEST  # the KV's id, not vLLM's id of this decode request
    # One transfer per request, and the pending state was drained.
    assert req.kv_transfer_params[HANDLE] and not req.kv_transfer_params["do_remote_prefill"]
    assert side.build_connector_meta().loads == []


def test_decode_with_everything_cached_releases_without_loading() -> None:
    side = SchedulerSide(engine_id="d", kv_address="x:1", block_size_tokens=BLOCK, lease_s=60)
    handle = make_handle((10, 11), num_tokens=8)
    req = FakeRequest("r", num_prompt_tokens=9, kv_transfer_params=decode_params(handle))
    assert side.get_num_new_matched_tokens(req, num_computed_tokens=8) == (0, False)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks(([],)), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta()
    assert meta.loads == [] and meta.releases == [handle]


def test_prefill_holds_blocks_only_when_length_capped() -> None:
    from vllm.v1.request import RequestStatus

    side = SchedulerSide(engine_id="p", kv_address="h:5", block_size_tokens=BLOCK, lease_s=30)
    capped = FakeRequest(
        "a-abcdefgh",
        9,
        prefill_params("a", CAPABILITY),
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=9,
    )
    delay, params = side.request_finished(capped, [3, 4, 5])  # type: ignore[arg-type]
    assert delay is True and params is not None
    handle = KVHandleParams.from_dict(params[HANDLE])
    assert (handle.request_id, handle.block_ids, handle.num_tokens, handle.kv_address) == ("a", (3, 4, 5), 9, "h:5")
    # Held as vLLM's request (which vLLM is told to free) under the gateway's id (which callers name), with the
    # capability kept beside the blocks by the KV server.
    assert side.build_connector_meta().holds == {
        "a-abcdefgh": HoldSpec("a", (3, 4, 5), handle.lease_expires_unix_s, CAPABILITY)
    }
    assert 29 < handle.lease_expires_unix_s - time.time() <= 30
    stopped = FakeRequest("b", 9, prefill_params("b", CAPABILITY), status=RequestStatus.FINISHED_STOPPED)
    assert side.request_finished(stopped, [6]) == (False, None)  # type: ignore[arg-type]
    aborted = FakeRequest("c", 9, prefill_params("c", CAPABILITY), status=RequestStatus.FINISHED_ABORTED)
    assert side.request_finished(aborted, [7]) == (False, None)  # type: ignore[arg-type]
    assert list(side.build_connector_meta().holds) == []  # announced once, above


def test_the_handle_names_the_adapter_the_prefill_engine_ran_with() -> None:
    """KVHandle.adapter comes from the engine's own request (its LoRARequest), not from the caller."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import RequestStatus

    side = SchedulerSide(engine_id="p", kv_address="h:5", block_size_tokens=BLOCK, lease_s=30)
    for lora, expected in ((LoRARequest("tandem-test-a@7", 7, "/adapters/a"), "tandem-test-a@7"), (None, "")):
        req = FakeRequest(
            "a-abcdefgh",
            9,
            prefill_params("a", CAPABILITY),
            status=RequestStatus.FINISHED_LENGTH_CAPPED,
            num_computed_tokens=9,
            lora_request=lora,
        )
        _, params = side.request_finished(req, [3, 4, 5])  # type: ignore[arg-type]
        assert params is not None
        handle = KVHandleParams.from_dict(params[HANDLE])
        assert handle.adapter == expected
        assert handle.to_proto(common_pb2.KVLayout()).adapter == expected


def _planned_load(side: SchedulerSide, req_id: str) -> FakeRequest:
    req = FakeRequest(req_id, num_prompt_tokens=9, kv_transfer_params=decode_params(make_handle((10, 11), 8)))
    side.get_num_new_matched_tokens(req, num_computed_tokens=0)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, FakeBlocks(([FakeBlock(1), FakeBlock(2)],)), 8)  # type: ignore[arg-type]
    return req


def test_a_decode_leaves_with_what_its_load_did() -> None:
    """The worker side's record of a pull reaches the scheduler side (vLLM's connector worker
    metadata) and leaves in the finished request's kv_transfer_params, once."""
    side = SchedulerSide(engine_id="d", kv_address="x:1", block_size_tokens=BLOCK, lease_s=60)
    req = _planned_load(side, "r-abcdefgh")
    record = LoadRecord(num_kv_tokens_loaded=8, num_blocks_loaded=2, num_bytes=4096, seconds=0.1)
    side.update_connector_output(GrpcKVWorkerMeta({"r-abcdefgh": record, "unknown": record}))
    side.update_connector_output(None)  # a step with nothing to report
    delay, params = side.request_finished(req, [1, 2])  # type: ignore[arg-type]
    assert delay is False and load_record_of(params) == record
    assert side.request_finished(req, [1, 2]) == (False, None)  # type: ignore[arg-type]
    assert side._load_records == {} and side._loading == set()  # nothing kept for "unknown" either


def test_a_load_that_ends_after_its_request_was_aborted_is_not_kept() -> None:
    side = SchedulerSide(engine_id="d", kv_address="x:1", block_size_tokens=BLOCK, lease_s=60)
    req = _planned_load(side, "r-abcdefgh")
    assert side.request_finished(req, []) == (False, None)  # type: ignore[arg-type]
    late = LoadRecord(num_kv_tokens_loaded=8, num_blocks_loaded=2, num_bytes=4096, seconds=3.0)
    side.update_connector_output(GrpcKVWorkerMeta({"r-abcdefgh": late}))
    assert side._load_records == {}


def test_tensor_parallel_ranks_records_of_one_load_add_up() -> None:
    a = LoadRecord(
        num_kv_tokens_loaded=8,
        num_blocks_loaded=2,
        num_bytes=100,
        seconds=0.2,
        reported_after_s=0.03,
        prefetch_wait_s=0.1,
    )
    b = LoadRecord(num_kv_tokens_loaded=8, num_blocks_loaded=2, num_bytes=100, seconds=0.5, failed=True, error="x")
    merged = GrpcKVWorkerMeta({"r": a}).aggregate(GrpcKVWorkerMeta({"r": b, "s": a}))
    assert merged.loads["r"] == LoadRecord(
        8, 2, 200, 0.5, failed=True, error="x", reported_after_s=0.03, prefetch_wait_s=0.1
    )
    assert merged.loads["s"] == a
    assert LoadRecord.from_dict(a.to_dict()) == a


def test_decode_aborted_before_its_load_was_planned_releases_the_prefill_blocks() -> None:
    side = SchedulerSide(engine_id="d", kv_address="x:1", block_size_tokens=BLOCK, lease_s=60)
    handle = make_handle((1,), num_tokens=3)
    req = FakeRequest("r", 4, decode_params(handle))
    assert side.request_finished(req, []) == (False, None)  # type: ignore[arg-type]
    assert side.build_connector_meta().releases == [handle]


# -- worker side over real gRPC ----------------------------------------------------


def test_blocks_move_between_engines_and_are_released() -> None:
    prefill, p_caches = make_side(free_port())
    decode, d_caches = make_side(free_port(), fill=0.0)
    try:
        handle = make_handle((2, 5, 9), num_tokens=11, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec(DECODE_ENGINE_ID, handle, (5, 9), (0, 3), 7, 0)]))
        wait_until(lambda: DECODE_ENGINE_ID in decode.puller._ended)
        for name in p_caches:
            assert torch.equal(d_caches[name][0], p_caches[name][5])
            assert torch.equal(d_caches[name][3], p_caches[name][9])
            assert torch.count_nonzero(d_caches[name][1]) == 0  # untouched
        # Its record waits for the step that reports the load, which says how late that step came.
        assert decode.take_load_records() == {}
        time.sleep(0.05)
        _, recving, failed = decode.get_transfer_results(set())
        assert recving == {DECODE_ENGINE_ID} and failed == set()
        record = decode.take_load_records()[DECODE_ENGINE_ID]
        assert record.num_kv_tokens_loaded == 7 and record.num_bytes == 2 * LAYERS * 2 * BLOCK * 8 * 4
        assert 0.05 <= record.reported_after_s < 5.0
        assert not record.failed and decode.take_load_records() == {}  # each record is handed out once
        # The decode side released the blocks; vLLM hears of it once the request is finished.
        wait_until(lambda: prefill.stats().num_held_requests == 0)
        assert prefill.get_transfer_results(set())[0] == set()
        assert prefill.get_transfer_results({PREFILL_ENGINE_ID})[0] == {PREFILL_ENGINE_ID}
        assert prefill.stats().bytes_sent_total == decode.stats().bytes_received_total > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_mismatched_layout_is_refused_and_reported_as_failed_load() -> None:
    prefill, _ = make_side(free_port(), model="model-a")
    decode, _ = make_side(free_port(), model="model-b")
    try:
        handle = make_handle((1,), num_tokens=3, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec(DECODE_ENGINE_ID, handle, (1,), (4,), 3, 0)]))
        wait_until(lambda: DECODE_ENGINE_ID in decode.puller._ended)
        assert decode.take_failed_block_ids() == {4}
        _, recving, failed = decode.get_transfer_results(set())
        assert recving == failed == {DECODE_ENGINE_ID}  # a failed load is also done receiving
        record = decode.take_load_records()[DECODE_ENGINE_ID]
        assert record.failed and "model" in record.error
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize(
    ("held", "pulled"), [("tandem-test-a@3", "tandem-test-b@4"), ("tandem-test-a@3", ""), ("", "tandem-test-a@3")]
)
def test_kv_computed_with_another_adapter_is_refused_and_reported_as_failed_load(held: str, pulled: str) -> None:
    """The prefill engine's KV server knows which adapter computed a hold (from the engine's own request):
    a pull for another adapter gets nothing, and the decode engine's load fails (its policy recomputes)."""
    import dataclasses

    prefill, _ = make_side(free_port())
    decode, _ = make_side(free_port(), fill=0.0)
    try:
        handle = make_handle((1,), num_tokens=3, kv_address=prefill.server.address)
        (engine_id, spec), *_ = holds_of(handle).items()
        prefill.begin_step(GrpcKVMetadata(holds={engine_id: dataclasses.replace(spec, adapter=held)}))
        pulling = dataclasses.replace(handle, adapter=pulled)
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec(DECODE_ENGINE_ID, pulling, (1,), (4,), 3, 0)]))
        wait_until(lambda: DECODE_ENGINE_ID in decode.puller._ended)
        assert decode.take_failed_block_ids() == {4}
        decode.get_transfer_results(set())
        record = decode.take_load_records()[DECODE_ENGINE_ID]
        assert record.failed and "adapter" in record.error
        assert prefill.stats().bytes_sent_total == 0
        # The failed load released the hold (nothing leaks); prefilled again, the same adapter's pull gets it.
        wait_until(lambda: prefill.stats().num_held_requests == 0)
        prefill.begin_step(GrpcKVMetadata(holds={"prefill-req-2": dataclasses.replace(spec, adapter=held)}))
        matching = dataclasses.replace(handle, adapter=held)
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec("decode-req-2", matching, (1,), (5,), 3, 0)]))
        wait_until(lambda: "decode-req-2" in decode.puller._ended)
        assert decode.take_failed_block_ids() == set()
        assert prefill.stats().bytes_sent_total > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize(
    ("held", "pulled", "refused"), [("dir-a", "v2", True), ("dir-a", "", False), ("", "v2", False)]
)
def test_kv_of_another_weights_revision_is_refused_by_the_kv_server(held: str, pulled: str, refused: bool) -> None:
    """The KV server's own check, whatever the router paired: a decode engine of another revision of the
    weights (same shapes: a byte-exact copy would be silently wrong) gets nothing and its load fails; a
    side that names no revision (a worker older than the field) is not compared."""
    prefill, _ = make_side(free_port(), model_revision=held)
    decode, _ = make_side(free_port(), fill=0.0, model_revision=pulled)
    try:
        handle = make_handle((1,), num_tokens=3, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec(DECODE_ENGINE_ID, handle, (1,), (4,), 3, 0)]))
        wait_until(lambda: DECODE_ENGINE_ID in decode.puller._ended)
        decode.get_transfer_results(set())
        record = decode.take_load_records()[DECODE_ENGINE_ID]
        assert record.failed == refused
        if refused:
            assert decode.take_failed_block_ids() == {4} and "model_revision: 'dir-a' != 'v2'" in record.error
            assert prefill.stats().bytes_sent_total == 0
        else:
            assert prefill.stats().bytes_sent_total > 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_layout_check_names_every_difference() -> None:
    a = KVLayout("m", "float32", 128, 30, (3, 128, 128))
    b = KVLayout("m", "bfloat16", 16, 30, (3, 16, 128))
    with pytest.raises(KVLayoutMismatchError, match=r"dtype.*block_size_tokens.*block_shape"):
        a.check_compatible(b)
    a.check_compatible(KVLayout.from_proto(a.to_proto()))


def test_lease_expiry_frees_blocks_nobody_pulled() -> None:
    prefill, _ = make_side(free_port())
    try:
        prefill.begin_step(GrpcKVMetadata(holds={"x-12345678": HoldSpec("x", (1, 2), time.time() - 1, CAPABILITY)}))
        assert prefill.get_transfer_results({"x-12345678"})[0] == {"x-12345678"}
        assert prefill.stats().leases_expired_total == 1
    finally:
        prefill.shutdown()


def test_held_blocks_are_released_by_the_request_id_and_vllm_is_told_its_own() -> None:
    """One id names a hold outside the prefill engine, the gateway's request id (a decode engine's Release,
    the worker service's abort); vLLM's own id names it nowhere but towards vLLM, which is told by it that
    the blocks may be freed. No id is parsed out of another: vLLM's id releases nothing."""
    prefill, _ = make_side(free_port())
    try:
        expiry = time.time() + 60
        prefill.begin_step(
            GrpcKVMetadata(
                holds={
                    "req-a-abcdefgh": HoldSpec("req-a", (1,), expiry, CAPABILITY),
                    "req-b-12345678": HoldSpec("req-b", (2,), expiry, CAPABILITY),
                }
            )
        )
        assert not prefill.server.release_hold("req-b-12345678")  # vLLM's id, not a name callers use
        assert prefill.abort("req-a")  # the worker service's Abort
        assert prefill.server.release_hold("req-b", capability=CAPABILITY)  # a decode engine's Release
        assert not prefill.abort("req-a") and not prefill.abort("no-such-request")
        assert prefill.stats().num_held_requests == 0
        assert prefill.get_transfer_results({"req-a-abcdefgh", "req-b-12345678"})[0] == {
            "req-a-abcdefgh",
            "req-b-12345678",
        }
    finally:
        prefill.shutdown()


def test_a_request_id_prefilled_twice_names_the_later_hold_and_the_earlier_is_freed_by_its_lease() -> None:
    """Two prefills of one request id on one engine (a caller's retry) are two vLLM requests: callers
    reach the later one, and the earlier one still frees its blocks when its lease ends (nothing leaks)."""
    prefill, _ = make_side(free_port())
    try:
        prefill.begin_step(
            GrpcKVMetadata(holds={"req-a-abcdefgh": HoldSpec("req-a", (1,), time.time() + 0.2, CAPABILITY)})
        )
        prefill.begin_step(
            GrpcKVMetadata(holds={"req-a-12345678": HoldSpec("req-a", (2,), time.time() + 60, CAPABILITY)})
        )
        hold = prefill.server.wait_for_hold("req-a")
        assert hold is not None and hold.block_ids == (2,)
        time.sleep(0.25)
        assert prefill.get_transfer_results({"req-a-abcdefgh"})[0] == {"req-a-abcdefgh"}  # the earlier's lease
        assert prefill.abort("req-a")
        assert prefill.get_transfer_results({"req-a-12345678"})[0] == {"req-a-12345678"}
        assert prefill.stats().num_held_requests == 0
    finally:
        prefill.shutdown()


def test_the_handle_survives_every_form_it_takes() -> None:
    handle = make_handle((3, 1, 4), num_tokens=9, kv_address="10.0.0.1:7000")
    layout = KVLayout("m", "float32", BLOCK, LAYERS, (2, BLOCK, 8)).to_proto()
    as_proto = handle.to_proto(layout)
    assert as_proto.layout == layout
    # The gateway's handle carries no capability (the gateway minted it) and names no request (the KV is the
    # Decode's own request's): the decode worker adds both from the DecodeRequest.
    assert (
        KVHandleParams.from_proto(as_proto, REQUEST, CAPABILITY) == handle == KVHandleParams.from_dict(handle.to_dict())
    )
    assert REQUEST not in as_proto.SerializeToString().decode("latin-1")
    assert KVHandleParams.from_dict(decode_params(handle)[HANDLE]) == handle


def test_an_idle_step_waits_for_a_load_in_flight_and_a_busy_step_does_not() -> None:
    prefill, _ = make_side(free_port())
    decode, _ = make_side(free_port(), fill=0.0)
    try:
        handle = make_handle((2, 5), num_tokens=7, kv_address=prefill.server.address)
        # The prefill side announces its hold late: the load stays in flight meanwhile.
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec(DECODE_ENGINE_ID, handle, (2, 5), (0, 3), 7, 0)]))
        started = time.perf_counter()
        decode.begin_step(GrpcKVMetadata(idle_step=False))
        assert decode.get_transfer_results(set())[1] == set()
        busy_s = time.perf_counter() - started
        started = time.perf_counter()
        decode.begin_step(GrpcKVMetadata(idle_step=True))
        assert decode.get_transfer_results(set())[1] == set()
        idle_s = time.perf_counter() - started
        assert busy_s < IDLE_STEP_WAIT_S <= idle_s < 10 * IDLE_STEP_WAIT_S
        # Once the load can finish, an idle step returns as soon as it has (not after its wait).
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        deadline = time.monotonic() + 5
        recving: set[str] = set()
        while not recving and time.monotonic() < deadline:
            decode.begin_step(GrpcKVMetadata(idle_step=True))
            recving = decode.get_transfer_results(set())[1]
        assert recving == {DECODE_ENGINE_ID}
        wait_until(lambda: decode.puller._num_in_flight == 0)
    finally:
        prefill.shutdown()
        decode.shutdown()
