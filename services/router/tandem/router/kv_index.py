"""Which prefix-cache blocks each worker holds, from its engine's KV events.

:class:`tandem.router.kv_follower.Follower` applies every decoded event with
:meth:`KVIndex.apply`, :class:`tandem.router.kv_subscriber.KVEventSubscriber`
drops a worker that left the registry with :meth:`KVIndex.remove_worker`
(:mod:`tandem.router.intake` does without a subscriber);
:class:`tandem.router.placement.Placer` asks :meth:`KVIndex.match_by_slot` how many
leading blocks of a request each worker has. The router benchmark reads
:attr:`KVIndex.num_block_entries` and :meth:`KVIndex.approx_memory_bytes`;
:meth:`KVIndex.entries_by_worker` lets two router replicas' indexes be
compared. Pure data structure, no I/O; used from the replica's event loop only.

Sized for 1,000 workers and 10 million (worker, block) entries at ~40 bytes
an entry (42.1 in the fleet benchmark, spare capacity included), so nothing is
a Python object per entry. Layout, in numpy arrays:

* Rows, one per distinct block hash, hold its key and up to three holders
  inline: a holder is a worker slot (uint16; slots start at 1, so zeroed
  memory means "none" and grown arrays need no fill; filled from the first)
  and when that worker stored the block (a uint32 stamp, one tick per stored
  entry: the age order that evicts a worker's oldest entries first). The key,
  the first two holders and the first stamp share 16 bytes (``_heads``, one
  cache line), which is all that the common cases touch; the third holder and
  the other stamps live apart (``_tail_holders``, ``_tail_stamps``). Most
  blocks have one to three holders; a row with more (a system prompt cached
  everywhere) keeps the rest in ``_overflow[row]``, its bitmask mirrored for
  the compiled lookup (:mod:`tandem.router.kv_holders`, which also finds the
  oldest entries). Free rows are chained through their keys, so row numbers
  stay put while the slot table is rebuilt.
* The slot table (:class:`tandem.router.kv_slot_table.SlotTable`) maps a
  hash to its row: open addressing with linear probing, each run sorted by
  home slot.

Every probe of the table is one compiled loop over a batch, written once
(:mod:`tandem.router.kv_kernels`, whose docstring has the figures): a lookup
(``match``, on every Schedule) finds a prompt's rows in one call and credits
every worker in another; a store finds or adds its batch's rows in one call,
a removal finds them in one and unlinks the emptied ones in another. The
holders are updated in Python through ``memoryview`` (a third of numpy's cost
per scalar, and they yield Python ints); bulk work (rebuilding the table, a
worker's removal, eviction, renumbering stamps, :meth:`KVIndex.entries_by_worker`)
is vectorized.

A worker never holds more than ``max_blocks_per_worker`` entries: the oldest
stored are forgotten first (an exact engine stays far below the bound, since
it cannot hold more blocks than its KV cache; a lossy event stream might
not). Finding a worker's oldest entries is a scan of the table, so each scan
queues the next-oldest ones for the evictions that follow.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from tandem.common.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tandem.router import kv_holders, kv_kernels
from tandem.router.kv_holders import OldestFirst, Overflow, OverflowBits
from tandem.router.kv_slot_table import MIN_SLOT_BITS, SlotTable, as_keys

_NO_WORKER = 0
_MAX_WORKER_SLOT = 0xFFFF
_MIN_ROWS = 512
#: Rows grow by a quarter: ~12% unused on average, for copying ~5x the rows over a lifetime.
_ROW_GROWTH = 1.25
#: Largest stamp a uint32 holds; past it stamps are renumbered by age.
_MAX_STAMP = (1 << 32) - 1
#: A scan for a worker's oldest entries queues a quarter of them (at most this many, 8 bytes each).
_MAX_EVICTION_QUEUE = 1 << 16


class KVIndex:
    """Block hash → the workers holding it, at most ``max_blocks_per_worker`` entries a worker.

    Not thread-safe: one event loop applies events and looks up, as the
    module docstring says; nothing here blocks or does I/O.
    """

    def __init__(self, *, max_blocks_per_worker: int = 1 << 20) -> None:
        if max_blocks_per_worker <= 0:
            raise ValueError("max_blocks_per_worker must be positive")
        self._max_blocks_per_worker = max_blocks_per_worker
        #: Entries forgotten because their worker went over ``max_blocks_per_worker``.
        self.num_evicted_over_bound = 0
        # Workers; insertion-ordered, so workers() lists them as first seen. Slot 0 is "no worker".
        self._slot_by_worker: dict[str, int] = {}
        self._worker_by_slot: list[str] = [""]  # "" for a free slot
        self._bit_by_slot: list[int] = [0]
        # Blocks held, by slot: an array (grown as slots are added), so a decision reads every worker's
        # count without converting a list (np.array of a 1,001-element list: ~50 µs per decision).
        self._num_blocks_by_slot = np.zeros(64, np.int64)
        self._free_slots: list[int] = []
        self._slots_version = 0
        self._num_entries = 0
        # Rows.
        self._num_rows = 0  # rows at or past this were never used
        self._num_live_rows = 0
        self._free_row = -1  # head of the free rows, chained through their keys as next + 1
        self._num_free_rows = 0
        #: Per row: the key, then holders 0 and 1 (uint16 each) and stamp 0 (uint32) in the second word.
        self._heads: npt.NDArray[np.uint64] = np.zeros((_MIN_ROWS, 2), np.uint64)
        self._tail_holders: npt.NDArray[np.uint16] = np.zeros(_MIN_ROWS, np.uint16)  # holder 2
        self._tail_stamps: npt.NDArray[np.uint32] = np.zeros((_MIN_ROWS, 2), np.uint32)  # stamps 1 and 2
        self._overflow: dict[int, Overflow] = {}
        # The overflow rows' holder bitmasks for the compiled lookup: per row, 0 or 1 + its bitset's row.
        self._overflow_of_row: npt.NDArray[np.int32] = np.zeros(_MIN_ROWS, np.int32)
        self._overflow_bits = OverflowBits()
        self._next_stamp = 0
        self._max_stamp = _MAX_STAMP  # a test lowers it to exercise renumbering
        self._oldest: dict[int, OldestFirst] = {}
        self._table = SlotTable()
        self._refresh_views()

    def _refresh_views(self) -> None:
        heads16, heads32 = self._heads.view(np.uint16), self._heads.view(np.uint32)
        self._keys = self._heads[:, 0]
        self._holder_columns = (heads16[:, 4], heads16[:, 5], self._tail_holders)
        self._stamp_columns = (heads32[:, 3], self._tail_stamps[:, 0], self._tail_stamps[:, 1])
        # ndarray.data is a memoryview of the array (strided for a column).
        self._key_view = self._keys.data
        self._holder_views = tuple(column.data for column in self._holder_columns)
        self._stamp_views = tuple(column.data for column in self._stamp_columns)

    # -- updates ---------------------------------------------------------------

    def _slot(self, worker_id: str) -> int:
        w = self._slot_by_worker.get(worker_id)
        if w is None:
            if self._free_slots:
                w = self._free_slots.pop()
            else:
                w = len(self._worker_by_slot)
                if w > _MAX_WORKER_SLOT:
                    raise ValueError(f"KVIndex holds at most {_MAX_WORKER_SLOT} workers")
                self._worker_by_slot.append("")
                self._bit_by_slot.append(1 << w)
                if w >= self._overflow_bits.num_slots:
                    self._overflow_bits.widen()
                if w >= len(self._num_blocks_by_slot):
                    self._num_blocks_by_slot = np.concatenate(
                        (self._num_blocks_by_slot, np.zeros(len(self._num_blocks_by_slot), np.int64))
                    )
            self._slot_by_worker[worker_id] = w
            self._worker_by_slot[w] = worker_id
            self._slots_version += 1
        return w

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
        """``worker_id`` cached these blocks, oldest first; storing one again makes it the newest.

        Raises ValueError for a hash outside [0, 2**64) (the blocks before it are stored).
        """
        w = self._slot(worker_id)
        hashes, refused = as_keys(block_hashes)
        if len(hashes):
            self._hold(w, self._rows_of(hashes).tolist())
        if refused is not None:
            raise ValueError(f"block hash {refused} is not a 64-bit unsigned int")

    def _rows_of(self, hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.int32]:
        """The rows of ``hashes``, with new ones (holding nobody yet) for those the index lacks."""
        rows_out = np.empty(len(hashes), np.int32)
        rows = np.array([self._free_row, self._num_rows, self._num_live_rows, len(self._heads), 0], np.int64)
        done = 0
        while True:
            done = self._table.find_or_add(self._keys, hashes, rows_out, done, rows)
            free_row, num_rows, num_live_rows = rows[:3].tolist()
            self._num_free_rows -= (num_live_rows - self._num_live_rows) - (num_rows - self._num_rows)
            self._free_row, self._num_rows, self._num_live_rows = free_row, num_rows, num_live_rows
            if done == len(hashes):
                return rows_out
            self._resize_rows(int(len(self._heads) * _ROW_GROWTH), slice(self._num_rows))
            rows[kv_kernels.ROW_CAPACITY] = len(self._heads)

    def _hold(self, w: int, rows: list[int]) -> None:
        """Worker slot ``w`` holds ``rows``, the last the newest; then it is cut back to its bound."""
        h0, h1, h2 = self._holder_views
        s0, s1, s2 = self._stamp_views
        bits, overflow, bit = self._bit_by_slot, self._overflow, self._bit_by_slot[w]
        sync_bits = self._overflow_bits.sync
        stamp, max_stamp = self._next_stamp, self._max_stamp
        num_new = 0
        try:
            for r in rows:
                if stamp > max_stamp:
                    self._next_stamp = stamp
                    self._renumber_stamps()
                    stamp = self._next_stamp
                if (a := h0[r]) == w:
                    s0[r] = stamp
                elif not a:  # a new row
                    h0[r] = w
                    s0[r] = stamp
                    num_new += 1
                elif (b := h1[r]) == w:
                    s1[r] = stamp
                elif not b:
                    h1[r] = w
                    s1[r] = stamp
                    num_new += 1
                elif (c := h2[r]) == w:
                    s2[r] = stamp
                elif not c:
                    h2[r] = w
                    s2[r] = stamp
                    num_new += 1
                else:
                    extra = overflow.get(r)
                    if extra is None:
                        extra = overflow[r] = self._overflow_bits.new(bits[a] | bits[b] | bits[c])
                        self._overflow_of_row[r] = extra.bits_row + 1
                    if extra.mask >> w & 1:
                        extra.stamps[extra.slots.index(w)] = stamp
                    else:
                        extra.slots.append(w)
                        extra.stamps.append(stamp)
                        extra.mask |= bit
                        sync_bits(extra)
                        num_new += 1
                stamp += 1
        finally:
            self._next_stamp = stamp
            self._num_blocks_by_slot[w] += num_new
            self._num_entries += num_new
        over = int(self._num_blocks_by_slot[w]) - self._max_blocks_per_worker
        if over > 0:
            self._evict_oldest(w, over)

    def _resize_rows(self, num_rows: int, kept: slice | npt.NDArray[np.int32]) -> None:
        """The row arrays ``num_rows`` long, their first rows the old arrays' ``kept`` rows, the rest
        zeroed (fresh pages: no memory until used)."""
        resized = []
        for old in (self._heads, self._tail_holders, self._tail_stamps, self._overflow_of_row):
            new = np.zeros((num_rows, *old.shape[1:]), old.dtype)
            taken = old[kept]
            new[: len(taken)] = taken
            resized.append(new)
        self._heads, self._tail_holders, self._tail_stamps, self._overflow_of_row = resized
        self._refresh_views()

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """``worker_id`` evicted these blocks; unknown workers and blocks are ignored."""
        w = self._slot_by_worker.get(worker_id)
        if w is None:
            return
        hashes = as_keys(block_hashes, skip_refused=True)[0]  # a refused hash was never stored
        if not len(hashes) or not self._num_entries:
            return
        rows = np.empty(len(hashes), np.int32)
        self._table.find(self._keys, hashes, rows, stop_at_missing=False)
        drop_entry = self._drop_entry
        self._free_rows([r for r in rows.tolist() if r >= 0 and drop_entry(r, w)])
        self._maybe_shrink()

    def _drop_entry(self, row: int, w: int) -> bool:
        """Take worker slot ``w`` off ``row`` (nothing if it does not hold it); True if that left the
        row without holders (the caller frees it with :meth:`_free_rows`)."""
        holders, stamps = self._holder_views, self._stamp_views
        h0, h1, h2 = holders
        if h0[row] == w and not h1[row]:  # its only holder (they are packed)
            h0[row] = _NO_WORKER
            self._num_blocks_by_slot[w] -= 1
            self._num_entries -= 1
            return True
        j = 0 if h0[row] == w else 1 if h1[row] == w else 2 if h2[row] == w else -1
        extra = self._overflow.get(row) if h2[row] else None
        if j < 0:
            if extra is None or not extra.mask >> w & 1:
                return False
            p = extra.slots.index(w)
            extra.slots[p] = extra.slots[-1]
            extra.stamps[p] = extra.stamps[-1]
            extra.slots.pop()
            extra.stamps.pop()
            extra.mask ^= self._bit_by_slot[w]
            self._overflow_bits.sync(extra)
        elif extra is not None:  # an overflow holder moves inline
            holders[j][row] = extra.slots.pop()
            stamps[j][row] = extra.stamps.pop()
            extra.mask ^= self._bit_by_slot[w]
            self._overflow_bits.sync(extra)
        else:  # keep the inline holders packed from the first
            end = 2 if h2[row] else 1
            if end != j:
                holders[j][row] = holders[end][row]
                stamps[j][row] = stamps[end][row]
            holders[end][row] = _NO_WORKER
        if extra is not None and not extra.slots:
            del self._overflow[row]
            self._overflow_of_row[row] = 0
            self._overflow_bits.give_back(extra)
        self._num_blocks_by_slot[w] -= 1
        self._num_entries -= 1
        return False

    def _free_rows(self, rows: list[int]) -> None:
        """``rows``, which hold nobody any more, leave the table and join the free rows."""
        if not rows:
            return
        self._table.unlink(self._keys, np.array(rows, np.int32))
        key_view, free_row = self._key_view, self._free_row
        for r in rows:
            key_view[r] = free_row + 1
            free_row = r
        self._free_row = free_row
        self._num_free_rows += len(rows)
        self._num_live_rows -= len(rows)

    def _evict_oldest(self, w: int, num_entries: int) -> None:
        emptied = []
        while num_entries > 0:
            queue = self._oldest.get(w)
            if queue is None or queue.next == len(queue.rows):
                num_queued = max(num_entries, min(int(self._num_blocks_by_slot[w]) // 4, _MAX_EVICTION_QUEUE))
                queue = self._oldest[w] = kv_holders.find_oldest(
                    self._holder_columns, self._stamp_columns, self._overflow, self._num_rows, w, num_queued
                )
            row, stamp = int(queue.rows[queue.next]), int(queue.stamps[queue.next])
            queue.next += 1
            if kv_holders.stamp_of(self._holder_views, self._stamp_views, self._overflow, row, w) == stamp:
                if self._drop_entry(row, w):
                    emptied.append(row)
                self.num_evicted_over_bound += 1
                num_entries -= 1
        self._free_rows(emptied)

    def _renumber_stamps(self) -> None:
        self._next_stamp = kv_holders.renumber_stamps(
            self._holder_columns, self._stamp_columns, self._overflow, self._num_rows
        )
        self._oldest.clear()

    def clear_worker(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` but keep it known (AllBlocksCleared, resubscribe)."""
        w = self._slot_by_worker.get(worker_id)
        if w is None:
            return
        self._oldest.pop(w, None)
        if self._num_blocks_by_slot[w]:
            rows = np.concatenate(kv_holders.inline_rows(self._holder_columns, self._num_rows, w)).tolist()
            rows += kv_holders.overflow_rows(self._overflow, w)
            drop_entry = self._drop_entry
            self._free_rows([r for r in rows if drop_entry(r, w)])
            self._maybe_shrink()

    def remove_worker(self, worker_id: str) -> None:
        """``worker_id`` left the registry: drop its entries and free its slot."""
        self.clear_worker(worker_id)
        w = self._slot_by_worker.pop(worker_id, None)
        if w is not None:
            self._worker_by_slot[w] = ""
            self._free_slots.append(w)  # no row mentions w any more
            self._slots_version += 1

    def _maybe_shrink(self) -> None:
        live, table = self._num_live_rows, self._table
        if (len(self._heads) > _MIN_ROWS and live * 4 < len(self._heads)) or (
            table.slot_bits > MIN_SLOT_BITS and live < table.max_live_rows // 8
        ):
            self._compact()

    def _compact(self) -> None:
        """Renumber the live rows from 0 in slot order and size the arrays and the table to them."""
        n = self._num_live_rows
        slot_bits = self._table.slot_bits_for(n)
        old_rows, keys = self._table.rows_by_home(self._keys, slot_bits)
        self._resize_rows(max(_MIN_ROWS, 2 * n), old_rows)
        if self._overflow:
            new_row = np.empty(self._num_rows, np.int64)
            new_row[old_rows] = np.arange(n)
            self._overflow = {int(new_row[r]): extra for r, extra in self._overflow.items()}
        self._overflow_bits.compact(self._overflow, self._overflow_of_row)
        self._num_rows, self._free_row, self._num_free_rows = n, -1, 0
        self._oldest.clear()
        self._table.place(np.arange(n, dtype=np.int32), keys, slot_bits)

    # -- queries ---------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Workers holding at least the first block, with how many leading blocks each holds.

        Stops at the first block that no worker still matching holds, so a
        lookup costs the matched prefix, not the prompt.
        """
        by_slot = self.match_by_slot(block_hashes)
        held = np.flatnonzero(by_slot)
        names = self._worker_by_slot
        return {names[w]: n for w, n in zip(held.tolist(), by_slot[held].tolist(), strict=True)}

    def match_by_slot(self, block_hashes: Sequence[int]) -> npt.NDArray[np.int64]:
        """:meth:`match` as an array indexed by worker slot (:meth:`slot_of`): leading blocks held,
        0 for workers holding none. Two compiled calls, whatever the number of holders: a prompt whose
        system prompt every worker holds credits a thousand workers at once."""
        out = np.zeros(len(self._worker_by_slot), np.int64)
        if not block_hashes or not self._num_entries:
            return out
        hashes = as_keys(block_hashes)[0]
        found = np.empty(len(hashes), np.int32)
        # Every block's row at once; a block the index lacks ends the match there.
        num_found = self._table.find(self._keys, hashes, found, stop_at_missing=True)
        if num_found:
            h0, h1, h2 = self._holder_columns
            bits = self._overflow_bits
            kv_kernels.match_slots(
                found, num_found, h0, h1, h2, self._overflow_of_row, bits.bits, bits.alive, bits.held, out,
            )  # fmt: skip
        return out

    def num_blocks(self, worker_id: str) -> int:
        w = self._slot_by_worker.get(worker_id)
        return 0 if w is None else int(self._num_blocks_by_slot[w])

    def slot_of(self, worker_id: str) -> int:
        """The worker's slot in :meth:`match_by_slot` and :meth:`num_blocks_by_slot` (0: not indexed;
        slot 0 holds nothing). A slot is reused only after its worker was removed: compare
        :attr:`slots_version` to know when to read the slots again."""
        return self._slot_by_worker.get(worker_id, 0)

    @property
    def slots_version(self) -> int:
        """Changes whenever a worker gets or loses a slot."""
        return self._slots_version

    def num_blocks_by_slot(self) -> npt.NDArray[np.int64]:
        """:meth:`num_blocks` of every slot at once."""
        return self._num_blocks_by_slot[: len(self._worker_by_slot)].copy()

    @property
    def num_workers(self) -> int:
        return len(self._slot_by_worker)

    @property
    def num_block_entries(self) -> int:
        """(worker, block) pairs indexed."""
        return self._num_entries

    def workers(self) -> list[str]:
        return list(self._slot_by_worker)

    def entries_by_worker(self) -> dict[str, npt.NDArray[np.uint64]]:
        """Every known worker's block hashes, sorted (to compare router replicas' indexes)."""
        keys = self._keys[: self._num_rows]
        worker_slots: list[npt.NDArray[np.uint16]] = []
        hashes: list[npt.NDArray[np.uint64]] = []
        for column in self._holder_columns:
            held = column[: self._num_rows]
            rows = np.flatnonzero(held)
            worker_slots.append(held[rows])
            hashes.append(keys[rows])
        for row, extra in self._overflow.items():
            worker_slots.append(np.array(extra.slots, np.uint16))
            hashes.append(np.full(len(extra.slots), self._key_view[row], np.uint64))
        all_slots = np.concatenate(worker_slots)
        grouped = np.concatenate(hashes)[np.argsort(all_slots, kind="stable")]  # a radix sort: uint16
        ends = np.cumsum(np.bincount(all_slots, minlength=len(self._worker_by_slot)))
        return {worker_id: np.sort(grouped[ends[w - 1] : ends[w]]) for worker_id, w in self._slot_by_worker.items()}

    def approx_memory_bytes(self) -> int:
        """Bytes the index holds: its arrays, and the Python containers and objects it keeps."""
        size = self._heads.nbytes + self._tail_holders.nbytes + self._tail_stamps.nbytes + self._table.nbytes
        size += self._overflow_of_row.nbytes + self._overflow_bits.nbytes()
        views = (self._key_view, *self._holder_views, *self._stamp_views)
        size += sum(sys.getsizeof(v) for v in views)
        size += sys.getsizeof(self._overflow)
        size += sum(sys.getsizeof(row) + extra.nbytes() for row, extra in self._overflow.items())
        size += sys.getsizeof(self._oldest) + sum(queue.nbytes() for queue in self._oldest.values())
        size += sys.getsizeof(self._slot_by_worker) + sum(sys.getsizeof(w) for w in self._slot_by_worker)
        size += self._num_blocks_by_slot.nbytes
        for per_slot in (self._worker_by_slot, self._bit_by_slot, self._free_slots):
            size += sys.getsizeof(per_slot) + sum(sys.getsizeof(v) for v in per_slot)
        return size
