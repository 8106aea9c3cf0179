"""KV-event payload decoding without vLLM: unknown fields and event types, raw-byte hashes, garbage."""

from __future__ import annotations

import msgspec
import pytest

from tandem.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
)


def test_round_trip_of_our_encoder() -> None:
    events = [BlockStored((1, 2), 7, block_size=16), BlockRemoved((3,)), AllBlocksCleared()]
    decoded = decode_batch(encode_batch(5.0, events, block_size=16))
    assert decoded.ts == 5.0
    assert decoded.events == (
        BlockStored((1, 2), 7, num_tokens=0, block_size=16, medium="GPU"),
        BlockRemoved((3,), medium="GPU"),
        AllBlocksCleared(),
    )


def test_newer_schema_is_read_leniently() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockStored", "block_hashes": [b"\x00" * 24 + (5).to_bytes(8, "big")],
                 "token_ids": [1, 2], "block_size": 2, "future_field": {"x": 1}},
                {"type": "SomethingNew", "block_hashes": [9]},
                {"type": "BlockRemoved", "block_hashes": [4, "not-a-hash"]},
                "not-an-event",
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.events == (BlockStored((5,), None, num_tokens=2, block_size=2), BlockRemoved((4,)))
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1])])
def test_garbage_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)
