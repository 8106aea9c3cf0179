"""Which prefix-cache blocks each worker holds, from its engine's KV events.

:class:`tandem.router.kv_subscriber.KVEventSubscriber` applies every decoded
event with :meth:`KVIndex.apply` and drops a worker that left the registry
with :meth:`KVIndex.remove_worker`; :class:`tandem.router.policy.CacheAwarePolicy`
asks :meth:`KVIndex.match` how many leading blocks of a request each worker
has. Pure data structure, no I/O; used from the replica's event loop only.

Layout: every worker gets a bit; ``block hash → bitmask of the workers that
hold it`` answers a lookup with one dict probe per prompt block whatever the
number of workers, and ``worker → hashes in storage order`` lets a worker be
dropped at once and bounds memory: a worker never holds more than
``max_blocks_per_worker`` entries (the oldest are forgotten first; an exact
engine stays far below, since it cannot hold more blocks than its KV cache).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from tandem.common.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVIndex:
    def __init__(self, *, max_blocks_per_worker: int = 1 << 20) -> None:
        if max_blocks_per_worker <= 0:
            raise ValueError("max_blocks_per_worker must be positive")
        self._max_blocks_per_worker = max_blocks_per_worker
        self._bit_by_worker: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._workers_by_block: dict[int, int] = {}
        # Insertion-ordered: the first key is the block stored longest ago.
        self._blocks_by_worker: dict[str, dict[int, None]] = {}
        self._worker_by_bit: dict[int, str] = {}

    # -- updates ---------------------------------------------------------------

    def _bit(self, worker_id: str) -> int:
        bit = self._bit_by_worker.get(worker_id)
        if bit is None:
            index = self._free_bits.pop() if self._free_bits else self._next_bit
            if index == self._next_bit:
                self._next_bit += 1
            bit = 1 << index
            self._bit_by_worker[worker_id] = bit
            self._worker_by_bit[bit] = worker_id
            self._blocks_by_worker[worker_id] = {}
        return bit

    def apply(self, worker_id: str, event: KVEvent) -> None:
        """Apply one engine event from ``worker_id`` (offload tiers are ignored)."""
        if isinstance(event, BlockStored):
            if event.medium in (None, MEDIUM_GPU):
                self.store(worker_id, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            if event.medium in (None, MEDIUM_GPU):
                self.remove(worker_id, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.clear_worker(worker_id)

    def store(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        bit = self._bit(worker_id)
        blocks = self._blocks_by_worker[worker_id]
        by_block = self._workers_by_block
        for h in block_hashes:
            if h in blocks:
                del blocks[h]  # re-stored: now the newest
            else:
                by_block[h] = by_block.get(h, 0) | bit
            blocks[h] = None
        overflow = len(blocks) - self._max_blocks_per_worker
        if overflow > 0:
            oldest = [h for h, _ in zip(blocks, range(overflow), strict=False)]
            self.remove(worker_id, oldest)

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        bit = self._bit_by_worker.get(worker_id)
        if bit is None:
            return
        blocks = self._blocks_by_worker[worker_id]
        by_block = self._workers_by_block
        for h in block_hashes:
            if blocks.pop(h, 0) is None:  # it was there (values are None)
                mask = by_block.get(h, 0) & ~bit
                if mask:
                    by_block[h] = mask
                else:
                    by_block.pop(h, None)

    def clear_worker(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` but keep it known (AllBlocksCleared, resubscribe)."""
        if worker_id in self._blocks_by_worker:
            self.remove(worker_id, list(self._blocks_by_worker[worker_id]))

    def remove_worker(self, worker_id: str) -> None:
        """``worker_id`` left the registry: drop its entries and free its bit."""
        self.clear_worker(worker_id)
        bit = self._bit_by_worker.pop(worker_id, None)
        if bit is not None:
            self._blocks_by_worker.pop(worker_id, None)
            self._worker_by_bit.pop(bit, None)
            self._free_bits.append(bit.bit_length() - 1)

    # -- queries ---------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Workers holding at least the first block, with how many leading blocks each holds."""
        by_block = self._workers_by_block
        if not block_hashes:
            return {}
        alive = by_block.get(block_hashes[0], 0)
        result: dict[str, int] = {}
        num_matched = 0
        for h in block_hashes:
            still = alive & by_block.get(h, 0)
            ended = alive & ~still
            if ended:
                self._credit(ended, num_matched, result)
            alive = still
            if not alive:
                return result
            num_matched += 1
        self._credit(alive, num_matched, result)
        return result

    def _credit(self, mask: int, num_blocks: int, result: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            worker_id = self._worker_by_bit.get(low)
            if worker_id is not None and num_blocks:
                result[worker_id] = num_blocks
            mask ^= low

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks_by_worker.get(worker_id, ()))

    @property
    def num_workers(self) -> int:
        return len(self._bit_by_worker)

    @property
    def num_block_entries(self) -> int:
        """(worker, block) pairs indexed."""
        return sum(len(b) for b in self._blocks_by_worker.values())

    def workers(self) -> list[str]:
        return list(self._bit_by_worker)

    def approx_memory_bytes(self) -> int:
        """Rough size of the index's containers and keys (not counting shared small ints)."""
        size = sys.getsizeof(self._workers_by_block)
        size += sum(sys.getsizeof(h) + sys.getsizeof(m) for h, m in self._workers_by_block.items())
        size += sum(sys.getsizeof(b) for b in self._blocks_by_worker.values())
        return size
