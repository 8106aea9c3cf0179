"""The prefetched handoff: a decode engine streams a prompt's KV from a prefill
engine while that engine still computes it (StreamBlockBytes over real gRPC
between two KV servers), chunk by chunk as each layer is saved, into staging;
the decode request's load then copies it into the paged cache. Bytes are
identical for every dtype and cache layout, nothing is read before its layer is
saved, and every way a prefetch can go wrong falls back to the ordinary pull
and frees what it staged."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tandem.common import kv_capability
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, HoldSpec, LoadSpec, PrefillProgress
from tandem.worker.kv_connector.params import KVHandleParams, PrefetchOrder, prefill_params
from tandem.worker.kv_connector.scheduler_side import SchedulerSide
from tandem.worker.kv_connector.worker_side import WorkerSide
from tests.kit.net import free_port

from .test_kv_connector import (
    DECODE_ENGINE_ID,
    PREFILL_ENGINE_ID,
    REQUEST,
    FakeBlock,
    FakeBlocks,
    FakeRequest,
    wait_until,
)
from .test_kv_wire import DTYPES, LAYOUTS, _caches, _same_bytes, _side

BLOCK = 4
#: The prompt's capability (tandem.common.kv_capability), as the gateway mints it.
CAPABILITY = kv_capability.mint()
#: Prompt blocks 0..4 on the prefill side (block 0 in its prefix cache), 18 tokens: the last block is partial.
PREFILL_BLOCKS = (4, 1, 2, 3, 7)
NUM_PROMPT_TOKENS = 18


#: Staging of a decode side here, unless a test says otherwise.
PREFETCH_MAX_BYTES = 1 << 20


def _block_bytes(shape: tuple[int, ...], block_dim: int, dtype: torch.dtype) -> int:
    size = dtype.itemsize
    for i, d in enumerate(shape):
        size *= 1 if i == block_dim else d
    return size


@dataclass
class Pair:
    prefill: WorkerSide
    decode: WorkerSide
    p_caches: dict[str, torch.Tensor]
    d_caches: dict[str, torch.Tensor]
    block_dim: int
    #: What the prefill engine's forward will write into each layer (the caches hold garbage until then).
    computed: dict[str, torch.Tensor] = field(default_factory=dict)

    def handle(self, adapter: str = "") -> KVHandleParams:
        return KVHandleParams(
            engine_id="p",
            kv_address=self.prefill.server.address,
            request_id=REQUEST,
            block_ids=PREFILL_BLOCKS,
            num_tokens=NUM_PROMPT_TOKENS,
            lease_expires_unix_s=time.time() + 60,
            capability=CAPABILITY,
            adapter=adapter,
        )

    def order(
        self,
        num_decode_cached_tokens: int = 0,
        *,
        request_id: str = REQUEST,
        kv_address: str = "",
        num_prompt_tokens: int = NUM_PROMPT_TOKENS,
        capability: str = CAPABILITY,
        adapter: str = "",
    ) -> PrefetchOrder:
        """A PrefetchKV's order for this pair's prompt, from its prefill side's KV server unless ``kv_address``
        names another."""
        return PrefetchOrder(
            request_id=request_id,
            kv_address=kv_address or self.prefill.server.address,
            num_prompt_tokens=num_prompt_tokens,
            num_decode_cached_tokens=num_decode_cached_tokens,
            capability=capability,
            adapter=adapter,
        )

    def step(self, num_computed: int, num_after: int, adapter: str = "") -> None:
        """The prefill engine's step (with LoRA ``adapter``): its metadata, then each layer written and saved
        in turn."""
        self.prefill.begin_step(
            GrpcKVMetadata(
                progress=[
                    PrefillProgress(
                        PREFILL_ENGINE_ID,
                        REQUEST,
                        NUM_PROMPT_TOKENS,
                        PREFILL_BLOCKS,
                        num_computed,
                        num_after,
                        CAPABILITY,
                        adapter,
                    )
                ]
            )
        )
        for name in self.p_caches:
            self.p_caches[name].copy_(self.computed[name])
            self.prefill.layer_saved(name)

    def announce(self, adapter: str = "") -> None:
        """The prefill request finished: the scheduler announces its hold."""
        hold = HoldSpec(REQUEST, PREFILL_BLOCKS, time.time() + 60, CAPABILITY, adapter)
        self.prefill.begin_step(GrpcKVMetadata(holds={PREFILL_ENGINE_ID: hold}))

    def load(self, local: tuple[int, ...], first_block_index: int, adapter: str = "") -> None:
        self.start_load(local, first_block_index, adapter)
        wait_until(lambda: DECODE_ENGINE_ID in self.decode.puller._ended, timeout_s=10)

    def start_load(self, local: tuple[int, ...], first_block_index: int, adapter: str = "") -> None:
        remote = PREFILL_BLOCKS[first_block_index : first_block_index + len(local)]
        spec = LoadSpec(DECODE_ENGINE_ID, self.handle(adapter), remote, local, NUM_PROMPT_TOKENS, first_block_index)
        self.decode.begin_step(GrpcKVMetadata(loads=[spec]))

    def assert_landed(self, local: tuple[int, ...], first_block_index: int) -> None:
        remote = PREFILL_BLOCKS[first_block_index:]
        for name, sent_cache in self.computed.items():
            for theirs, ours in zip(remote, local, strict=True):
                got = self.d_caches[name].select(self.block_dim, ours)
                assert _same_bytes(got, sent_cache.select(self.block_dim, theirs)), (name, theirs)

    def close(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


def _pair(layout: str = "cpu", dtype: torch.dtype = torch.float32, **decode_options: int) -> Pair:
    shape, block_dim = LAYOUTS[layout]
    block_bytes = _block_bytes(shape, block_dim, dtype)
    # Two blocks per chunk: a layer's pieces span chunks, and chunks span layers.
    prefill = _side(free_port(), 2 * block_bytes)
    decode = _side(free_port(), 2 * block_bytes, **{"prefetch_max_bytes": PREFETCH_MAX_BYTES, **decode_options})
    computed = _caches(shape, dtype, seed=11)
    p_caches = {name: torch.full_like(t.view(torch.uint8), 0xFF).view(dtype) for name, t in computed.items()}
    d_caches = _caches(shape, dtype, seed=None)
    prefill.register_kv_caches(p_caches)
    decode.register_kv_caches(d_caches)
    return Pair(prefill, decode, p_caches, d_caches, block_dim, computed)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_prefetched_blocks_are_byte_identical_and_none_is_read_before_its_layer_is_saved(
    layout: str, dtype: torch.dtype
) -> None:
    pair = _pair(layout, dtype)
    try:
        # The decode worker asks before the prefill engine has even scheduled the prompt; it expects
        # one block (4 tokens) in its own prefix cache, so prefetches blocks 1..4.
        assert pair.decode.prefetch(pair.order(5)) == ""
        time.sleep(0.2)
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        assert (prefetch.first_block_index, prefetch.num_blocks) == (1, 4) and not prefetch.done.is_set()
        pair.step(num_computed=BLOCK, num_after=NUM_PROMPT_TOKENS)  # block 0 was cached on the prefill side
        wait_until(prefetch.done.is_set, timeout_s=10)
        assert prefetch.error == ""
        # The prefill finishes, the decode request arrives and loads blocks 1..4 into its own blocks.
        pair.announce()
        local = (11, 10, 0, 1)
        pair.load(local, first_block_index=1)
        pair.decode.get_transfer_results(set())  # the engine step that reports the load
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert not record.failed and record.prefetched, record.error
        pair.assert_landed(local, first_block_index=1)
        stats = pair.decode.stats()
        assert stats.prefetches_used_total == 1 and stats.prefetches_wasted_total == 0
        assert stats.num_staged_prefetches == 0 and stats.staged_bytes == 0
        # Nothing was pulled after the prefill: the bytes came over the stream alone.
        served = pair.prefill.stats()
        block_bytes = _block_bytes(*LAYOUTS[layout], dtype)
        assert served.bytes_sent_total == 4 * block_bytes * len(pair.p_caches) == stats.bytes_received_total
        assert pair.prefill.server.counters.streams_served == 1
        wait_until(lambda: pair.prefill.stats().num_held_requests == 0)  # released after the load
    finally:
        pair.close()


def test_a_stream_follows_a_chunked_prefill_step_by_step() -> None:
    pair = _pair()
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        # First step: blocks 0..2 of every layer are computed, and reach staging while the prefill
        # goes on; blocks 3..4 are not there yet.
        pair.step(num_computed=0, num_after=12)
        staging = prefetch.staging
        assert staging is not None
        last = list(pair.computed)[-1]

        def staged(position: int) -> bool:
            got = staging[-1].select(pair.block_dim, position)
            return _same_bytes(got, pair.computed[last].select(pair.block_dim, PREFILL_BLOCKS[position]))

        wait_until(lambda: all(staged(b) for b in range(3)), timeout_s=10)
        assert not prefetch.done.is_set() and not staged(3)
        pair.step(num_computed=12, num_after=NUM_PROMPT_TOKENS)
        wait_until(prefetch.done.is_set, timeout_s=10)
        assert prefetch.error == ""
        pair.announce()
        local = (0, 1, 2, 3, 5)
        pair.load(local, first_block_index=0)
        pair.decode.get_transfer_results(set())  # the engine step that reports the load
        assert pair.decode.take_load_records()[DECODE_ENGINE_ID].prefetched
        pair.assert_landed(local, first_block_index=0)
    finally:
        pair.close()


def test_a_load_that_comes_before_the_streams_tail_waits_for_it_and_says_how_long() -> None:
    """The decode request's load arrives while the prefill's last step still runs: it waits for the
    stream to end, then copies from staging; its record splits the two (``prefetch_wait_s``, which
    the Decode's stats and the gateway's timings carry to ``make bench-kv``)."""
    pair = _pair()
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        pair.step(num_computed=0, num_after=12)
        local = (0, 1, 2, 3, 5)
        pair.start_load(local, first_block_index=0)
        time.sleep(0.3)
        assert DECODE_ENGINE_ID not in pair.decode.puller._ended  # blocks 3..4 are not computed yet
        pair.step(num_computed=12, num_after=NUM_PROMPT_TOKENS)
        wait_until(lambda: DECODE_ENGINE_ID in pair.decode.puller._ended, timeout_s=10)
        pair.announce()
        pair.decode.get_transfer_results(set())
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert record.prefetched and not record.failed, record.error
        assert 0.25 <= record.prefetch_wait_s <= record.seconds, record
        pair.assert_landed(local, first_block_index=0)
    finally:
        pair.close()


def test_a_prefill_that_ends_without_a_hold_ends_the_stream_and_frees_the_staging() -> None:
    pair = _pair()
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        pair.prefill.begin_step(
            GrpcKVMetadata(
                progress=[
                    PrefillProgress(PREFILL_ENGINE_ID, REQUEST, NUM_PROMPT_TOKENS, PREFILL_BLOCKS, 0, 8, CAPABILITY)
                ]
            )
        )
        # Stopped at its first token (or aborted): the scheduler says so before the blocks are reused.
        pair.prefill.begin_step(GrpcKVMetadata(ended={PREFILL_ENGINE_ID}))
        wait_until(prefetch.done.is_set, timeout_s=10)
        assert "ended without keeping its KV" in prefetch.error
        assert pair.decode.stats().staged_bytes == 0
        assert pair.prefill.stats().num_held_requests == 0 and pair.prefill.server.num_prefilling() == 0
    finally:
        pair.close()


def test_a_load_the_prefetch_does_not_cover_pulls_instead() -> None:
    """The router expected two cached blocks on the decode worker, which had only one when the load
    came (evicted meanwhile): the prefetch lacks block 1, the load pulls, the staging is freed."""
    pair = _pair()
    try:
        assert pair.decode.prefetch(pair.order(8)) == ""
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        wait_until(pair.decode.puller.prefetcher.prefetches[REQUEST].done.is_set, timeout_s=10)
        pair.announce()
        local = (6, 7, 8, 9)
        pair.load(local, first_block_index=1)
        pair.decode.get_transfer_results(set())  # the engine step that reports the load
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert not record.failed and not record.prefetched
        pair.assert_landed(local, first_block_index=1)
        stats = pair.decode.stats()
        assert stats.prefetches_used_total == 0 and stats.prefetches_wasted_total == 1 and stats.staged_bytes == 0
        # A PrefetchKV that comes after its request's load is refused: nobody would use it.
        assert "loaded already" in pair.decode.prefetch(pair.order())
    finally:
        pair.close()


def test_staging_is_bounded_and_an_abort_frees_it() -> None:
    shape, block_dim = LAYOUTS["cpu"]
    per_prompt = 5 * _block_bytes(shape, block_dim, torch.float32) * 3  # five blocks of three layers
    pair = _pair(prefetch_max_bytes=per_prompt)
    try:
        assert pair.decode.prefetch(pair.order(request_id="a")) == ""
        assert "staging is full" in pair.decode.prefetch(pair.order(request_id="b"))
        assert pair.decode.stats().staged_bytes == per_prompt
        assert pair.decode.abort("a")  # the worker service's Abort
        assert pair.decode.stats().staged_bytes == 0 and not pair.decode.abort("a")
        assert pair.decode.prefetch(pair.order(request_id="b")) == ""
        both_cached_here = pair.order(8, request_id="c", num_prompt_tokens=8)
        assert pair.decode.prefetch(both_cached_here) == "nothing to prefetch"
    finally:
        pair.close()


def test_a_prefetch_that_arrives_after_its_requests_abort_is_refused() -> None:
    """The gateway sends PrefetchKV in the background; a request its prefill worker refuses is aborted at
    once, and that Abort can reach the decode worker first. The late PrefetchKV must not stage KV that
    nobody will use until prefetch_keep_s (the real-stack fuzz found staging left behind so)."""
    pair = _pair()
    try:
        assert not pair.decode.abort("late")  # the Abort, with nothing here yet
        refused = pair.decode.prefetch(pair.order(request_id="late"))
        assert "aborted here" in refused
        assert pair.decode.stats().staged_bytes == 0
    finally:
        pair.close()


def test_a_decode_that_loads_nothing_frees_its_prefetch_and_refuses_a_later_one() -> None:
    """The router expected less of this engine's prefix cache than vLLM found: the decode request's whole
    prompt is cached here, so it loads nothing and only releases the hold. Its staged prefetch, or one that
    arrives after, must not wait out prefetch_keep_s (the fault suite's fuzz found 17,694,720 bytes so)."""
    pair = _pair()
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        wait_until(pair.decode.puller.prefetcher.prefetches[REQUEST].done.is_set, timeout_s=10)
        assert pair.decode.stats().staged_bytes > 0
        pair.decode.begin_step(GrpcKVMetadata(releases=[pair.handle()]))  # scheduler side: nothing to pull
        stats = pair.decode.stats()
        assert stats.staged_bytes == 0 and stats.num_staged_prefetches == 0 and stats.prefetches_wasted_total == 1
        assert "aborted here" in pair.decode.prefetch(pair.order())
        assert pair.decode.stats().staged_bytes == 0
    finally:
        pair.close()


def test_an_abort_ends_a_prefetch_stream_that_waits_for_the_prefill() -> None:
    """The stream is read on the prefetch's own thread (the puller's channels are single-threaded for
    streams); the abort cancels it from another thread, and the thread comes back at once."""
    pair = _pair()
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        pair.step(num_computed=0, num_after=4)  # one block of the prompt computed: the stream waits for more
        wait_until(lambda: prefetch.call is not None, timeout_s=10)
        time.sleep(0.2)
        assert not prefetch.done.is_set()
        aborted_s = time.perf_counter()
        assert pair.decode.abort(REQUEST)  # the worker service's Abort
        wait_until(prefetch.done.is_set, timeout_s=5)
        assert time.perf_counter() - aborted_s < 2.0
        assert prefetch.error and pair.decode.stats().staged_bytes == 0
    finally:
        pair.close()


def test_a_prefetch_nobody_uses_is_dropped_after_its_keep_time_even_on_an_idle_engine() -> None:
    pair = _pair()
    try:
        pair.decode.puller.prefetcher.keep_s = 0.2
        assert pair.decode.prefetch(pair.order()) == ""
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        wait_until(pair.decode.puller.prefetcher.prefetches[REQUEST].done.is_set, timeout_s=10)
        assert pair.decode.stats().staged_bytes > 0
        time.sleep(0.3)
        # No engine step ran since: reading the counters (the heartbeat does) drops it.
        stats = pair.decode.stats()
        assert stats.staged_bytes == 0 and stats.num_staged_prefetches == 0 and stats.prefetches_wasted_total == 1
    finally:
        pair.close()


def test_prefetching_is_off_without_staging_memory() -> None:
    pair = _pair(prefetch_max_bytes=0)
    try:
        assert "off" in pair.decode.prefetch(pair.order())
    finally:
        pair.close()


def test_a_release_before_the_hold_is_announced_frees_it_when_it_is() -> None:
    """A decode engine that loaded from its prefetch can release before the prefill engine's next
    step announces the hold: the blocks must not wait for their lease."""
    pair = _pair()
    try:
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        assert pair.prefill.server.release_hold(REQUEST, capability=CAPABILITY)  # a decode engine's Release
        pair.announce()
        assert pair.prefill.stats().num_held_requests == 0
        assert pair.prefill.get_transfer_results({PREFILL_ENGINE_ID})[0] == {PREFILL_ENGINE_ID}
    finally:
        pair.close()


# -- the scheduler side's plan of each step ----------------------------------------


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedReqs:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: CachedReqs = field(default_factory=CachedReqs)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] | None = None


