"""The prefetch through shared memory (issue 44): a decode engine whose prefill peer shares its host and
directory streams a running prefill's KV through a segment (StreamBlocksShm over real gRPC between two KV
servers), keeps the segment as its staging, and copies from it into the paged cache at the load. The bytes
are identical, every failure falls back to the gRPC stream (counted by reason), and the segment goes back to
the prefill side's pool on every path: the load, an abort (streaming or staged), a drop, a decode that
loads nothing, the keep time, and the prefill's lease when the decode never gives it back."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.worker.kv_connector import shm
from tandem.worker.kv_connector.metadata import GrpcKVMetadata
from tests.kit.net import free_port

from .test_kv_connector import DECODE_ENGINE_ID, REQUEST, wait_until
from .test_kv_prefetch import (
    BLOCK,
    NUM_PROMPT_TOKENS,
    PREFETCH_MAX_BYTES,
    PREFILL_BLOCKS,
    Pair,
    _block_bytes,
)
from .test_kv_wire import LAYOUTS, _caches, _side


def _shm_pair(
    directory: Path,
    layout: str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    prefill_lease_s: float = 60.0,
    decode_dir: Path | None = None,
    shm_max_segments: int = 4,
) -> Pair:
    """A prefill and a decode side of one host sharing ``directory`` (the decode's own ``decode_dir``
    where given: then they share none)."""
    shape, block_dim = LAYOUTS[layout]
    chunk = 2 * _block_bytes(shape, block_dim, dtype)
    prefill = _side(
        free_port(), chunk, shm_dir=str(directory), lease_s=prefill_lease_s, shm_max_segments=shm_max_segments
    )
    decode = _side(
        free_port(), chunk, shm_dir=str(decode_dir or directory), prefetch_max_bytes=PREFETCH_MAX_BYTES, lease_s=60.0
    )
    computed = _caches(shape, dtype, seed=11)
    p_caches = {name: torch.full_like(t.view(torch.uint8), 0xFF).view(dtype) for name, t in computed.items()}
    d_caches = _caches(shape, dtype, seed=None)
    prefill.register_kv_caches(p_caches)
    decode.register_kv_caches(d_caches)
    return Pair(prefill, decode, p_caches, d_caches, block_dim, computed)


def _in_use(pair: Pair) -> int:
    assert pair.prefill.shm is not None
    return pair.prefill.shm.pool.in_use()


def _staged_through_shm(pair: Pair) -> object:
    """Prefetch the whole prompt, prefilled in two chunks, and wait until it is staged in the peer's segment."""
    assert pair.decode.prefetch(pair.order()) == ""
    prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
    pair.step(num_computed=0, num_after=12)
    pair.step(num_computed=12, num_after=NUM_PROMPT_TOKENS)
    wait_until(prefetch.done.is_set, timeout_s=10)
    assert prefetch.error == "" and prefetch.shm is not None, prefetch.error
    assert _in_use(pair) == 1 and pair.decode.stats().shm_prefetches_total == 1
    return prefetch


