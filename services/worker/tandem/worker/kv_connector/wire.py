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
import struct
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

#: Full name of the raw-bytes pull method (served by a generic handler; see the module doc).
PULL_METHOD: Final = "/tandem.v1.KVTransfer/PullBlockBytes"
#: The blocks of a prompt whose prefill still runs, in the order the prefill engine computes them (see
#: :func:`ready_pieces`); each message starts with a header naming its pieces (:func:`stream_header`).
STREAM_METHOD: Final = "/tandem.v1.KVTransfer/StreamBlockBytes"
#: A stream message's header: the number of pieces, then (layer, first block, number of blocks) each.
_STREAM_COUNT: Final = struct.Struct("<I")
_STREAM_PIECE: Final = struct.Struct("<III")

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


#: A pull asks for messages small enough to cut it into at least this many (see :func:`pull_chunk_bytes`).
MIN_MESSAGES_PER_PULL: Final = 6
#: ... but no smaller than this: below it, the per-message costs of gRPC's Python stack outweigh the overlap
#: (a 1-block pull in 512 KiB messages took 6.6 ms against 4.5 ms in 1 MiB ones, on 2026-12-06).
MIN_PULL_CHUNK_BYTES: Final = 1 << 20


def pull_chunk_bytes(num_bytes: int, max_chunk_bytes: int) -> int:
    """The chunk size a pull of ``num_bytes`` asks for: ``max_chunk_bytes``, or less for a small pull.

    gRPC hands a message to Python only once all of it has arrived, and the KV server makes a message
    before it sends it, so a pull's first message and its last copy overlap nothing. A pull of a few
    4 MiB messages is mostly those two; in 1 MiB messages the stream keeps the three stages busy.
    Measured on the 2-core CPU machine (2026-12-06, p50s): a bare two-process gRPC stream of 5.9 MB (one
    block of the default model) took 6.8-7.2 ms in 4 MiB messages and 3.9 ms in 1 MiB ones; 47 MB and
    189 MB were within noise of each other at 1, 2 and 4 MiB, so larger pulls keep ``max_chunk_bytes``
    (fewer messages, less Python per byte). The pull itself gained less, alternating the two in one
    process: 1 block 5.05 against 5.08 ms, 512 tokens 13.3 against 14.1 ms."""
    return max(1, min(max_chunk_bytes, max(MIN_PULL_CHUNK_BYTES, num_bytes // MIN_MESSAGES_PER_PULL)))


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


class BlockReader:
    """Reads chunks of one rank's blocks (the serving side of a pull); built once per pull, so a
    stream whose blocks become ready one after another (a prefill still running) reads each chunk
    when it is ready, with the block ids known by then."""

    def __init__(self, layers: Sequence[torch.Tensor], block_dim: int) -> None:
        self._block_dim = block_dim
        self._words = [_as_words(cache) for cache in layers]
        self.block_bytes = _block_bytes(self._words[0], block_dim) if layers else 0
        self._on_cpu = bool(layers) and self._words[0].device.type == "cpu"
        self._arrays = [words.numpy() for words in self._words] if self._on_cpu else []
        self._staging: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self._words)

    def plan(self, num_blocks: int, max_chunk_bytes: int) -> list[Chunk]:
        """The chunks of a pull of ``num_blocks`` blocks of every layer, in wire order."""
        return chunk_plan(self.num_layers, num_blocks, self.block_bytes, max_chunk_bytes)

    @property
    def shareable(self) -> bool:
        """Whether threads may read through this reader at once (CPU caches: reads keep no state;
        a device cache's reads share one host staging buffer)."""
        return self._on_cpu or not self._words

    def chunks(self, block_ids: Sequence[int], max_chunk_bytes: int) -> Iterator[bytes]:
        """The bytes of blocks ``block_ids`` of every layer, chunk by chunk in wire order."""
        if not self._words or not block_ids:
            return
        for chunk in self.plan(len(block_ids), max_chunk_bytes):
            yield self.read(block_ids, chunk)

    def read(self, block_ids: Sequence[int], chunk: Chunk, *, prefix: bytes = b"") -> bytes:
        """The bytes of ``chunk`` of a pull of ``block_ids`` (only the ids its pieces cover are read),
        after ``prefix`` (a stream message's header) in the same message."""
        if not self._on_cpu:
            return prefix + self._read_device(block_ids, chunk)
        # With the block dimension cut to a run, each index of the dimensions before it is
        # one contiguous stretch of the cache (ascontiguousarray is then a view, not a copy):
        # join() copies them straight into the message.
        parts: list[memoryview | bytes] = [prefix]
        for piece in chunk.pieces:
            array = self._arrays[piece.layer_index]
            piece_runs = runs(_piece_ids(block_ids, piece))
            for lead in _leading(array.shape, self._block_dim):
                row = array[lead]
                parts.extend(np.ascontiguousarray(row[r.block : r.block + r.length]).data for r in piece_runs)
        return b"".join(parts)

    def read_into(self, block_ids: Sequence[int], chunk: Chunk, out: memoryview) -> int:
        """Write the bytes :meth:`read` returns for ``chunk`` into ``out`` instead (a shared-memory
        segment: one copy out of the cache, no message); returns how many."""
        offset = 0
        for piece in chunk.pieces:
            words = self._words[piece.layer_index]
            shape = list(words.shape)
            shape[self._block_dim] = piece.num_blocks
            count = words.numel() // words.shape[self._block_dim] * piece.num_blocks
            ids = _piece_ids(block_ids, piece)
            if self._on_cpu:
                array = self._arrays[piece.layer_index]
                dst = np.frombuffer(out, dtype=array.dtype, count=count, offset=offset).reshape(shape)
                dim = self._block_dim
                for run in runs(ids):
                    dst[_cut(dim, run.offset, run.length)] = array[_cut(dim, run.block, run.length)]
            else:
                index = torch.tensor(list(ids), dtype=torch.long, device=words.device)
                host = torch.frombuffer(out, dtype=words.dtype, count=count, offset=offset).view(shape)
                host.copy_(words.index_select(self._block_dim, index))
            offset += piece.num_blocks * self.block_bytes
        return offset

    def _read_device(self, block_ids: Sequence[int], chunk: Chunk) -> bytes:
        """Device caches: each piece gathered on the device, copied into one host staging buffer."""
        first = self._words[0]
        block_words = self.block_bytes // first.element_size()
        size_words = block_words * chunk.num_blocks
        if self._staging is None or self._staging.numel() < size_words:
            self._staging = torch.empty(size_words, dtype=first.dtype)
        offset = 0
        for piece in chunk.pieces:
            words = self._words[piece.layer_index]
            ids = torch.tensor(list(_piece_ids(block_ids, piece)), dtype=torch.long, device=words.device)
            size = block_words * piece.num_blocks
            self._staging[offset : offset + size].copy_(words.index_select(self._block_dim, ids).reshape(-1))
            offset += size
        return bytes(self._staging[:offset].numpy().tobytes())


def ready_pieces(sent: list[int], ready: Sequence[int], max_chunk_blocks: int) -> list[Piece]:
    """The next stream message of a running prefill: blocks computed (``ready[layer]`` blocks of every
    layer) and not sent yet (``sent[layer]``, advanced here), layer by layer from layer 0, at most
    ``max_chunk_blocks`` (at least one). The order follows the engine: a chunked prefill's first
    step makes its blocks of every layer ready before the next step's."""
    pieces: list[Piece] = []
    room = max(1, max_chunk_blocks)
    for layer, num_ready in enumerate(ready):
        num = min(num_ready - sent[layer], room)
        if num <= 0:
            continue
        pieces.append(Piece(layer, sent[layer], num))
        sent[layer] += num
        room -= num
        if room == 0:
            break
    return pieces


def stream_header(pieces: Sequence[Piece]) -> bytes:
    return _STREAM_COUNT.pack(len(pieces)) + b"".join(
        _STREAM_PIECE.pack(p.layer_index, p.first, p.num_blocks) for p in pieces
    )


def parse_stream_header(data: bytes | memoryview, *, exact: bool = False) -> tuple[list[Piece], int]:
    """The pieces a stream message's header names, and where their bytes start; ``exact``: the header is
    the whole message (a stream through shared memory says its pieces without their bytes). Raises
    ``ValueError`` when it is cut short or, with ``exact``, followed by anything."""
    try:
        (count,) = _STREAM_COUNT.unpack_from(data, 0)
        pieces = [
            Piece(*_STREAM_PIECE.unpack_from(data, _STREAM_COUNT.size + i * _STREAM_PIECE.size)) for i in range(count)
        ]
    except struct.error as exc:
        raise ValueError(f"a stream message's header is cut short ({len(data)} bytes)") from exc
    offset = _STREAM_COUNT.size + count * _STREAM_PIECE.size
    if exact and len(data) != offset:
        raise ValueError(f"a stream message of {count} pieces has {len(data)} bytes")
    return pieces, offset


class StreamOrder:
    """The stream's order, checked piece by piece: each layer's blocks ``0..num_blocks-1`` exactly once,
    in order."""

    def __init__(self, num_layers: int, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self.received = [0] * num_layers

    def take(self, piece: Piece) -> None:
        """Raises ``ValueError`` unless ``piece`` comes next in its layer and ends within the blocks."""
        layer, first, num = piece.layer_index, piece.first, piece.num_blocks
        if layer >= len(self.received) or first != self.received[layer] or first + num > self._num_blocks:
            raise ValueError(f"piece (layer {layer}, blocks {first}..{first + num - 1}) out of order")
        self.received[layer] += num

    @property
    def num_received(self) -> int:
        return sum(self.received)

    @property
    def complete(self) -> bool:
        return all(n == self._num_blocks for n in self.received)


def write_stream(layers: Sequence[torch.Tensor], block_dim: int, num_blocks: int, messages: Iterable[bytes]) -> int:
    """Copy a stream's messages into blocks ``0..num_blocks-1`` of every layer of ``layers`` (staging).
    Returns the bytes written; raises ``ValueError`` when a message is malformed, a piece is out of
    order, or the stream ends before every block of every layer came (exactly once)."""
    all_words = [_as_words(cache) for cache in layers]
    block_bytes = _block_bytes(all_words[0], block_dim)
    order = StreamOrder(len(all_words), num_blocks)
    num_bytes = 0
    for data in messages:
        pieces, offset = parse_stream_header(data)
        header_bytes = offset
        if len(data) != offset + block_bytes * sum(p.num_blocks for p in pieces):
            raise ValueError(f"a stream message of {len(pieces)} pieces has {len(data)} bytes")
        for piece in pieces:
            order.take(piece)
            positions = range(piece.first, piece.first + piece.num_blocks)
            _write_piece(all_words[piece.layer_index], block_dim, positions, data, offset)
            offset += piece.num_blocks * block_bytes
        num_bytes += offset - header_bytes
    if not order.complete:
        raise ValueError(f"the stream ended with {order.num_received} of {num_blocks * len(all_words)} blocks")
    return num_bytes


def copy_blocks(
    src_layers: Sequence[torch.Tensor],
    src_ids: Sequence[int],
    dst_layers: Sequence[torch.Tensor],
    dst_ids: Sequence[int],
    block_dim: int,
) -> int:
    """Copy blocks ``src_ids`` of every layer of ``src_layers`` into blocks ``dst_ids`` of the same
    layer of ``dst_layers`` (same shapes but for the number of blocks, same dtype); returns the bytes
    copied. Run by run, through the same integer views as the wire, so byte-exact for every dtype."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copying {len(src_ids)} blocks into {len(dst_ids)}")
    num_bytes = 0
    for src_cache, dst_cache in zip(src_layers, dst_layers, strict=True):
        src, dst = _as_words(src_cache), _as_words(dst_cache)
        num_bytes += _block_bytes(src, block_dim) * len(src_ids)
        pairs = _paired_runs(src_ids, dst_ids)
        if src.device.type == "cpu" and dst.device.type == "cpu":
            src_np, dst_np = src.numpy(), dst.numpy()
            for src_first, dst_first, length in pairs:
                dst_np[_cut(block_dim, dst_first, length)] = src_np[_cut(block_dim, src_first, length)]
            continue
        for src_first, dst_first, length in pairs:
            dst[_cut(block_dim, dst_first, length)].copy_(src[_cut(block_dim, src_first, length)])
    return num_bytes


def _paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, length) of the stretches where both sides'
    ids are consecutive."""
    out: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if out and src == out[-1][0] + out[-1][2] and dst == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((src, dst, 1))
    return out


class BlockWriter:
    """Writes a pull's chunks into one rank's blocks (the receiving side); built once over the paged
    cache, shared by every pull (it keeps no state between writes)."""

    def __init__(self, layers: Sequence[torch.Tensor], block_dim: int) -> None:
        self._block_dim = block_dim
        self._words = [_as_words(cache) for cache in layers]
        self.block_bytes = _block_bytes(self._words[0], block_dim) if layers else 0
        on_cpu = bool(layers) and self._words[0].device.type == "cpu"
        self._arrays: list[np.ndarray] | None = [words.numpy() for words in self._words] if on_cpu else None

    @property
    def num_layers(self) -> int:
        return len(self._words)

    def write_chunks(
        self, block_ids: Sequence[int], max_chunk_bytes: int, chunks: Iterable[bytes | memoryview]
    ) -> int:
        """Copy a pull's chunks (in wire order) into blocks ``block_ids`` of every layer's cache.
        Returns the bytes written; raises ``ValueError`` when a chunk's size or the number of chunks
        is not what the plan says (nothing of a chunk of the wrong size is written)."""
        if not self._words or not block_ids:
            return 0
        block_bytes = self.block_bytes
        plan = chunk_plan(len(self._words), len(block_ids), block_bytes, max_chunk_bytes)
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
                ids = _piece_ids(block_ids, piece)
                array = None if self._arrays is None else self._arrays[piece.layer_index]
                _write_piece(self._words[piece.layer_index], self._block_dim, ids, data, offset, array)
                offset += piece.num_blocks * block_bytes
            num_bytes += len(data)
        if next(received, None) is not None:
            raise ValueError(f"the KV server sent more than the {len(plan)} chunks planned")
        return num_bytes


def write_chunks(
    layers: Sequence[torch.Tensor],
    block_dim: int,
    block_ids: Sequence[int],
    max_chunk_bytes: int,
    chunks: Iterable[bytes],
) -> int:
    """Copy a pull's chunks (in wire order) into blocks ``block_ids`` of every layer's cache (see
    :meth:`BlockWriter.write_chunks`; a puller keeps one writer over its cache instead)."""
    return BlockWriter(layers, block_dim).write_chunks(block_ids, max_chunk_bytes, chunks)


def _write_piece(
    words: torch.Tensor,
    block_dim: int,
    ids: Sequence[int],
    data: bytes | memoryview,
    offset: int,
    array: np.ndarray | None = None,
) -> None:
    """Copy ``len(ids)`` blocks' bytes from ``data[offset:]`` into blocks ``ids`` of ``words``
    (``array``: its numpy view, where the caller keeps one)."""
    shape = list(words.shape)
    shape[block_dim] = len(ids)
    count = words.numel() // words.shape[block_dim] * len(ids)
    if words.device.type == "cpu":
        cache = words.numpy() if array is None else array
        values = np.frombuffer(data, dtype=cache.dtype, count=count, offset=offset).reshape(shape)
        for run in runs(ids):
            cache[_cut(block_dim, run.block, run.length)] = values[_cut(block_dim, run.offset, run.length)]
        return
    host = torch.frombuffer(data, dtype=words.dtype, count=count, offset=offset).view(shape)
    device_values = host.to(words.device)
    for run in runs(ids):
        words[_cut(block_dim, run.block, run.length)].copy_(device_values[_cut(block_dim, run.offset, run.length)])


def block_bytes_of(cache: torch.Tensor, block_dim: int) -> int:
    """The bytes of one block of one layer of ``cache``."""
    return _block_bytes(_as_words(cache), block_dim)


def staging_views(
    buffer: memoryview, like: torch.Tensor, num_layers: int, block_dim: int, num_blocks: int
) -> list[torch.Tensor]:
    """A prefetch's staging laid over ``buffer`` (a shared-memory segment): layer after layer, each a tensor
    of ``like``'s shape and dtype with its block dimension cut to ``num_blocks``, in C order. The one layout
    both sides of a stream through shared memory agree on (their layouts are checked alike first)."""
    shape = list(like.shape)
    shape[block_dim] = num_blocks
    count = like.numel() // like.shape[block_dim] * num_blocks
    layer_bytes = count * like.element_size()
    if len(buffer) < num_layers * layer_bytes:
        raise ValueError(f"a staging of {num_layers * layer_bytes} bytes in a buffer of {len(buffer)}")
    return [
        torch.frombuffer(buffer, dtype=like.dtype, count=count, offset=layer * layer_bytes).view(shape)
        for layer in range(num_layers)
    ]