def _prefill_request(engine_request_id: str, num_prompt_tokens: int) -> FakeRequest:
    """vLLM's request ``engine_request_id``: the gateway's id with vLLM's suffix (the worker service passes
    the gateway's id in kv_transfer_params)."""
    request_id = engine_request_id.rsplit("-", 1)[0]
    return FakeRequest(engine_request_id, num_prompt_tokens, prefill_params(request_id, CAPABILITY))


def test_the_scheduler_side_plans_each_streamed_prompts_progress() -> None:
    side = SchedulerSide(engine_id="p", kv_address="x:1", block_size_tokens=BLOCK, lease_s=60)
    req = _prefill_request("r-abcdefgh", 18)
    other = FakeRequest("plain", 8, None)
    side.update_state_after_alloc(req, FakeBlocks(([FakeBlock(4, b"h"), FakeBlock(1), FakeBlock(2)],)), 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(other, FakeBlocks(([FakeBlock(9)],)), 0)  # type: ignore[arg-type]
    first = SchedulerOutput(
        scheduled_new_reqs=[NewReq("r-abcdefgh", ([4, 1, 2],), 4), NewReq("plain", ([9],), 0)],
        num_scheduled_tokens={"r-abcdefgh": 8, "plain": 8},
    )
    assert side.build_connector_meta(first).progress == [  # type: ignore[arg-type]
        PrefillProgress("r-abcdefgh", "r", 18, (4, 1, 2), 4, 12, CAPABILITY)
    ]
    second = SchedulerOutput(
        scheduled_cached_reqs=CachedReqs(["r-abcdefgh"], set(), [([3, 7],)], [12]),
        num_scheduled_tokens={"r-abcdefgh": 6},
    )
    assert side.build_connector_meta(second).progress == [  # type: ignore[arg-type]
        PrefillProgress("r-abcdefgh", "r", 18, (4, 1, 2, 3, 7), 12, 18, CAPABILITY)
    ]
    # Computed: the step that samples its first token streams nothing more.
    third = SchedulerOutput(
        scheduled_cached_reqs=CachedReqs(["r-abcdefgh"], set(), [None], [18]),
        num_scheduled_tokens={"r-abcdefgh": 1},
    )
    assert side.build_connector_meta(third).progress == []  # type: ignore[arg-type]


def test_a_streamed_prompt_ends_when_it_stops_is_aborted_or_is_preempted() -> None:
    from vllm.v1.request import RequestStatus

    side = SchedulerSide(engine_id="p", kv_address="x:1", block_size_tokens=BLOCK, lease_s=60)
    stopped, preempted, held = (_prefill_request(r, 8) for r in ("s-abcdefgh", "p-abcdefgh", "h-abcdefgh"))
    for req in (stopped, preempted, held):
        side.update_state_after_alloc(req, FakeBlocks(([FakeBlock(1)],)), 0)  # type: ignore[arg-type]
    stopped.status = RequestStatus.FINISHED_STOPPED
    assert side.request_finished(stopped, [1]) == (False, None)  # type: ignore[arg-type]
    meta = side.build_connector_meta(SchedulerOutput(preempted_req_ids={"p-abcdefgh"}))  # type: ignore[arg-type]
    assert meta.ended == {"s-abcdefgh", "p-abcdefgh"}
    held.status, held.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 8
    delay_free, params = side.request_finished(held, [1, 2])  # type: ignore[arg-type]
    meta = side.build_connector_meta(SchedulerOutput())  # type: ignore[arg-type]
    assert delay_free and params and meta.ended == set() and "h-abcdefgh" in meta.holds
    assert side._streamed == {}


def test_layers_saved_in_a_forward_are_streamable_when_vllm_runs_the_steps_hooks_in_its_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's own model-runner sequence (``KVConnectorModelRunnerMixin._get_kv_connector_output``, the
    real producer of the hook order), not our assumption of it: with no synchronous load it calls
    ``start_load_kv`` only after the forward, so the step's metadata must take effect when it is bound,
    before the forward saves its layers. Before, each step's progress arrived a step late: a stream of
    a running prefill got a chunk's blocks only during the next chunk's forward, and the last chunk's
    only once the prefill had ended (the decode's load then waited 70-450 ms for the stream's tail)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.worker import kv_connector_model_runner_mixin
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    from tandem.worker.kv_connector.connector import GrpcKVConnector

    pair = _pair()
    connector = GrpcKVConnector.__new__(GrpcKVConnector)  # the worker role over this pair's prefill side
    connector._connector_metadata = None
    connector._scheduler, connector._worker = None, pair.prefill
    saved_before: list[int] = []
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        meta = GrpcKVMetadata(
            progress=[
                PrefillProgress(
                    PREFILL_ENGINE_ID, REQUEST, NUM_PROMPT_TOKENS, PREFILL_BLOCKS, 0, NUM_PROMPT_TOKENS, CAPABILITY
                )
            ]
        )
        scheduler_output = SimpleNamespace(kv_connector_metadata=meta, has_sync_kv_loads=False, finished_req_ids=set())
        kv_transfer_state._KV_CONNECTOR_AGENT = connector
        monkeypatch.setattr(kv_connector_model_runner_mixin, "get_forward_context", lambda: None)  # unused by us
        with KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output):  # type: ignore[arg-type]
            # The forward pass: each layer written, then saved.
            for name in pair.p_caches:
                pair.p_caches[name].copy_(pair.computed[name])
                connector.save_kv_layer(name, pair.p_caches[name], None)
            # The whole prompt streamed while the forward still runs (on a GPU, while it is launched).
            saved_before.append(int(prefetch.done.wait(10)))
        assert saved_before == [1] and prefetch.error == "", prefetch.error
        pair.announce()
        local = (0, 1, 2, 3, 5)
        pair.load(local, first_block_index=0)
        pair.decode.get_transfer_results(set())
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert not record.failed and record.prefetched, record.error
        pair.assert_landed(local, first_block_index=0)
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        pair.close()


