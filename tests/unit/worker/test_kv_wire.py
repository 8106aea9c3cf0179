"""The KV fast path moves bytes exactly: for every dtype and cache layout an engine
may use, blocks pulled over the real gRPC PullBlockBytes stream between two KV
servers are byte-identical to the prefill side's, wherever they land, whatever the
chunking; and the wire refuses a chunk of the wrong size instead of landing it."""

from __future__ import annotations

import sys

import pytest
import torch

from tandem.worker.kv_connector import heap, wire
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, LoadSpec
from tandem.worker.kv_connector.worker_side import WorkerSide
from tests.kit.net import free_port

from .test_kv_connector import holds_of, make_handle, wait_until

NUM_BLOCKS = 12
BLOCK = 4
#: Cache layouts of vLLM's attention backends, by the place of the block dimension:
#: CPU (2, blocks, kv heads, tokens, head), FlashAttention (2, blocks, tokens, kv heads, head),
#: FlashInfer (blocks, 2, tokens, kv heads, head), MLA (blocks, tokens, latent).
#: The wire copies through the widest integer view a head's bytes divide into: int64 for these four.
LAYOUTS = {
    "cpu": ((2, NUM_BLOCKS, 3, BLOCK, 8), 1),
    "flash_attn": ((2, NUM_BLOCKS, BLOCK, 3, 8), 1),
    "flashinfer": ((NUM_BLOCKS, 2, BLOCK, 3, 8), 0),
    "mla": ((NUM_BLOCKS, BLOCK, 24), 0),
    # A head of 5 elements: the wire copies as int32 (fp32), int16 (bf16, fp16) or bytes (fp8).
    "odd_head": ((2, NUM_BLOCKS, 3, BLOCK, 5), 1),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _caches(shape: tuple[int, ...], dtype: torch.dtype, seed: int | None, layers: int = 3) -> dict[str, torch.Tensor]:
    if seed is None:
        return {f"model.layers.{i}.attn": torch.zeros(shape, dtype=dtype) for i in range(layers)}
    generator = torch.Generator().manual_seed(seed)
    # Random bits, not random numbers: every byte pattern of the dtype (NaNs, infinities, subnormals) must survive.
    bits_shape = (*shape[:-1], shape[-1] * dtype.itemsize)
    return {
        f"model.layers.{i}.attn": torch.randint(0, 256, bits_shape, dtype=torch.uint8, generator=generator).view(dtype)
        for i in range(layers)
    }


def _side(port: int, max_chunk_bytes: int, **options: int) -> WorkerSide:
    """A worker side over ``NUM_BLOCKS`` blocks; ``options`` go to WorkerSide (``prefetch_max_bytes=``)."""
    return WorkerSide(
        model="m",
        num_blocks=NUM_BLOCKS,
        block_size_tokens=BLOCK,
        tp_size=1,
        tp_rank=0,
        kv_host="127.0.0.1",
        kv_port=port,
        max_chunk_bytes=max_chunk_bytes,
        pull_timeout_s=10,
        **options,
    )


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_pulled_blocks_are_byte_identical(layout: str, dtype: torch.dtype) -> None:
    shape, block_dim = LAYOUTS[layout]
    block_bytes = dtype.itemsize
    for i, d in enumerate(shape):
        block_bytes *= 1 if i == block_dim else d
    # Two blocks per chunk: runs split across chunks, and a last chunk of one block.
    prefill, decode = _side(free_port(), 2 * block_bytes), _side(free_port(), 2 * block_bytes)
    p_caches, d_caches = _caches(shape, dtype, seed=7), _caches(shape, dtype, seed=None)
    prefill.register_kv_caches(p_caches)
    decode.register_kv_caches(d_caches)
    try:
        assert decode.layout is not None and decode.layout.block_dim == block_dim
        # Consecutive, scattered and reversed runs on both sides.
        remote, local = (1, 2, 3, 7, 5), (11, 10, 0, 1, 2)
        handle = make_handle(remote, num_tokens=len(remote) * BLOCK, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec("req-1-abcdefgh", handle, remote, local, 20, 0)]))
        wait_until(lambda: "req-1-abcdefgh" in decode.puller._ended, timeout_s=10)
        decode.get_transfer_results(set())  # the engine step that reports the load
        record = decode.take_load_records()["req-1-abcdefgh"]
        assert record.failed is False, record.error
        untouched = set(range(NUM_BLOCKS)) - set(local)
        for name in p_caches:
            for theirs, ours in zip(remote, local, strict=True):
                got, sent = d_caches[name].select(block_dim, ours), p_caches[name].select(block_dim, theirs)
                assert _same_bytes(got, sent), (name, theirs)
            for b in untouched:
                assert torch.count_nonzero(d_caches[name].select(block_dim, b).view(torch.uint8)) == 0
        assert decode.stats().bytes_received_total == len(remote) * block_bytes * len(p_caches)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_small_pull_asks_for_smaller_messages() -> None:
    mib = 1 << 20
    assert wire.pull_chunk_bytes(6 * mib, 4 * mib) == wire.MIN_PULL_CHUNK_BYTES == mib
    assert wire.pull_chunk_bytes(12 * mib, 4 * mib) == 2 * mib
    assert wire.pull_chunk_bytes(200 * mib, 4 * mib) == 4 * mib  # a large pull keeps the largest messages
    assert wire.pull_chunk_bytes(6 * mib, 64 * 1024) == 64 * 1024  # never above the setting
    assert wire.pull_chunk_bytes(100, 4 * mib) == mib  # a tiny pull is one message anyway


