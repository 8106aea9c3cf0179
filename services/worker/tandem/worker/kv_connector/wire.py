"""How KV blocks travel: the one place that turns cache blocks into bytes and back.

``tandem.v1.KVTransfer/PullBlockBytes`` is a server stream of raw bytes, not of
protobuf messages (protobuf would copy every chunk twice more on each side).
The request is a ``PullBlocksRequest``; each response message is the bytes of
one chunk, in the order :func:`chunk_plan` gives, which both sides compute from
the request alone, so no chunk carries a header:

* the units of a pull are (layer, block) pairs, layer-major: every requested
  block of layer 0, then of layer 1, ...; a chunk is as many consecutive units
  as fit in ``max_chunk_bytes`` (at least one), so a short prompt's pull is a
  few messages, not one per layer;
* within a chunk, each layer's stretch of blocks is a :class:`Piece`; its bytes
  are ``cache.index_select(block_dim, ids)`` in C order (the layer's cache
  tensor with its block dimension cut to the piece's blocks, dimensions never
  reordered), and a chunk's bytes are its pieces' bytes one after the other.

Copies go run by run (consecutive block ids are one slice) through the widest
integer view of the cache, so they are byte-exact for every dtype. On CPU the
server joins the cache's own memory into the message (one copy) and the client
copies each message once into the cache, both through numpy on the calling
thread: torch's copies of a large run fan out to the OpenMP pool, which stalls
for milliseconds when another process's threads hold the other cores. A cache
on a device is gathered on the device, then copied to the host.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

#: Full name of the raw-bytes pull method (served by a generic handler; see the module doc).
PULL_METHOD: Final = "/tandem.v1.KVTransfer/PullBlockBytes"

# torch.frombuffer warns about read-only buffers (gRPC hands the client immutable bytes); the
# client only reads them (into a device cache; CPU copies go through numpy).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass(frozen=True)
class Piece:
    """``num_blocks`` requested blocks of one layer, from index ``first`` of the requested ids."""

    layer_index: int
    first: int
    num_blocks: int


@dataclass(frozen=True)
class Chunk:
    pieces: tuple[Piece, ...]

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pieces)


@dataclass(frozen=True)
class Run:
    """Consecutive blocks: ``length`` blocks from cache block ``block`` sit at ``offset`` in the piece."""

    offset: int
    block: int
    length: int


def blocks_per_chunk(block_bytes: int, max_chunk_bytes: int) -> int:
    return max(1, max_chunk_bytes // max(1, block_bytes))


def chunk_plan(num_layers: int, num_blocks: int, block_bytes: int, max_chunk_bytes: int) -> list[Chunk]:
    """The chunks of a pull of ``num_blocks`` blocks of every layer, in wire order."""
    per_chunk = blocks_per_chunk(block_bytes, max_chunk_bytes)
    num_units = num_layers * num_blocks  # (layer, block) pairs, layer-major
    chunks = []
    for start in range(0, num_units, per_chunk):
        end = min(num_units, start + per_chunk)
        pieces = []
        unit = start
        while unit < end:
            layer, first = divmod(unit, num_blocks)
            length = min(end - unit, num_blocks - first)
            pieces.append(Piece(layer, first, length))
            unit += length
        chunks.append(Chunk(tuple(pieces)))
    return chunks


def runs(ids: Sequence[int]) -> list[Run]:
    """``ids`` cut into runs of consecutive block ids, in order."""
    out: list[Run] = []
    for offset, block in enumerate(ids):
        if out and block == out[-1].block + out[-1].length:
            last = out[-1]
            out[-1] = Run(last.offset, last.block, last.length + 1)
        else:
            out.append(Run(offset, block, 1))
    return out


#: Integer types to view a cache as, widest first: copies on a uint8 view run several times slower.
_WORDS: Final = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _as_words(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` seen as the widest integer type its last dimension's bytes divide into. Copies
    on this view are byte-exact for every dtype (fp8 included, which has no ``index_copy_`` of
    its own) and never touch the values (NaN payloads stay as they are)."""
    row_bytes = cache.shape[-1] * cache.element_size()
    word = next(w for w in _WORDS if row_bytes % w.itemsize == 0)
    return cache.view(word)