def test_an_order_crosses_vllms_collective_rpc_as_a_dict_and_the_extension_starts_that_prefetch() -> None:
    """``VLLMEngine.kv_prefetch`` sends its order through ``AsyncLLM.collective_rpc``, whose engine-core client
    encodes the utility call with vLLM's msgpack encoder: a dataclass would arrive as a map too, so the
    order travels as :meth:`PrefetchOrder.to_dict` and the extension rebuilds it. Here the call is encoded
    and decoded as the engine core does, then given to the extension on this pair's decode side."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from tandem.worker.kv_connector.connector import GrpcKVConnector
    from tandem.worker.kv_connector.extension import KVWorkerExtension

    pair = _pair()
    connector = GrpcKVConnector.__new__(GrpcKVConnector)  # the worker role over this pair's decode side
    connector._scheduler, connector._worker = None, pair.decode
    order = pair.order(5, request_id="chat-é请求🙂", adapter="tandem-test-a@3")
    try:
        kv_transfer_state._KV_CONNECTOR_AGENT = connector
        call = (0, 7, "collective_rpc", ("tandem_kv_prefetch", None, (order.to_dict(),), None))
        _, _, method, (rpc, _, args, _) = MsgpackDecoder().decode(MsgpackEncoder().encode(call))
        assert (method, rpc) == ("collective_rpc", "tandem_kv_prefetch") and type(args[0]) is dict
        assert KVWorkerExtension().tandem_kv_prefetch(*args) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[order.request_id]
        assert prefetch.order == order and (prefetch.first_block_index, prefetch.num_blocks) == (1, 4)
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        pair.close()


def test_the_kv_server_serves_a_prompt_only_with_its_capability() -> None:
    """Issue 38: the request id is no secret (Redis keys, Schedule, logs), and with it anyone could read an
    in-flight prompt's KV (which reveals the prompt) or release its hold. Now a stream, a pull or a release
    without the prompt's capability is refused exactly as for an id nobody holds, and changes nothing."""
    import grpc

    from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
    from tandem.worker.kv_connector import wire

    pair = _pair()
    try:
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        pair.announce()
        wait_until(lambda: pair.prefill.stats().num_held_requests == 1)
        layout = pair.decode.puller._layout
        assert layout is not None
        with grpc.insecure_channel(pair.prefill.server.address) as channel:
            stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
            for forged in ("", kv_capability.mint(), CAPABILITY.upper()):
                pull = channel.unary_stream(
                    wire.PULL_METHOD,
                    request_serializer=kv_transfer_pb2.PullBlocksRequest.SerializeToString,
                    response_deserializer=bytes,
                )(
                    kv_transfer_pb2.PullBlocksRequest(
                        request_id=REQUEST,
                        block_ids=list(PREFILL_BLOCKS),
                        expected_layout=layout.to_proto(),
                        capability=forged,
                    ),
                    timeout=10,
                )
                with pytest.raises(grpc.RpcError) as pulled:
                    list(pull)
                assert pulled.value.code() == grpc.StatusCode.NOT_FOUND
                stream = channel.unary_stream(
                    wire.STREAM_METHOD,
                    request_serializer=kv_transfer_pb2.StreamBlocksRequest.SerializeToString,
                    response_deserializer=bytes,
                )(
                    kv_transfer_pb2.StreamBlocksRequest(
                        request_id=REQUEST,
                        first_block_index=0,
                        num_blocks=len(PREFILL_BLOCKS),
                        expected_layout=layout.to_proto(),
                        num_prompt_tokens=NUM_PROMPT_TOKENS,
                        capability=forged,
                    ),
                    timeout=10,
                )
                with pytest.raises(grpc.RpcError) as streamed:
                    list(stream)
                assert streamed.value.code() == grpc.StatusCode.NOT_FOUND
                for name in (PREFILL_ENGINE_ID, REQUEST):
                    refused = stub.Release(
                        kv_transfer_pb2.ReleaseBlocksRequest(request_id=name, capability=forged), timeout=10
                    )
                    assert not refused.found
            assert pair.prefill.stats().num_held_requests == 1 and pair.prefill.stats().bytes_sent_total == 0
            released = stub.Release(
                kv_transfer_pb2.ReleaseBlocksRequest(request_id=REQUEST, capability=CAPABILITY), timeout=10
            )
            assert released.found
    finally:
        pair.close()


