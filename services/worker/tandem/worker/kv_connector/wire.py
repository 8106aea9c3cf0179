"""How KV blocks travel: the one place that turns cache blocks into bytes and back.

``tandem.v1.KVTransfer/PullBlockBytes`` is a server stream of raw bytes, not of
protobuf messages (protobuf would copy every chunk twice more on each side).
The request is a ``PullBlocksRequest``; each response message is the bytes of
one chunk, in the order :func:`chunk_plan` gives, which both sides compute from
the request alone, so no chunk carries a header:

* layer by layer; within a layer, runs of the requested blocks, as many per
  chunk as fit in ``max_chunk_bytes`` (at least one);
* a chunk's bytes are ``cache.index_select(block_dim, ids)`` in C order: the
  layer's cache tensor with its block dimension cut to the chunk's blocks (no
  reordering of dimensions on either side).

The server copies a chunk once when its blocks are consecutive in the cache
(a strided view written out as bytes) and twice otherwise (gather, then
bytes); the client copies each received message once, into the cache.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Final

import torch

#: Full name of the raw-bytes pull method (served by a generic handler; see the module doc).
PULL_METHOD: Final = "/tandem.v1.KVTransfer/PullBlockBytes"

# torch.frombuffer warns about read-only buffers (gRPC hands the client immutable bytes); the
# client only reads them, into the cache.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass(frozen=True)
class Chunk:
    layer_index: int
    #: Index into the requested block ids of the chunk's first block.
    first: int
    num_blocks: int


def blocks_per_chunk(block_bytes: int, max_chunk_bytes: int) -> int:
    return max(1, max_chunk_bytes // max(1, block_bytes))


def chunk_plan(num_layers: int, num_blocks: int, block_bytes: int, max_chunk_bytes: int) -> list[Chunk]:
    """The chunks of a pull of ``num_blocks`` blocks of every layer, in wire order."""
    per_chunk = blocks_per_chunk(block_bytes, max_chunk_bytes)
    return [
        Chunk(layer, first, min(per_chunk, num_blocks - first))
        for layer in range(num_layers)
        for first in range(0, num_blocks, per_chunk)
    ]


def _consecutive(ids: list[int]) -> bool:
    return all(b - a == 1 for a, b in itertools.pairwise(ids))


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` seen as uint8 (its last dimension times the element size): copies on this view
    are byte-exact for every dtype (fp8 included, which has no ``index_copy_`` of its own), and
    never touch the values (NaN payloads stay as they are)."""
    return cache.view(torch.uint8)


def read_blocks(cache: torch.Tensor, block_dim: int, ids: list[int]) -> bytes:
    """The bytes of blocks ``ids`` of one layer's ``cache`` (wire order)."""
    raw = _as_bytes(cache)
    if _consecutive(ids):
        part = raw.narrow(block_dim, ids[0], len(ids))
    else:
        part = raw.index_select(block_dim, torch.tensor(ids, dtype=torch.long))
    # tobytes() writes a strided view out in C order (one copy).
    data: bytes = part.numpy().tobytes()
    return data


def write_blocks(cache: torch.Tensor, block_dim: int, ids: list[int], data: bytes) -> None:
    """Copy one chunk's bytes into blocks ``ids`` of one layer's ``cache``."""
    raw = _as_bytes(cache)
    shape = list(raw.shape)
    shape[block_dim] = len(ids)
    expected = 1
    for d in shape:
        expected *= d
    if len(data) != expected:
        raise ValueError(f"a chunk of {len(ids)} blocks must be {expected} bytes, got {len(data)}")
    values = torch.frombuffer(data, dtype=torch.uint8).view(shape)
    if _consecutive(ids):
        raw.narrow(block_dim, ids[0], len(ids)).copy_(values)
    else:
        raw.index_copy_(block_dim, torch.tensor(ids, dtype=torch.long), values)
