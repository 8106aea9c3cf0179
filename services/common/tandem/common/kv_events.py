"""The KV-event wire format of vLLM's ZMQ publisher, decoded leniently.

Real workers' engines publish it (``kv_events_config`` in
:mod:`tandem.worker.engine`); simulated workers (:mod:`tandem.local.simulated_worker`)
encode it with :func:`encode_batch`; the router's subscriber
(:mod:`tandem.router.kv_subscriber`) decodes it with :func:`decode_batch`.

Transport (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): PUB
multipart ``(topic, seq as 8 bytes big-endian, msgpack payload)``; a ROUTER
replay socket takes ``start seq`` (8 bytes) and answers every buffered batch
from there as ``(b"", topic, seq, payload)``, then ``(b"", b"", END_SEQ, b"")``.

Payload: ``KVEventBatch`` as a msgpack array ``[ts, [event, ...], dp_rank]``;
each event a map with ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) and fields that vLLM keeps adding to, so decoding reads
only the fields it needs, skips unknown event types and tolerates missing
optional fields. Block hashes become the 64-bit ints of
:func:`tandem.common.block_hash.external_block_hash` whether the engine sent
ints or raw digests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.common.block_hash import external_block_hash

#: Replay end marker: sequence number -1 as 8 bytes, signed big-endian.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The medium of the engine's own KV cache; other media are offload tiers.
MEDIUM_GPU = "GPU"


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch at all (a single bad event is skipped instead)."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None = None
    num_tokens: int = 0
    block_size: int = 0
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


def _hashes(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple):
        return ()
    return tuple(external_block_hash(h) for h in raw if isinstance(h, int | bytes))


def _event(raw: Any) -> KVEvent | None:
    if not isinstance(raw, dict):
        return None
    kind = raw.get("type")
    if kind == "BlockStored":
        parent = raw.get("parent_block_hash")
        token_ids = raw.get("token_ids")
        return BlockStored(
            block_hashes=_hashes(raw.get("block_hashes")),
            parent_block_hash=external_block_hash(parent) if isinstance(parent, int | bytes) else None,
            num_tokens=len(token_ids) if isinstance(token_ids, list) else 0,
            block_size=int(raw.get("block_size") or 0),
            medium=raw.get("medium") if isinstance(raw.get("medium"), str) else None,
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(raw.get("block_hashes")),
            medium=raw.get("medium") if isinstance(raw.get("medium"), str) else None,
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a newer event type: not ours to understand


def decode_batch(payload: bytes) -> KVEventBatch:
    """One published payload; raises :class:`KVEventDecodeError` when it is not a batch."""
    import msgspec  # light, but only the router and simulated workers need it

    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict) and "events" in raw:  # a publisher that encodes the batch as a map
        raw = [raw.get("ts", 0.0), raw.get("events", []), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventDecodeError("not a KV event batch")
    events = tuple(e for e in (_event(r) for r in raw[1]) if e is not None)
    ts = float(raw[0]) if isinstance(raw[0], int | float) else 0.0
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return KVEventBatch(ts=ts, events=events, data_parallel_rank=rank)


def encode_batch(ts: float, events: Sequence[KVEvent], *, block_size: int) -> bytes:
    """A payload in vLLM's schema (for simulated workers and tests); token ids are not sent."""
    import msgspec

    out: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, BlockStored):
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": list(event.block_hashes),
                    "parent_block_hash": event.parent_block_hash,
                    "token_ids": [],
                    "block_size": event.block_size or block_size,
                    "lora_id": None,
                    "medium": event.medium or MEDIUM_GPU,
                    "lora_name": None,
                }
            )
        elif isinstance(event, BlockRemoved):
            out.append({"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM_GPU})
        else:
            out.append({"type": "AllBlocksCleared"})
    return msgspec.msgpack.encode([ts, out, 0])