@pytest.mark.parametrize("forged", ["capability", "address"])
def test_staged_kv_is_used_only_for_the_prompt_the_handle_names(forged: str) -> None:
    """A prefetch under another capability (the KV server refuses its stream) or from another address than
    the handle names (staged, then not used) is not the prompt's KV: the load pulls from the handle instead,
    and lands the right bytes."""
    pair = _pair()
    try:
        address = pair.prefill.server.address
        if forged == "address":
            address = address.replace("127.0.0.1", "localhost")  # the same server, under another name
        capability = kv_capability.mint() if forged == "capability" else CAPABILITY
        assert pair.decode.prefetch(pair.order(kv_address=address, capability=capability)) == ""
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        pair.announce()
        local = (11, 10, 0, 1, 2)
        pair.load(local, first_block_index=0)
        pair.decode.get_transfer_results(set())
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert not record.failed and not record.prefetched, record
        pair.assert_landed(local, first_block_index=0)
    finally:
        pair.close()


# -- LoRA adapters (issue 40): a prefetch is of one adapter's KV ---------------------

ADAPTER_A = "tandem-test-a@3"
ADAPTER_B = "tandem-test-b@4"


def _prefetched_whole(pair: Pair, adapter: str) -> Any:
    """A prefetch for ``adapter`` of a prompt the prefill computes whole with ``adapter``, once it ended."""
    assert pair.decode.prefetch(pair.order(adapter=adapter)) == ""
    prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
    pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS, adapter=adapter)
    wait_until(prefetch.done.is_set, timeout_s=10)
    return prefetch