def _assert_returned(pair: Pair) -> None:
    """The segment is back in the prefill side's pool, and nothing is staged on the decode side."""
    wait_until(lambda: _in_use(pair) == 0, timeout_s=5)
    stats = pair.decode.stats()
    assert stats.staged_bytes == 0 and stats.num_staged_prefetches == 0


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [("cpu", torch.float32), ("cpu", torch.bfloat16), ("flashinfer", torch.float16), ("odd_head", torch.float8_e4m3fn)],
)
def test_a_prefetch_from_a_peer_of_the_same_host_is_staged_in_its_segment_and_lands_byte_for_byte(
    tmp_path: Path, layout: str, dtype: torch.dtype
) -> None:
    pair = _shm_pair(tmp_path, layout, dtype)
    try:
        for cache in pair.computed.values():  # NaN payloads and infinities travel as bits, not values
            cache.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)
        prefetch = _staged_through_shm(pair)
        # The staging is the segment: its tensors are views of the decode side's mapping of it.
        staged = prefetch.shm  # type: ignore[attr-defined]
        mapped = np.frombuffer(staged.view, dtype=np.uint8).ctypes.data
        assert [t.data_ptr() - mapped for t in staged.layers[:2]] == [0, staged.num_bytes // len(pair.p_caches)]
        pair.announce()
        local = (11, 10, 0, 1, 2)
        pair.load(local, first_block_index=0)
        pair.decode.get_transfer_results(set())
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert not record.failed and record.prefetched, record.error
        pair.assert_landed(local, first_block_index=0)
        stats = pair.decode.stats()
        assert (stats.prefetches_used_total, stats.prefetches_wasted_total) == (1, 0)
        assert dict(stats.shm_fallbacks_total) == {} and stats.shm_loads_total == 0
        served = pair.prefill.stats()
        assert served.bytes_sent_total == 5 * _block_bytes(*LAYOUTS[layout], dtype) * len(pair.p_caches)
        assert pair.prefill.server.counters.streams_served == 1
        _assert_returned(pair)  # the load gave the segment back
        wait_until(lambda: pair.prefill.stats().num_held_requests == 0)  # and released the hold
    finally:
        pair.close()


def test_a_segment_is_read_only_once_every_piece_is_said_and_a_chunked_prefill_streams_step_by_step(
    tmp_path: Path,
) -> None:
    """The first prefill step's blocks are written into the segment while the prefill goes on; the prefetch
    is staged only once the last step's are said written."""
    pair = _shm_pair(tmp_path)
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        pair.step(num_computed=0, num_after=12)
        wait_until(lambda: pair.prefill.server.counters.streams_served == 0 and _in_use(pair) == 1, timeout_s=10)
        time.sleep(0.2)
        assert not prefetch.done.is_set() and prefetch.shm is None
        pair.step(num_computed=12, num_after=NUM_PROMPT_TOKENS)
        wait_until(prefetch.done.is_set, timeout_s=10)
        assert prefetch.shm is not None and prefetch.error == ""
    finally:
        pair.close()
    _assert_no_segment_owned(pair)


def _assert_no_segment_owned(pair: Pair) -> None:
    assert pair.prefill.shm is not None and pair.prefill.shm.pool.in_use() == 0


def test_an_abort_of_a_staged_prefetch_gives_its_segment_back(tmp_path: Path) -> None:
    pair = _shm_pair(tmp_path)
    try:
        _staged_through_shm(pair)
        assert pair.decode.abort(REQUEST)  # the worker service's Abort
        _assert_returned(pair)
        assert pair.prefill.stats().num_held_requests == 0  # not announced: only the segment was the decode's
    finally:
        pair.close()


def test_an_abort_while_the_prefill_still_runs_gives_the_segment_back(tmp_path: Path) -> None:
    pair = _shm_pair(tmp_path)
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        pair.step(num_computed=0, num_after=4)  # one block computed: the stream waits for more
        wait_until(lambda: _in_use(pair) == 1, timeout_s=10)
        assert pair.decode.abort(REQUEST)
        wait_until(prefetch.done.is_set, timeout_s=5)
        assert prefetch.error and prefetch.shm is None
        _assert_returned(pair)
    finally:
        pair.close()


def test_a_dropped_prefetch_gives_its_segment_back(tmp_path: Path) -> None:
    pair = _shm_pair(tmp_path)
    try:
        _staged_through_shm(pair)
        assert pair.decode.puller.drop_prefetch(REQUEST)
        _assert_returned(pair)
        assert pair.decode.stats().prefetches_wasted_total == 1
    finally:
        pair.close()


def test_a_decode_that_loads_nothing_gives_the_segment_back(tmp_path: Path) -> None:
    pair = _shm_pair(tmp_path)
    try:
        _staged_through_shm(pair)
        pair.announce()
        pair.decode.begin_step(GrpcKVMetadata(releases=[pair.handle()]))  # its prompt was cached here after all
        _assert_returned(pair)
        wait_until(lambda: pair.prefill.stats().num_held_requests == 0)
    finally:
        pair.close()


def test_a_prefetch_past_its_keep_time_gives_the_segment_back_on_an_idle_engine(tmp_path: Path) -> None:
    pair = _shm_pair(tmp_path)
    try:
        prefetch = _staged_through_shm(pair)
        prefetch.expires_s = time.monotonic()  # type: ignore[attr-defined]
        # No engine step runs: reading the counters (the heartbeat does) drops it.
        assert pair.decode.stats().prefetches_wasted_total == 1
        _assert_returned(pair)
    finally:
        pair.close()


def test_the_prefill_takes_its_segment_back_after_its_lease_and_the_decode_then_does_not_read_it(
    tmp_path: Path,
) -> None:
    """A decode that never gives the segment back (hung, or its cancel lost) keeps it at most the prefill's
    lease; a load after that must not copy from a segment that may hold another prompt's KV by then."""
    pair = _shm_pair(tmp_path, prefill_lease_s=1.5)
    try:
        _staged_through_shm(pair)
        wait_until(lambda: _in_use(pair) == 0, timeout_s=5)  # the lease, not the decode, returned it
        assert pair.decode.stats().staged_bytes > 0  # the decode still counts its staging: it never let go
        pair.announce()
        local = (0, 1, 2, 3, 5)
        pair.load(local, first_block_index=0)
        pair.decode.get_transfer_results(set())
        record = pair.decode.take_load_records()[DECODE_ENGINE_ID]
        assert not record.prefetched, record  # pulled instead (the hold's lease is long: the pull lands)
        assert not record.failed, record.error
        pair.assert_landed(local, first_block_index=0)
        assert pair.decode.stats().staged_bytes == 0
    finally:
        pair.close()


def test_every_segment_in_use_falls_back_to_the_grpc_stream_as_peer_refused(tmp_path: Path) -> None:
    pair = _shm_pair(tmp_path, shm_max_segments=1)
    try:
        assert pair.prefill.shm is not None
        taken = pair.prefill.shm.pool.acquire(10, "another request")  # a pull's, held until its Release
        assert taken is not None
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        wait_until(prefetch.done.is_set, timeout_s=10)
        assert prefetch.error == "" and prefetch.shm is None and prefetch.staging is not None
        stats = pair.decode.stats()
        assert dict(stats.shm_fallbacks_total) == {"peer_refused": 1} and stats.shm_prefetches_total == 0
        pair.announce()
        local = (0, 1, 2, 3, 5)
        pair.load(local, first_block_index=0)
        pair.decode.get_transfer_results(set())
        assert pair.decode.take_load_records()[DECODE_ENGINE_ID].prefetched
        pair.assert_landed(local, first_block_index=0)
        pair.prefill.shm.pool.release(taken)
    finally:
        pair.close()


def test_a_segment_the_decode_cannot_open_falls_back_as_segment_missing_and_is_given_back(tmp_path: Path) -> None:
    pair = _shm_pair(tmp_path)
    try:
        assert pair.decode.shm is not None
        (tmp_path / "elsewhere").mkdir()
        pair.decode.shm.maps._directory = tmp_path / "elsewhere"  # a volume mounted over on the decode side
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        wait_until(prefetch.done.is_set, timeout_s=10)
        assert prefetch.error == "" and prefetch.shm is None
        assert dict(pair.decode.stats().shm_fallbacks_total) == {"segment_missing": 1}
        wait_until(lambda: _in_use(pair) == 0, timeout_s=5)  # the abandoned stream's segment went back
        pair.announce()
        local = (0, 1, 2, 3, 5)
        pair.load(local, first_block_index=0)
        pair.decode.get_transfer_results(set())
        assert pair.decode.take_load_records()[DECODE_ENGINE_ID].prefetched
        pair.assert_landed(local, first_block_index=0)
    finally:
        pair.close()


def test_a_pair_without_a_shared_directory_prefetches_over_grpc_and_counts_nothing(tmp_path: Path) -> None:
    (tmp_path / "decode").mkdir()
    pair = _shm_pair(tmp_path, decode_dir=tmp_path / "decode")
    try:
        assert pair.decode.prefetch(pair.order()) == ""
        prefetch = pair.decode.puller.prefetcher.prefetches[REQUEST]
        pair.step(num_computed=0, num_after=NUM_PROMPT_TOKENS)
        wait_until(prefetch.done.is_set, timeout_s=10)
        assert prefetch.error == "" and prefetch.shm is None and prefetch.staging is not None
        stats = pair.decode.stats()
        assert dict(stats.shm_fallbacks_total) == {} and stats.shm_prefetches_total == 0 and _in_use(pair) == 0
    finally:
        pair.close()


def test_a_stream_for_another_directory_is_refused_and_the_segment_name_is_checked(tmp_path: Path) -> None:
    """The prefill side refuses a caller of another directory (FAILED_PRECONDITION) before anything; the
    decode side refuses a segment name that is not one (a path)."""
    import grpc

    from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

    pair = _shm_pair(tmp_path)
    try:
        layout = pair.decode.puller._layout
        assert layout is not None
        with grpc.insecure_channel(pair.prefill.server.address) as channel:
            call = kv_transfer_pb2_grpc.KVTransferStub(channel).StreamBlocksShm(
                kv_transfer_pb2.ShmStreamRequest(
                    stream=kv_transfer_pb2.StreamBlocksRequest(
                        request_id=REQUEST,
                        num_blocks=len(PREFILL_BLOCKS),
                        expected_layout=layout.to_proto(),
                        num_prompt_tokens=NUM_PROMPT_TOKENS,
                    ),
                    shm_dir_token="ü-\u202e-not-the-token",
                ),
                timeout=10,
            )
            with pytest.raises(grpc.RpcError) as refused:
                next(call)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert pair.decode.shm is not None
        with pytest.raises(shm.ShmError):
            pair.decode.shm.maps.view("../" + shm.SEGMENT_PREFIX + "ab" * 16, BLOCK)
    finally:
        pair.close()