def _block_bytes(words: torch.Tensor, block_dim: int) -> int:
    return int(words.numel() // words.shape[block_dim] * words.element_size())


def _cut(block_dim: int, start: int, length: int) -> tuple[slice, ...]:
    """An index that cuts ``length`` blocks from ``start`` along ``block_dim``."""
    return (*([slice(None)] * block_dim), slice(start, start + length))


def _leading(shape: Sequence[int], block_dim: int) -> Iterator[tuple[int, ...]]:
    """Every index of the dimensions before ``block_dim``, in C order."""
    return itertools.product(*(range(d) for d in shape[:block_dim]))


def _piece_ids(block_ids: Sequence[int], piece: Piece) -> Sequence[int]:
    return block_ids[piece.first : piece.first + piece.num_blocks]


def read_chunks(
    layers: Sequence[torch.Tensor], block_dim: int, block_ids: Sequence[int], max_chunk_bytes: int
) -> Iterator[bytes]:
    """The bytes of blocks ``block_ids`` of every layer's cache, chunk by chunk in wire order."""
    if not layers or not block_ids:
        return
    all_words = [_as_words(cache) for cache in layers]
    plan = chunk_plan(len(all_words), len(block_ids), _block_bytes(all_words[0], block_dim), max_chunk_bytes)
    if all_words[0].device.type != "cpu":
        yield from _read_device_chunks(all_words, block_dim, block_ids, plan)
        return
    arrays = [words.numpy() for words in all_words]
    for chunk in plan:
        # With the block dimension cut to a run, each index of the dimensions before it is
        # one contiguous stretch of the cache (ascontiguousarray is then a view, not a copy):
        # join() copies them straight into the message.
        parts: list[memoryview] = []
        for piece in chunk.pieces:
            array = arrays[piece.layer_index]
            piece_runs = runs(_piece_ids(block_ids, piece))
            for lead in _leading(array.shape, block_dim):
                row = array[lead]
                parts.extend(np.ascontiguousarray(row[r.block : r.block + r.length]).data for r in piece_runs)
        yield b"".join(parts)


def _read_device_chunks(
    all_words: Sequence[torch.Tensor], block_dim: int, block_ids: Sequence[int], plan: Sequence[Chunk]
) -> Iterator[bytes]:
    """Device caches: each piece gathered on the device, copied into one host staging buffer."""
    block_words = _block_bytes(all_words[0], block_dim) // all_words[0].element_size()
    staging = torch.empty(block_words * max(c.num_blocks for c in plan), dtype=all_words[0].dtype)
    for chunk in plan:
        offset = 0
        for piece in chunk.pieces:
            words = all_words[piece.layer_index]
            ids = torch.tensor(list(_piece_ids(block_ids, piece)), dtype=torch.long, device=words.device)
            size = block_words * piece.num_blocks
            staging[offset : offset + size].copy_(words.index_select(block_dim, ids).reshape(-1))
            offset += size
        yield staging[:offset].numpy().tobytes()


def write_chunks(
    layers: Sequence[torch.Tensor],
    block_dim: int,
    block_ids: Sequence[int],
    max_chunk_bytes: int,
    chunks: Iterable[bytes],
) -> int:
    """Copy a pull's chunks (in wire order) into blocks ``block_ids`` of every layer's cache.
    Returns the bytes written; raises ``ValueError`` when a chunk's size or the number of chunks
    is not what the plan says (nothing of a chunk of the wrong size is written)."""
    if not layers or not block_ids:
        return 0
    all_words = [_as_words(cache) for cache in layers]
    block_bytes = _block_bytes(all_words[0], block_dim)
    plan = chunk_plan(len(all_words), len(block_ids), block_bytes, max_chunk_bytes)
    received = iter(chunks)
    num_bytes = 0
    for index, chunk in enumerate(plan):
        data = next(received, None)
        if data is None:
            raise ValueError(f"received {index} of {len(plan)} chunks")
        if len(data) != chunk.num_blocks * block_bytes:
            raise ValueError(
                f"chunk {index} of {chunk.num_blocks} blocks must be {chunk.num_blocks * block_bytes} bytes, "
                f"got {len(data)}"
            )
        offset = 0
        for piece in chunk.pieces:
            size = piece.num_blocks * block_bytes
            _write_piece(all_words[piece.layer_index], block_dim, _piece_ids(block_ids, piece), data, offset)
            offset += size
        num_bytes += len(data)
    if next(received, None) is not None:
        raise ValueError(f"the KV server sent more than the {len(plan)} chunks planned")
    return num_bytes


def _write_piece(words: torch.Tensor, block_dim: int, ids: Sequence[int], data: bytes, offset: int) -> None:
    shape = list(words.shape)
    shape[block_dim] = len(ids)
    count = words.numel() // words.shape[block_dim] * len(ids)
    if words.device.type == "cpu":
        cache = words.numpy()
        values = np.frombuffer(data, dtype=cache.dtype, count=count, offset=offset).reshape(shape)
        for run in runs(ids):
            cache[_cut(block_dim, run.block, run.length)] = values[_cut(block_dim, run.offset, run.length)]
        return
    host = torch.frombuffer(data, dtype=words.dtype, count=count, offset=offset).view(shape)
    device_values = host.to(words.device)
    for run in runs(ids):
        words[_cut(block_dim, run.block, run.length)].copy_(device_values[_cut(block_dim, run.offset, run.length)])