def test_a_prefetch_for_the_prompts_adapter_is_streamed_and_used() -> None:
    pair = _pair()
    try:
        prefetch = _prefetched_whole(pair, ADAPTER_A)
        assert prefetch.error == ""
        pair.announce(adapter=ADAPTER_A)
        local = (0, 1, 2, 3, 5)
        pair.load(local, first_block_index=0, adapter=ADAPTER_A)
        pair.decode.get_transfer_results(set())
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert record.prefetched and not record.failed, record
        pair.assert_landed(local, first_block_index=0)
        stats = pair.decode.stats()
        assert (stats.prefetches_used_total, stats.prefetches_wasted_total) == (1, 0)
    finally:
        pair.close()


@pytest.mark.parametrize("prefetched_for", ["", ADAPTER_B], ids=["base", "other-adapter"])
def test_the_kv_server_refuses_to_stream_another_adapters_prompt_as_it_refuses_a_pull(prefetched_for: str) -> None:
    """The prompt is prefilled with adapter A; a PrefetchKV naming the base model or adapter B streams
    nothing (FAILED_PRECONDITION while the prompt is still being prefilled, the pull's answer), and the
    Decode for A pulls A's KV as without a prefetch."""
    pair = _pair()
    try:
        assert pair.decode.prefetch(pair.order(adapter=prefetched_for)) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        pair.step(num_computed=0, num_after=12, adapter=ADAPTER_A)  # still prefilling: no hold yet
        wait_until(prefetch.done.is_set, timeout_s=10)
        assert "computed with adapter 'tandem-test-a@3'" in prefetch.error, prefetch.error
        assert pair.decode.stats().staged_bytes == 0 and pair.prefill.stats().bytes_sent_total == 0
        pair.step(num_computed=12, num_after=NUM_PROMPT_TOKENS, adapter=ADAPTER_A)
        pair.announce(adapter=ADAPTER_A)
        local = (0, 1, 2, 3, 5)
        pair.load(local, first_block_index=0, adapter=ADAPTER_A)
        pair.decode.get_transfer_results(set())
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert not record.prefetched and not record.failed, record
        pair.assert_landed(local, first_block_index=0)
        assert pair.decode.stats().prefetches_wasted_total == 1
    finally:
        pair.close()