def test_a_pull_of_a_few_mib_travels_in_1_mib_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The puller asks for smaller messages than ``max_chunk_bytes`` and cuts what arrives by the
    same plan: the blocks land intact."""
    shape = (2, NUM_BLOCKS, 4, 64, 64)  # 128 KiB a block of a layer in float32
    prefill, decode = _side(free_port(), 4 << 20), _side(free_port(), 4 << 20)
    p_caches = _caches(shape, torch.float32, seed=3, layers=8)
    d_caches = _caches(shape, torch.float32, seed=None, layers=8)
    prefill.register_kv_caches(p_caches)
    decode.register_kv_caches(d_caches)
    sent: list[int] = []
    read_chunks = prefill.server.read_chunks

    def recording(block_ids: list[int], max_chunk_bytes: int):  # type: ignore[no-untyped-def]
        for chunk in read_chunks(block_ids, max_chunk_bytes):
            sent.append(len(chunk))
            yield chunk

    monkeypatch.setattr(prefill.server, "read_chunks", recording)
    try:
        remote, local = (0, 1, 2, 3), (8, 9, 10, 11)  # 4 blocks x 8 layers x 128 KiB = 4 MiB
        handle = make_handle(remote, num_tokens=len(remote) * BLOCK, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        record = decode.puller.load(LoadSpec("req-2-abcdefgh", handle, remote, local, 16, 0))
        assert record.failed is False, record.error
        assert sent == [1 << 20] * 4
        for name in p_caches:
            for theirs, ours in zip(remote, local, strict=True):
                assert _same_bytes(d_caches[name].select(1, ours), p_caches[name].select(1, theirs))
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_chunk_plan_covers_every_block_of_every_layer_once() -> None:
    plan = wire.chunk_plan(num_layers=3, num_blocks=7, block_bytes=100, max_chunk_bytes=250)
    pieces = [[(p.layer_index, p.first, p.num_blocks) for p in c.pieces] for c in plan]
    assert pieces[:5] == [[(0, 0, 2)], [(0, 2, 2)], [(0, 4, 2)], [(0, 6, 1), (1, 0, 1)], [(1, 1, 2)]]
    assert sum(c.num_blocks for c in plan) == 21 and len(plan) == 11
    covered = [(p.layer_index, p.first + i) for c in plan for p in c.pieces for i in range(p.num_blocks)]
    assert covered == [(layer, b) for layer in range(3) for b in range(7)]
    assert wire.chunk_plan(1, 3, block_bytes=1000, max_chunk_bytes=10)[0].num_blocks == 1  # at least one block


def test_a_short_pull_spans_layers_in_one_chunk() -> None:
    (chunk,) = wire.chunk_plan(num_layers=30, num_blocks=1, block_bytes=100, max_chunk_bytes=4000)
    assert [p.layer_index for p in chunk.pieces] == list(range(30))


def test_a_chunk_of_the_wrong_size_is_refused() -> None:
    cache = torch.zeros((2, NUM_BLOCKS, 4), dtype=torch.float32)
    with pytest.raises(ValueError, match="must be 64 bytes"):
        wire.write_chunks([cache], 1, [3, 4], max_chunk_bytes=64, chunks=[bytes(60)])
    assert torch.count_nonzero(cache) == 0


def test_runs_cut_block_ids_into_consecutive_stretches() -> None:
    assert [(r.offset, r.block, r.length) for r in wire.runs([1, 2, 3, 7, 5, 6])] == [(0, 1, 3), (3, 7, 1), (4, 5, 2)]
    assert [(r.offset, r.block, r.length) for r in wire.runs([11, 10])] == [(0, 11, 1), (1, 10, 1)]
    assert wire.runs([]) == []


def test_a_pull_with_chunks_missing_or_extra_is_refused() -> None:
    cache = torch.zeros((2, NUM_BLOCKS, 4), dtype=torch.float32)
    chunk = bytes(2 * 4 * 4)
    with pytest.raises(ValueError, match="received 1 of 2 chunks"):
        wire.write_chunks([cache], 1, [0, 1], max_chunk_bytes=32, chunks=[chunk])
    with pytest.raises(ValueError, match="more than the 2 chunks"):
        wire.write_chunks([cache], 1, [0, 1], max_chunk_bytes=32, chunks=[chunk, chunk, chunk])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_message_buffers_stay_in_the_heap_up_to_glibcs_cap() -> None:
    mmap_threshold, trim_threshold = heap.keep_message_buffers(4 << 20) or (0, 0)
    assert mmap_threshold >= 8 << 20 and trim_threshold == 4 * mmap_threshold
    assert heap.keep_message_buffers(1) == (mmap_threshold, trim_threshold)  # the largest asked for wins
    assert heap.keep_message_buffers(1 << 30) == (32 << 20, 128 << 20)  # glibc's largest threshold
