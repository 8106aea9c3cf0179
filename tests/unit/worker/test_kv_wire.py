"""The KV fast path moves bytes exactly: for every dtype and cache layout an engine
may use, blocks pulled over the real gRPC PullBlockBytes stream between two KV
servers are byte-identical to the prefill side's, wherever they land, whatever the
chunking; and the wire refuses a chunk of the wrong size instead of landing it."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.worker.kv_connector import wire
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, LoadSpec
from tandem.worker.kv_connector.worker_side import WorkerSide
from tests.kit.net import free_port

from .test_kv_connector import make_handle, wait_until

NUM_BLOCKS = 12
BLOCK = 4
#: Cache layouts of vLLM's attention backends, by the place of the block dimension:
#: CPU (2, blocks, kv heads, tokens, head), FlashAttention (2, blocks, tokens, kv heads, head),
#: FlashInfer (blocks, 2, tokens, kv heads, head), MLA (blocks, tokens, latent).
LAYOUTS = {
    "cpu": ((2, NUM_BLOCKS, 3, BLOCK, 8), 1),
    "flash_attn": ((2, NUM_BLOCKS, BLOCK, 3, 8), 1),
    "flashinfer": ((NUM_BLOCKS, 2, BLOCK, 3, 8), 0),
    "mla": ((NUM_BLOCKS, BLOCK, 24), 0),
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


def _side(port: int, max_chunk_bytes: int) -> WorkerSide:
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
        handle = make_handle(remote, num_tokens=len(remote) * BLOCK, kv_address=prefill._bind)
        prefill.start_load_kv(GrpcKVMetadata(holds={handle.remote_request_id: (remote, time.time() + 60)}))
        decode.start_load_kv(GrpcKVMetadata(loads=[LoadSpec("req-1-abcdefgh", handle, remote, local, 20)]))
        wait_until(lambda: "req-1-abcdefgh" in decode._done_recving | decode._failed_recving, timeout_s=10)
        assert decode.stats("req-1").request.failed is False, decode.stats("req-1").request.error
        untouched = set(range(NUM_BLOCKS)) - set(local)
        for name in p_caches:
            for theirs, ours in zip(remote, local, strict=True):
                got, sent = d_caches[name].select(block_dim, ours), p_caches[name].select(block_dim, theirs)
                assert _same_bytes(got, sent), (name, theirs)
            for b in untouched:
                assert torch.count_nonzero(d_caches[name].select(block_dim, b).view(torch.uint8)) == 0
        assert decode.stats("").bytes_received_total == len(remote) * block_bytes * len(p_caches)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_chunk_plan_covers_every_block_of_every_layer_once() -> None:
    plan = wire.chunk_plan(num_layers=3, num_blocks=7, block_bytes=100, max_chunk_bytes=250)
    assert [(c.layer_index, c.first, c.num_blocks) for c in plan[:4]] == [(0, 0, 2), (0, 2, 2), (0, 4, 2), (0, 6, 1)]
    assert len(plan) == 12
    assert wire.chunk_plan(1, 3, block_bytes=1000, max_chunk_bytes=10)[0].num_blocks == 1  # at least one block


def test_a_chunk_of_the_wrong_size_is_refused() -> None:
    cache = torch.zeros((2, NUM_BLOCKS, 4), dtype=torch.float32)
    with pytest.raises(ValueError, match="must be 64 bytes"):
        wire.write_blocks(cache, 1, [3, 4], bytes(60))
    assert torch.count_nonzero(cache) == 0
