"""The KV pull through shared memory between two worker sides of one host: which path a pair picks,
the byte-exact copy, every fallback to gRPC and its reason, and no segment left behind by a killed
prefill or decode process (real processes, killed with SIGKILL)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.common.registry import WorkerRecord
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import shm
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, LoadSpec
from tandem.worker.kv_connector.worker_side import WorkerSide
from tests.kit.net import free_port
from tests.unit.worker.test_kv_connector import BLOCK, CAPABILITY, LAYERS, holds_of, make_handle, make_side

LEASE_S = 2.0


def _segments(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith(shm.SEGMENT_PREFIX)}


def _pull(decode: WorkerSide, prefill: WorkerSide, remote: tuple[int, ...], local: tuple[int, ...], rid: str) -> Any:
    """Hold ``remote`` on the prefill side as request ``rid`` and load them into ``local`` on the decode side."""
    handle = make_handle(remote, num_tokens=len(remote) * BLOCK, kv_address=prefill.server.address)
    handle = dataclasses.replace(handle, request_id=rid)
    prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle, engine_request_id=f"{rid}-p")))
    record = decode.load(LoadSpec(f"{rid}-d", handle, remote, local, len(remote) * BLOCK, 0))
    return handle, record


def _assert_copied(
    p_caches: dict[str, torch.Tensor],
    d_caches: dict[str, torch.Tensor],
    remote: tuple[int, ...],
    local: tuple[int, ...],
) -> None:
    for name in p_caches:
        for r, loc in zip(remote, local, strict=True):
            assert torch.equal(d_caches[name][loc].view(torch.uint8), p_caches[name][r].view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_pair_of_one_host_and_directory_pulls_through_shared_memory_byte_for_byte(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    prefill, p_caches = make_side(free_port(), dtype=dtype, shm_dir=str(tmp_path), lease_s=LEASE_S)
    decode, d_caches = make_side(free_port(), dtype=dtype, fill=0.0, shm_dir=str(tmp_path), lease_s=LEASE_S)
    try:
        # NaN payloads and infinities travel as bits, not values.
        for cache in p_caches.values():
            cache.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)
        remote, local = (2, 3, 4, 9, 0), (15, 1, 2, 7, 8)  # runs on both sides, and not the same runs
        handle, record = _pull(decode, prefill, remote, local, "rid-ü-\u202e")
        assert not record.failed, record.error
        _assert_copied(p_caches, d_caches, remote, local)
        stats = decode.stats()
        assert stats.shm_loads_total == 1 and dict(stats.shm_fallbacks_total) == {}
        assert (
            prefill.stats().bytes_sent_total
            == record.num_bytes
            == len(remote) * LAYERS * p_caches[next(iter(p_caches))][0].nbytes
        )
        assert prefill.shm is not None and prefill.shm.pool.in_use() == 1  # until its hold ends
        decode.puller.release_hold(handle)
        assert prefill.shm.pool.in_use() == 0 and prefill.stats().num_held_requests == 0
        # The next pull reuses the segment: one file, still there, mapped once on each side.
        _, record = _pull(decode, prefill, (1,), (3,), "rid-2")
        assert not record.failed and decode.stats().shm_loads_total == 2
        assert len(_segments(tmp_path)) == 1
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert _segments(tmp_path) == set()  # a worker that stops removes its segments


@pytest.mark.parametrize("prefill_dir", ["other", ""])
def test_a_pair_without_a_shared_directory_pulls_over_grpc_and_counts_no_fallback(
    tmp_path: Path, prefill_dir: str
) -> None:
    (tmp_path / "decode").mkdir()
    (tmp_path / "other").mkdir()
    prefill_shm = str(tmp_path / prefill_dir) if prefill_dir else ""
    prefill, p_caches = make_side(free_port(), shm_dir=prefill_shm, lease_s=LEASE_S)
    decode, d_caches = make_side(free_port(), fill=0.0, shm_dir=str(tmp_path / "decode"), lease_s=LEASE_S)
    try:
        _, record = _pull(decode, prefill, (3, 4), (5, 6), "rid-1")
        assert not record.failed
        _assert_copied(p_caches, d_caches, (3, 4), (5, 6))
        stats = decode.stats()
        assert stats.shm_loads_total == 0 and dict(stats.shm_fallbacks_total) == {}
        assert stats.bytes_received_total == record.num_bytes > 0
        assert _segments(tmp_path / "decode") == _segments(tmp_path / "other") == set()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_every_segment_in_use_falls_back_to_grpc_as_peer_refused(tmp_path: Path) -> None:
    prefill, p_caches = make_side(free_port(), shm_dir=str(tmp_path), lease_s=LEASE_S, shm_max_segments=1)
    decode, d_caches = make_side(free_port(), fill=0.0, shm_dir=str(tmp_path), lease_s=LEASE_S)
    try:
        _, first = _pull(decode, prefill, (1,), (1,), "holds-the-segment")  # not released: its hold keeps it
        _, record = _pull(decode, prefill, (2, 3), (4, 5), "second")
        assert not first.failed and not record.failed
        _assert_copied(p_caches, d_caches, (2, 3), (4, 5))
        stats = decode.stats()
        assert stats.shm_loads_total == 1 and dict(stats.shm_fallbacks_total) == {"peer_refused": 1}
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_more_pulls_at_once_than_segments_wait_for_a_freed_one_instead_of_falling_back(tmp_path: Path) -> None:
    """A burst of concurrent pulls larger than the pool: each pull releases its hold once loaded (as the
    puller does), which frees its segment for the next; none of them goes over gRPC, every one lands
    byte for byte."""
    prefill, p_caches = make_side(free_port(), shm_dir=str(tmp_path), lease_s=LEASE_S, shm_max_segments=1)
    decode, d_caches = make_side(free_port(), fill=0.0, shm_dir=str(tmp_path), lease_s=LEASE_S)
    pulls = {f"burst-{i}": ((2 * i, 2 * i + 1), (2 * i + 1, 2 * i)) for i in range(3)}
    try:
        handles = {}
        holds = {}
        for rid, (remote, _) in pulls.items():
            handle = make_handle(remote, num_tokens=len(remote) * BLOCK, kv_address=prefill.server.address)
            handles[rid] = dataclasses.replace(handle, request_id=rid)
            holds.update(holds_of(handles[rid], engine_request_id=f"{rid}-p"))
        prefill.begin_step(GrpcKVMetadata(holds=holds))

        def load_and_release(rid: str) -> Any:
            remote, local = pulls[rid]
            record = decode.load(LoadSpec(f"{rid}-d", handles[rid], remote, local, len(remote) * BLOCK, 0))
            decode.puller.release_hold(handles[rid])
            return record

        with ThreadPoolExecutor(max_workers=len(pulls)) as pool:
            records = list(pool.map(load_and_release, pulls))
        assert [r.error for r in records if r.failed] == []
        for remote, local in pulls.values():
            _assert_copied(p_caches, d_caches, remote, local)
        stats = decode.stats()
        assert stats.shm_loads_total == len(pulls) and dict(stats.shm_fallbacks_total) == {}
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_an_acquire_waits_for_a_segment_freed_meanwhile_and_gives_up_after_its_wait(tmp_path: Path) -> None:
    pool = shm.SegmentPool(str(tmp_path), 1, max_owned_s=60)
    first = pool.acquire(10, "first")
    assert first is not None
    assert pool.acquire(10, "second", wait_s=0.05) is None  # nobody frees it
    threading.Timer(0.05, pool.release_owner, args=("first",)).start()
    second = pool.acquire(10, "second", wait_s=30)
    assert second is not None and second.name == first.name and second.owner == "second"
    pool.close()


def test_a_missing_segment_falls_back_to_grpc_as_segment_missing(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    prefill, p_caches = make_side(free_port(), shm_dir=str(tmp_path), lease_s=LEASE_S)
    decode, d_caches = make_side(free_port(), fill=0.0, shm_dir=str(tmp_path), lease_s=LEASE_S)
    try:
        # The decode side opens segments where the prefill side does not write them (a volume mounted over).
        assert decode.shm is not None
        decode.shm.maps._directory = tmp_path / "elsewhere"
        _, record = _pull(decode, prefill, (2, 3), (4, 5), "rid")
        assert not record.failed
        _assert_copied(p_caches, d_caches, (2, 3), (4, 5))
        assert dict(decode.stats().shm_fallbacks_total) == {"segment_missing": 1}
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_segment_maps_refuse_a_short_file_a_foreign_name_a_missing_file_and_a_link(tmp_path: Path) -> None:
    maps = shm.SegmentMaps(str(tmp_path))
    name = shm.SEGMENT_PREFIX + "ab" * 16
    (tmp_path / name).write_bytes(b"x" * 100)
    with pytest.raises(shm.ShmError) as short:
        maps.view(name, 101)
    assert short.value.reason == "wrong_size"
    view = maps.view(name, 100)
    assert bytes(view[:3]) == b"xxx"
    view.release()
    for hostile in ("../etc/passwd", "tandem-kv-seg-../../x", name + "\n", "tandem-kv-seg-" + "é" * 32):
        with pytest.raises(shm.ShmError) as foreign:
            maps.view(hostile, 1)
        assert foreign.value.reason == "peer_refused"
    with pytest.raises(shm.ShmError) as missing:
        maps.view(shm.SEGMENT_PREFIX + "cd" * 16, 1)
    assert missing.value.reason == "segment_missing"
    # A well-named link to another file (anyone with the directory could plant one), or a folder: refused.
    secret = tmp_path / "not-a-segment"
    secret.write_bytes(b"s" * 100)
    (tmp_path / (shm.SEGMENT_PREFIX + "ef" * 16)).symlink_to(secret)
    (tmp_path / (shm.SEGMENT_PREFIX + "01" * 16)).mkdir()
    for planted in ("ef", "01"):
        with pytest.raises(shm.ShmError) as refused:
            maps.view(shm.SEGMENT_PREFIX + planted * 16, 1)
        assert refused.value.reason == "peer_refused"
    maps.close()


def _view_as_nobody(directory: str, name: str, out: Any) -> None:
    os.setgid(65534)
    os.setuid(65534)
    try:
        shm.SegmentMaps(directory).view(name, 1)
        out.put("opened")
    except shm.ShmError as exc:
        out.put(exc.reason)


def test_a_segment_of_another_user_is_refused_as_permission(tmp_path: Path) -> None:
    """Segments are mode 0600: a decode worker running as another user cannot open them."""
    if os.getuid() != 0:
        pytest.skip("needs root to run the reader as another user")
    pool = shm.SegmentPool(str(tmp_path), 1, 60.0)
    segment = pool.acquire(10, "r")
    assert segment is not None and (tmp_path / segment.name).stat().st_mode & 0o777 == 0o600
    tmp_path.chmod(0o755)  # the directory is open to all (as /dev/shm is); the segment is not
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_view_as_nobody, args=(str(tmp_path), segment.name, out))
    child.start()
    child.join(10)
    assert out.get(timeout=5) == "permission"
    pool.close()


def test_the_pool_is_bounded_grows_segments_and_reclaims_after_the_lease(tmp_path: Path) -> None:
    pool = shm.SegmentPool(str(tmp_path), 2, max_owned_s=0.3)
    a = pool.acquire(10, "a")
    b = pool.acquire(3 << 20, "b")
    assert a is not None and b is not None and a.size_bytes == 1 << 20 and b.size_bytes == 3 << 20
    assert pool.acquire(10, "c") is None  # both in use
    pool.release_owner("a")
    c = pool.acquire(2 << 20, "c")  # replaces a, too small
    assert c is not None and c.name != a.name and not (tmp_path / a.name).exists()
    assert _segments(tmp_path) == {b.name, c.name}
    time.sleep(0.35)  # nobody released b or c (a decode that died, a hold never ended): past the lease, reused
    assert pool.acquire(10, "d") is not None
    pool.close()
    assert _segments(tmp_path) == set()


def test_the_sweeper_removes_only_untouched_segments_of_others(tmp_path: Path) -> None:
    old, fresh = tmp_path / (shm.SEGMENT_PREFIX + "0" * 32), tmp_path / (shm.SEGMENT_PREFIX + "1" * 32)
    kept, other = tmp_path / (shm.SEGMENT_PREFIX + "2" * 32), tmp_path / "not-a-segment"
    for path in (old, fresh, kept, other):
        path.write_bytes(b"")
    for path in (old, kept, other):
        os.utime(path, (time.time() - 100, time.time() - 100))
    assert shm.sweep(str(tmp_path), 50, keep={kept.name}) == [old.name]
    assert {p.name for p in tmp_path.iterdir()} == {fresh.name, kept.name, other.name}


def test_the_directory_token_is_one_per_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    a = shm.dir_token(str(tmp_path / "a"))
    assert shm.dir_token(str(tmp_path / "link")) == a == shm.dir_token(str(tmp_path / "a"))
    assert shm.dir_token(str(tmp_path / "b")) != a and len(a) == 32
    assert shm.host_id("node-7") == "node-7" and shm.host_id() == shm.host_id() != ""


def test_an_unusable_directory_leaves_the_worker_on_grpc(tmp_path: Path) -> None:
    side, _ = make_side(free_port(), shm_dir=str(tmp_path / "does-not-exist"))
    try:
        assert side.shm is None and side.server.shm is None and side.puller.shm is None
    finally:
        side.shutdown()


def test_worker_records_advertise_their_data_paths_and_old_records_parse() -> None:
    old = json.dumps({"worker_id": "w", "role": "prefill", "model": "m", "address": "a:1"})
    record = WorkerRecord.from_json(old)
    assert record.kv_data_paths == ("grpc",) and record.kv_shm_host_id == record.kv_shm_dir_token == ""
    new = WorkerRecord(
        "w", "prefill", "m", "a:1", kv_data_paths=("grpc", "shm"), kv_shm_host_id="h", kv_shm_dir_token="t"
    )
    assert WorkerRecord.from_json(new.to_json()) == new


# -- killed processes ---------------------------------------------------------------

_PREFILL_SCRIPT = textwrap.dedent(
    """
    import dataclasses, sys, time
    from tandem.worker.kv_connector.metadata import GrpcKVMetadata
    from tests.unit.worker.test_kv_connector import holds_of, make_handle, make_side
    port, shm_dir, lease_s, capability = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
    side, caches = make_side(port, shm_dir=shm_dir, lease_s=lease_s)
    for rid in sys.argv[5:]:
        handle = make_handle((1, 2), 2 * 4, kv_address=side.server.address)
        handle = dataclasses.replace(handle, request_id=rid, capability=capability)
        holds = holds_of(handle, engine_request_id=rid + "-p", expiry_unix_s=time.time() + 600)
        side.begin_step(GrpcKVMetadata(holds=holds))
    print("ready", flush=True)
    time.sleep(600)
    """
)

_DECODE_SCRIPT = textwrap.dedent(
    """
    import sys, time, grpc
    from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
    address, token, rid, capability = sys.argv[1:5]
    stub = kv_transfer_pb2_grpc.KVTransferStub(grpc.insecure_channel(address))
    pull = kv_transfer_pb2.PullBlocksRequest(request_id=rid, block_ids=[1, 2], capability=capability)
    pull.expected_layout.ParseFromString(bytes.fromhex(sys.argv[5]))
    call = stub.PullBlocksShm(kv_transfer_pb2.ShmPullRequest(pull=pull, shm_dir_token=token), timeout=60)
    print(next(call).segment, flush=True)
    time.sleep(600)  # killed here, mid-pull: the segment named, its chunks not read
    """
)


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[3]
    )


def test_a_killed_prefill_process_leaves_no_segment_past_the_lease(tmp_path: Path) -> None:
    port = free_port()
    child = _spawn(_PREFILL_SCRIPT, str(port), str(tmp_path), str(LEASE_S), CAPABILITY, "rid-1")
    decode, _ = make_side(free_port(), fill=0.0, shm_dir=str(tmp_path), lease_s=LEASE_S)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        handle = make_handle((1, 2), 8, kv_address=f"127.0.0.1:{port}")
        handle = dataclasses.replace(handle, request_id="rid-1")
        record = decode.load(LoadSpec("rid-1-d", handle, (1, 2), (3, 4), 8, 0))
        assert not record.failed and decode.stats().shm_loads_total == 1
        segments = _segments(tmp_path)
        assert len(segments) == 1
        time.sleep(LEASE_S)  # the live prefill touches its segment: the decode's sweeper leaves it
        assert _segments(tmp_path) == segments
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        killed_at = time.monotonic()
        assert _segments(tmp_path) == segments  # nobody removed it at the kill: the sweeper does
        while _segments(tmp_path) and time.monotonic() - killed_at < LEASE_S + 1.0:
            time.sleep(0.05)
        assert _segments(tmp_path) == set(), f"left {time.monotonic() - killed_at:.1f} s after the kill"
    finally:
        child.kill()
        child.wait(10)
        decode.shutdown()


def test_a_decode_process_killed_mid_pull_leaves_its_segment_to_no_one_past_the_lease(tmp_path: Path) -> None:
    prefill, p_caches = make_side(free_port(), shm_dir=str(tmp_path), lease_s=LEASE_S, shm_max_segments=1)
    decode, d_caches = make_side(free_port(), fill=0.0, shm_dir=str(tmp_path), lease_s=LEASE_S)
    child = None
    try:
        assert prefill.shm is not None and prefill.layout is not None
        for rid in ("killed", "refused", "after"):
            handle = make_handle((1, 2), 8, kv_address=prefill.server.address)
            handle = dataclasses.replace(handle, request_id=rid)
            expiry = time.time() + (LEASE_S if rid == "killed" else 60)
            prefill.begin_step(
                GrpcKVMetadata(holds=holds_of(handle, engine_request_id=f"{rid}-p", expiry_unix_s=expiry))
            )
        layout = prefill.layout.to_proto().SerializeToString().hex()
        child = _spawn(_DECODE_SCRIPT, prefill.server.address, prefill.shm.dir_token, "killed", CAPABILITY, layout)
        assert child.stdout is not None
        segment = child.stdout.readline().strip()
        assert _segments(tmp_path) == {segment}
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        killed_at = time.monotonic()
        # The killed pull's segment is its request's (as the blocks are) until its hold's lease: a pull now
        # goes over gRPC...
        handle = make_handle((1, 2), 8, kv_address=prefill.server.address)
        refused = dataclasses.replace(handle, request_id="refused")
        assert not decode.load(LoadSpec("refused-d", refused, (1, 2), (3, 4), 8, 0)).failed
        assert dict(decode.stats().shm_fallbacks_total) == {"peer_refused": 1}
        # ...and once the lease has passed (an engine step frees the expired hold), the same segment serves
        # the next pull: nothing leaked, nothing new in the directory.
        while time.monotonic() - killed_at < LEASE_S + 1.0 and prefill.shm.pool.in_use():
            prefill.get_transfer_results(set())
            time.sleep(0.05)
        assert prefill.shm.pool.in_use() == 0
        after = dataclasses.replace(handle, request_id="after")
        assert not decode.load(LoadSpec("after-d", after, (1, 2), (5, 6), 8, 0)).failed
        assert decode.stats().shm_loads_total == 1 and _segments(tmp_path) == {segment}
        _assert_copied(p_caches, d_caches, (1, 2), (5, 6))
    finally:
        if child is not None:
            child.kill()
            child.wait(10)
        prefill.shutdown()
        decode.shutdown()


def test_data_paths_answer_grpc_alone_with_shared_memory_off() -> None:
    import grpc

    side, _ = make_side(free_port())
    try:
        with grpc.insecure_channel(side.server.address) as channel:
            stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
            assert list(stub.DataPaths(kv_transfer_pb2.DataPathsRequest(), timeout=5).data_paths) == ["grpc"]
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.PullBlocksShm(kv_transfer_pb2.ShmPullRequest(shm_dir_token="x"), timeout=5))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        side.shutdown()


def test_a_stream_that_ends_before_every_chunk_was_said_is_a_broken_pull() -> None:
    from tandem.worker.kv_connector.shm_transport import _ready_chunks

    data = memoryview(b"abcdefgh")
    said = iter(
        [kv_transfer_pb2.ShmChunksReady(num_chunks_ready=1), kv_transfer_pb2.ShmChunksReady(num_chunks_ready=3)]
    )
    assert [bytes(c) for c in _ready_chunks(said, data, [3, 3, 2])] == [b"abc", b"def", b"gh"]
    chunks = _ready_chunks(iter([kv_transfer_pb2.ShmChunksReady(num_chunks_ready=1)]), data, [3, 3, 2])
    assert bytes(next(chunks)) == b"abc"
    with pytest.raises(ValueError, match="1 of 3 chunks"):
        next(chunks)


def test_over_mutual_tls_only_a_decode_workers_certificate_asks_or_pulls_through_shared_memory(tmp_path: Path) -> None:
    import grpc

    from tandem.common.identity import DENIED_MESSAGE
    from tandem.common.tls import channel
    from tandem.local.pki import ensure_pki

    pki = ensure_pki(tmp_path / "pki")
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    prefill, p_caches = make_side(free_port(), tls=pki["prefill"], shm_dir=str(shm_dir), lease_s=LEASE_S)
    decode, d_caches = make_side(free_port(), fill=0.0, tls=pki["decode"], shm_dir=str(shm_dir), lease_s=LEASE_S)
    try:
        _, record = _pull(decode, prefill, (4, 5), (6, 7), "rid")
        assert not record.failed and decode.stats().shm_loads_total == 1
        _assert_copied(p_caches, d_caches, (4, 5), (6, 7))
        assert prefill.shm is not None
        token = prefill.shm.dir_token
        for role in ("gateway", "prefill", "router", "operator"):
            with channel(prefill.server.address, pki[role]) as ch:
                stub = kv_transfer_pb2_grpc.KVTransferStub(ch)
                with pytest.raises(grpc.RpcError) as asked:
                    stub.DataPaths(kv_transfer_pb2.DataPathsRequest(), timeout=5)
                with pytest.raises(grpc.RpcError) as pulled:
                    next(stub.PullBlocksShm(kv_transfer_pb2.ShmPullRequest(shm_dir_token=token), timeout=5))
                for refused in (asked.value, pulled.value):
                    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, role  # type: ignore[attr-defined]
                    assert refused.details() == DENIED_MESSAGE  # type: ignore[attr-defined]
    finally:
        prefill.shutdown()
        decode.shutdown()