@pytest.mark.parametrize("decoded_with", ["", ADAPTER_B], ids=["base", "other-adapter"])
def test_kv_staged_for_one_adapter_is_never_used_by_a_decode_of_another(decoded_with: str) -> None:
    """A's KV, streamed and staged for A, and a load whose handle names the base model or B: the staging is
    not copied (a wasted prefetch, its bytes freed); the load pulls instead, which the KV server refuses
    for the same reason, so the load fails (the decode recomputes the prompt) rather than serve A's KV."""
    pair = _pair()
    try:
        prefetch = _prefetched_whole(pair, ADAPTER_A)
        assert prefetch.error == "" and pair.decode.stats().staged_bytes > 0
        pair.announce(adapter=ADAPTER_A)
        before = {name: cache.clone() for name, cache in pair.d_caches.items()}
        pair.load((0, 1, 2, 3, 5), first_block_index=0, adapter=decoded_with)
        pair.decode.get_transfer_results(set())
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert not record.prefetched and record.failed and "adapter" in record.error, record
        assert all(_same_bytes(pair.d_caches[name], before[name]) for name in before)  # nothing of A's landed
        stats = pair.decode.stats()
        assert (stats.prefetches_used_total, stats.prefetches_wasted_total, stats.staged_bytes) == (0, 1, 0)
    finally:
        pair.close()


def test_the_scheduler_side_tells_the_kv_server_the_adapter_of_a_prompt_it_prefills() -> None:
    """The adapter comes from the engine's own request (its LoRARequest), from the first step on: the KV
    server knows it before the hold is announced, which is when a prefetch streams."""
    from vllm.lora.request import LoRARequest

    side = SchedulerSide(engine_id="p", kv_address="x:1", block_size_tokens=BLOCK, lease_s=60)
    req = _prefill_request("r-abcdefgh", 8)
    req.lora_request = LoRARequest(ADAPTER_A, 3, "/adapters/a")
    side.update_state_after_alloc(req, FakeBlocks(([FakeBlock(1), FakeBlock(2)],)), 0)  # type: ignore[arg-type]
    step = SchedulerOutput(
        scheduled_new_reqs=[NewReq("r-abcdefgh", ([1, 2],), 0)], num_scheduled_tokens={"r-abcdefgh": 8}
    )
    assert side.build_connector_meta(step).progress == [  # type: ignore[arg-type]
        PrefillProgress("r-abcdefgh", "r", 8, (1, 2), 0, 8, CAPABILITY, ADAPTER_A)
    ]
