"""Which prefix-cache blocks each worker holds, from its engine's KV events.

:class:`tandem.router.kv_subscriber.KVEventSubscriber` applies every decoded
event with :meth:`KVIndex.apply` and drops a worker that left the registry
with :meth:`KVIndex.remove_worker`; :class:`tandem.router.scheduler.Scheduler`
asks :meth:`KVIndex.match` how many leading blocks of a request each worker
has and drops workers it no longer sees. The router benchmark reads
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
  everywhere) keeps the rest in ``_overflow[row]`` with a bitmask of all its
  holders, mirrored for the compiled lookup as a row of ``_overflow_bits``
  (one bit per worker slot) that ``_overflow_of_row`` points to (4 bytes a
  row). Free rows are chained through their keys, so row numbers stay put
  while the slot table is rebuilt.
* The slot table ``_slots`` maps a hash to its row: open addressing with
  linear probing, home slot = the hash's low bits (block hashes are digests,
  so their bits are uniform; other keys work, clustered ones only slowly).
  Each run is kept sorted by home slot (linear probing's "ordered" variant),
  so a lookup stops at the first row homed past its own, a deletion shifts
  the run back instead of leaving a tombstone, and doubling the table needs
  no sort: the rows in slot order, split by one more bit, are in order for
  the larger table. The table doubles past 0.7 load; it has spare slots past
  the last home instead of wrapping around, and its last slot always stays
  empty so that every probe ends.

A lookup (``match``, ``match_by_slot``) is on every Schedule: it probes all of
a prompt's blocks in one compiled call (:func:`tandem.router.kv_kernels.find_rows`)
and credits every worker in another (:func:`tandem.router.kv_kernels.match_slots`:
one bitset of the workers still matching, narrowed row by row). The updates
(``store``, ``remove``) index the arrays through ``memoryview`` (a third of
numpy's cost per scalar, and they yield Python ints); bulk work (rebuilding the
table, a worker's removal, eviction, renumbering stamps,
:meth:`KVIndex.entries_by_worker`) is vectorized.

A worker never holds more than ``max_blocks_per_worker`` entries: the oldest
stored are forgotten first (an exact engine stays far below the bound, since
it cannot hold more blocks than its KV cache; a lossy event stream might
not). Finding a worker's oldest entries is a scan of the table, so each scan
queues the next-oldest ones for the evictions that follow.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from tandem.common.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tandem.router import kv_kernels

_NO_WORKER = 0
_MAX_WORKER_SLOT = 0xFFFF
_EMPTY = -1
_MIN_SLOT_BITS = 10
#: Spare slots past the last home slot, so probes never wrap around; a run
#: that would reach the end (odds ~1e-6 at 0.7 load) gets twice as many.
_PAD_SLOTS = 256
#: Linear probing slows sharply past 0.7 load: the table doubles there.
_MAX_LOAD = 0.7
_MIN_ROWS = 512
#: Rows grow by a quarter: ~12% unused on average, for copying ~5x the rows over a lifetime.
_ROW_GROWTH = 1.25
#: Largest stamp a uint32 holds; past it stamps are renumbered by age.
_MAX_STAMP = (1 << 32) - 1
#: Rows compared per numpy call in scans: keeps temporaries small.
_SCAN_CHUNK_ROWS = 1 << 20
#: A scan for a worker's oldest entries queues a quarter of them (at most this many, 8 bytes each).
_MAX_EVICTION_QUEUE = 1 << 16
#: Overflow rows' bitsets grow by doubling from this many.
_MIN_OVERFLOW_ROWS = 16


def _place_run(
    table: npt.NDArray[np.int32], rows: npt.NDArray[np.int32], homes: npt.NDArray[np.int64], next_free: int
) -> int:
    """Put ``rows`` (sorted by home slot, ``homes``, which is overwritten) in ``table`` as inserting
    them in order would, none before ``next_free``; the slot after the last, or past the table's
    end (and nothing put) if they would not fit before its last slot."""
    if not len(rows) or next_free >= len(table):
        return next_free
    index = np.arange(len(rows), dtype=np.int64)
    # Each row lands at its home or just past the one before it, whichever is later.
    positions = homes
    positions -= index
    np.maximum.accumulate(positions, out=positions)
    np.maximum(positions, next_free, out=positions)
    positions += index
    if positions[-1] >= len(table) - 1:
        return len(table)
    table[positions] = rows
    return int(positions[-1]) + 1


def _leading_u64(block_hashes: Sequence[int]) -> npt.NDArray[np.uint64]:
    """``block_hashes`` as uint64, up to the first that is not a 64-bit unsigned int (never stored,
    so no match goes past it)."""
    try:
        return np.fromiter(block_hashes, np.uint64, len(block_hashes))
    except OverflowError:
        end = next(i for i, h in enumerate(block_hashes) if not 0 <= h < 1 << 64)
        return np.fromiter(block_hashes[:end], np.uint64, end)


class _Overflow:
    """A row's holders beyond the three inline ones, and the bitmask of all its holders."""

    __slots__ = ("bits_row", "mask", "slots", "stamps")

    def __init__(self, mask: int, bits_row: int) -> None:
        self.mask = mask
        #: Its row in ``KVIndex._overflow_bits``.
        self.bits_row = bits_row
        self.slots: array[int] = array("H")
        self.stamps: array[int] = array("I")

    def nbytes(self) -> int:
        return sys.getsizeof(self) + sys.getsizeof(self.mask) + sys.getsizeof(self.slots) + sys.getsizeof(self.stamps)


class _OldestFirst:
    """One worker's oldest entries when the table was last scanned, oldest first.

    Valid while stamps and row numbers are: whatever the worker stores later
    is newer, so the first entry here that it still holds with that stamp is
    its oldest (one removed or stored again since no longer matches).
    """

    __slots__ = ("next", "rows", "stamps")

    def __init__(self, rows: npt.NDArray[np.int32], stamps: npt.NDArray[np.uint32]) -> None:
        self.rows = rows
        self.stamps = stamps
        self.next = 0

    def nbytes(self) -> int:
        return sys.getsizeof(self) + self.rows.nbytes + self.stamps.nbytes


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
        self._overflow: dict[int, _Overflow] = {}
        # The overflow rows' holder bitmasks for the compiled lookup: per row, 0 or 1 + its bitset's row.
        self._overflow_of_row: npt.NDArray[np.int32] = np.zeros(_MIN_ROWS, np.int32)
        self._overflow_bits: npt.NDArray[np.uint64] = np.zeros((_MIN_OVERFLOW_ROWS, 1), np.uint64)
        self._free_bits_rows: list[int] = list(range(_MIN_OVERFLOW_ROWS - 1, -1, -1))
        self._alive_bits = np.zeros(1, np.uint64)  # the lookup's scratch bitsets
        self._held_bits = np.zeros(1, np.uint64)
        self._next_stamp = 0
        self._max_stamp = _MAX_STAMP  # a test lowers it to exercise renumbering
        self._oldest: dict[int, _OldestFirst] = {}
        # Slot table.
        self._slot_bits = _MIN_SLOT_BITS
        self._slots: npt.NDArray[np.int32] = np.full((1 << _MIN_SLOT_BITS) + _PAD_SLOTS, _EMPTY, np.int32)
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
        self._slot_view = self._slots.data
        self._home_mask = (1 << self._slot_bits) - 1
        self._max_live_rows = int((1 << self._slot_bits) * _MAX_LOAD)

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
                if w >= 64 * self._overflow_bits.shape[1]:
                    self._widen_overflow_bits()
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
        slots, keys, home_mask, last_slot = self._slot_view, self._key_view, self._home_mask, len(self._slots) - 1
        h0, h1, h2 = self._holder_views
        s0, s1, s2 = self._stamp_views
        bits, overflow, bit = self._bit_by_slot, self._overflow, self._bit_by_slot[w]
        stamp, max_stamp = self._next_stamp, self._max_stamp
        num_new = 0
        try:
            for h in block_hashes:
                if stamp > max_stamp:
                    self._next_stamp = stamp
                    self._renumber_stamps()
                    stamp = self._next_stamp
                home = h & home_mask
                i = home
                while True:
                    r = slots[i]
                    if r < 0:
                        break
                    k = keys[r]
                    if k == h:
                        break
                    if k & home_mask > home:
                        r = -1
                        break
                    i += 1
                if r >= 0:
                    if h0[r] == w:
                        s0[r] = stamp
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
                            extra = overflow[r] = self._new_overflow(r, bits[h0[r]] | bits[b] | bits[c])
                        if extra.mask >> w & 1:
                            extra.stamps[extra.slots.index(w)] = stamp
                        else:
                            extra.slots.append(w)
                            extra.stamps.append(stamp)
                            extra.mask |= bit
                            self._sync_overflow_bits(extra)
                            num_new += 1
                else:
                    if h >> 64:  # also true for a negative h
                        raise ValueError(f"block hash {h} is not a 64-bit unsigned int")
                    if self._num_live_rows >= self._max_live_rows:
                        self._rebuild_slots(self._slot_bits + 1)
                        slots, home_mask, last_slot = self._slot_view, self._home_mask, len(self._slots) - 1
                        i = self._insertion_slot(h)
                    # A new row at i, after the rows of the same home: the rest of the run moves one slot right.
                    j = i
                    while slots[j] >= 0:
                        j += 1
                    while j == last_slot:  # the run reached the end: more room there
                        self._rebuild_slots(self._slot_bits, 2 * (len(self._slots) - (1 << self._slot_bits)))
                        slots, last_slot = self._slot_view, len(self._slots) - 1
                        i = j = self._insertion_slot(h)
                        while slots[j] >= 0:
                            j += 1
                    if j > i:
                        slots[i + 1 : j + 1] = slots[i:j]
                    r = self._free_row
                    if r >= 0:
                        self._free_row = keys[r] - 1
                        self._num_free_rows -= 1
                    else:
                        r = self._num_rows
                        if r == len(self._heads):
                            self._grow_rows(int(r * _ROW_GROWTH))
                            keys, slots = self._key_view, self._slot_view
                            h0, h1, h2 = self._holder_views
                            s0, s1, s2 = self._stamp_views
                        self._num_rows = r + 1
                    keys[r] = h
                    h0[r] = w
                    s0[r] = stamp
                    slots[i] = r
                    self._num_live_rows += 1
                    num_new += 1
                stamp += 1
        finally:
            self._next_stamp = stamp
            self._num_blocks_by_slot[w] += num_new
            self._num_entries += num_new
        over = int(self._num_blocks_by_slot[w]) - self._max_blocks_per_worker
        if over > 0:
            self._evict_oldest(w, over)

    def _grow_rows(self, num_rows: int) -> None:
        used = self._num_rows
        heads = np.zeros((num_rows, 2), np.uint64)  # zeroed pages: no memory until used
        heads[:used] = self._heads[:used]
        tail_holders = np.zeros(num_rows, np.uint16)
        tail_holders[:used] = self._tail_holders[:used]
        tail_stamps = np.zeros((num_rows, 2), np.uint32)
        tail_stamps[:used] = self._tail_stamps[:used]
        overflow_of_row = np.zeros(num_rows, np.int32)
        overflow_of_row[:used] = self._overflow_of_row[:used]
        self._heads, self._tail_holders, self._tail_stamps = heads, tail_holders, tail_stamps
        self._overflow_of_row = overflow_of_row
        self._refresh_views()

    def _new_overflow(self, row: int, mask: int) -> _Overflow:
        """``row``'s overflow, holding ``mask``'s workers, with a bitset row of its own."""
        if not self._free_bits_rows:
            used = len(self._overflow_bits)
            grown = np.zeros((2 * used, self._overflow_bits.shape[1]), np.uint64)
            grown[:used] = self._overflow_bits
            self._overflow_bits = grown
            self._free_bits_rows.extend(range(2 * used - 1, used - 1, -1))
        extra = _Overflow(mask, self._free_bits_rows.pop())
        self._overflow_of_row[row] = extra.bits_row + 1
        self._sync_overflow_bits(extra)
        return extra

    def _sync_overflow_bits(self, extra: _Overflow) -> None:
        """Copy ``extra``'s holder mask into its bitset row."""
        num_words = self._overflow_bits.shape[1]
        self._overflow_bits[extra.bits_row] = np.frombuffer(extra.mask.to_bytes(8 * num_words, "little"), np.uint64)

    def _widen_overflow_bits(self) -> None:
        """Twice as many bits per overflow row (a new worker slot past the last word)."""
        old_words = self._overflow_bits.shape[1]
        wider = np.zeros((len(self._overflow_bits), 2 * old_words), np.uint64)
        wider[:, :old_words] = self._overflow_bits
        self._overflow_bits = wider
        self._alive_bits = np.zeros(2 * old_words, np.uint64)
        self._held_bits = np.zeros(2 * old_words, np.uint64)

    def _rows_by_home(self, slot_bits: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint64]]:
        """The live rows and their keys, sorted by home slot in a table of ``2**slot_bits`` home slots."""
        table = self._slots
        rows = table[table >= 0]  # sorted by home in the current table
        keys = self._keys[rows]
        if slot_bits != self._slot_bits:  # shrinking (or see _double_slots): timsort merges the presorted runs
            order = np.argsort(keys & np.uint64((1 << slot_bits) - 1), kind="stable")
            return rows[order], keys[order]
        return rows, keys

    def _rebuild_slots(self, slot_bits: int, num_pad_slots: int = _PAD_SLOTS) -> None:
        """A table of ``2**slot_bits`` home slots holding the live rows (row numbers unchanged)."""
        if slot_bits == self._slot_bits + 1 and num_pad_slots == _PAD_SLOTS and self._double_slots():
            return
        rows, keys = self._rows_by_home(slot_bits)
        self._place(rows, keys, slot_bits, num_pad_slots)

    def _double_slots(self) -> bool:
        """:meth:`_place` into a table twice as large, a chunk of the old one at a time: small
        temporaries, since growing a large table pauses the event loop. False if the last run
        would not fit before the end."""
        old_bits, old_table = self._slot_bits, self._slots
        table = np.full((2 << old_bits) + _PAD_SLOTS, _EMPTY, np.int32)
        home_mask, new_bit = np.uint64((2 << old_bits) - 1), np.uint64(1 << old_bits)
        next_free = 0
        # The rows whose new bit is 0 come first, in order (placed as found), then the others.
        upper_half: list[tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]] = []
        for a in range(0, len(old_table), _SCAN_CHUNK_ROWS):
            rows = old_table[a : a + _SCAN_CHUNK_ROWS]
            rows = rows[rows >= 0]
            keys = self._keys[rows]
            upper = (keys & new_bit) != 0
            upper_half.append((rows[upper], (keys[upper] & home_mask).view(np.int64)))
            lower = ~upper
            next_free = _place_run(table, rows[lower], (keys[lower] & home_mask).view(np.int64), next_free)
        for rows, homes in upper_half:
            next_free = _place_run(table, rows, homes, next_free)
        if next_free >= len(table):
            return False
        self._slots, self._slot_bits = table, old_bits + 1
        self._refresh_views()
        return True

    def _place(
        self,
        rows: npt.NDArray[np.int32],
        keys: npt.NDArray[np.uint64],
        slot_bits: int,
        num_pad_slots: int = _PAD_SLOTS,
    ) -> None:
        """Fill a new table with ``rows`` (sorted by home slot), the way inserting them in order would."""
        n = len(rows)
        index = np.arange(n, dtype=np.int64)
        positions = (keys & np.uint64((1 << slot_bits) - 1)).view(np.int64)  # the homes, a new array
        # Each row lands at its home or just past the one before it, whichever is later.
        positions -= index
        np.maximum.accumulate(positions, out=positions)
        positions += index
        # Longer past the end only where the last run needs it (keys crowding the top home slots).
        num_slots = max((1 << slot_bits) + num_pad_slots, int(positions[-1]) + 2 if n else 0)
        table = np.full(num_slots, _EMPTY, np.int32)
        table[positions] = rows
        self._slots, self._slot_bits = table, slot_bits
        self._refresh_views()

    def _insertion_slot(self, h: int) -> int:
        slots, keys, home_mask = self._slot_view, self._key_view, self._home_mask
        home = i = h & home_mask
        while (r := slots[i]) >= 0 and keys[r] & home_mask <= home:
            i += 1
        return i

    def _slot_of_row(self, row: int) -> int:
        slots = self._slot_view
        i = self._key_view[row] & self._home_mask
        while slots[i] != row:
            i += 1
        return i

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """``worker_id`` evicted these blocks; unknown workers and blocks are ignored."""
        w = self._slot_by_worker.get(worker_id)
        if w is None:
            return
        slots, keys, home_mask = self._slot_view, self._key_view, self._home_mask
        h0, h1, _ = self._holder_views
        num_freed = 0
        try:
            for h in block_hashes:
                home = h & home_mask
                i = home
                while True:
                    r = slots[i]
                    if r < 0:
                        break
                    k = keys[r]
                    if k == h:
                        if h0[r] == w and not h1[r]:  # its only holder (they are packed): the row goes
                            h0[r] = _NO_WORKER
                            j = i + 1
                            while (q := slots[j]) >= 0 and keys[q] & home_mask < j:
                                slots[j - 1] = q
                                j += 1
                            slots[j - 1] = _EMPTY
                            keys[r] = self._free_row + 1
                            self._free_row = r
                            num_freed += 1
                        else:
                            self._release(r, w, i)
                        break
                    if k & home_mask > home:
                        break
                    i += 1
        finally:
            self._num_blocks_by_slot[w] -= num_freed
            self._num_entries -= num_freed
            self._num_free_rows += num_freed
            self._num_live_rows -= num_freed
        self._maybe_shrink()

    def _release(self, row: int, w: int, slot: int = -1) -> bool:
        """Take worker slot ``w`` off ``row`` (at table ``slot``, -1 if unknown); free the row once empty."""
        holders, stamps = self._holder_views, self._stamp_views
        h0, h1, h2 = holders
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
            self._sync_overflow_bits(extra)
        elif extra is not None:  # an overflow holder moves inline
            holders[j][row] = extra.slots.pop()
            stamps[j][row] = extra.stamps.pop()
            extra.mask ^= self._bit_by_slot[w]
            self._sync_overflow_bits(extra)
        else:  # keep the inline holders packed from the first
            end = 2 if h2[row] else 1 if h1[row] else 0
            if end != j:
                holders[j][row] = holders[end][row]
                stamps[j][row] = stamps[end][row]
            holders[end][row] = _NO_WORKER
        if extra is not None and not extra.slots:
            del self._overflow[row]
            self._overflow_of_row[row] = 0
            self._free_bits_rows.append(extra.bits_row)
        self._num_blocks_by_slot[w] -= 1
        self._num_entries -= 1
        if not h0[row]:
            self._unlink(slot if slot >= 0 else self._slot_of_row(row))
            self._key_view[row] = self._free_row + 1
            self._free_row = row
            self._num_free_rows += 1
            self._num_live_rows -= 1
        return True

    def _unlink(self, slot: int) -> None:
        """Empty table ``slot``, moving back one slot the rest of its run that sits past its home."""
        slots, keys, home_mask = self._slot_view, self._key_view, self._home_mask
        j = slot + 1
        while (r := slots[j]) >= 0 and keys[r] & home_mask < j:
            slots[j - 1] = r
            j += 1
        slots[j - 1] = _EMPTY

    def _evict_oldest(self, w: int, num_entries: int) -> None:
        while num_entries > 0:
            queue = self._oldest.get(w)
            if queue is None or queue.next == len(queue.rows):
                num_queued = max(num_entries, min(int(self._num_blocks_by_slot[w]) // 4, _MAX_EVICTION_QUEUE))
                queue = self._oldest[w] = self._find_oldest(w, num_queued)
            row, stamp = int(queue.rows[queue.next]), int(queue.stamps[queue.next])
            queue.next += 1
            if self._stamp_of(row, w) == stamp:
                self._release(row, w)
                self.num_evicted_over_bound += 1
                num_entries -= 1

    def _stamp_of(self, row: int, w: int) -> int:
        for holders, stamps in zip(self._holder_views, self._stamp_views, strict=True):
            if holders[row] == w:
                return stamps[row]
        extra = self._overflow.get(row)
        if extra is not None and extra.mask >> w & 1:
            return extra.stamps[extra.slots.index(w)]
        return -1

    def _inline_rows(self, w: int) -> list[npt.NDArray[np.int64]]:
        """For each inline holder column, the rows where worker slot ``w`` is that holder."""
        end, step = self._num_rows, _SCAN_CHUNK_ROWS
        rows = []
        for column in self._holder_columns:
            found = [np.flatnonzero(column[a : a + step] == w) + a for a in range(0, end, step)]
            rows.append(np.concatenate(found) if found else np.zeros(0, np.int64))
        return rows

    def _overflow_rows(self, w: int) -> list[int]:
        return [row for row, extra in self._overflow.items() if extra.mask >> w & 1]

    def _find_oldest(self, w: int, num_entries: int) -> _OldestFirst:
        inline = self._inline_rows(w)
        extra_rows = self._overflow_rows(w)
        rows = np.concatenate([*inline, np.array(extra_rows, np.int64)])
        stamps = np.concatenate(
            [
                *(column[r].astype(np.int64) for column, r in zip(self._stamp_columns, inline, strict=True)),
                np.array([self._stamp_of(r, w) for r in extra_rows], np.int64),
            ]
        )
        if len(stamps) > num_entries:
            chosen = np.argpartition(stamps, num_entries - 1)[:num_entries]
            rows, stamps = rows[chosen], stamps[chosen]
        order = np.argsort(stamps)
        return _OldestFirst(rows[order].astype(np.int32), stamps[order].astype(np.uint32))

    def _renumber_stamps(self) -> None:
        """Replace every stamp by its age rank (stamps are distinct), freeing the values above."""
        held = [np.flatnonzero(column[: self._num_rows]) for column in self._holder_columns]
        extras = list(self._overflow.values())
        stamps = np.concatenate(
            [column[rows].astype(np.int64) for column, rows in zip(self._stamp_columns, held, strict=True)]
            + [np.array(extra.stamps, np.int64) for extra in extras]
        )
        ranks = np.empty(len(stamps), np.int64)
        ranks[np.argsort(stamps)] = np.arange(len(stamps))
        offset = 0
        for column, rows in zip(self._stamp_columns, held, strict=True):
            column[rows] = ranks[offset : offset + len(rows)]
            offset += len(rows)
        for extra in extras:
            n = len(extra.stamps)
            extra.stamps = array("I", ranks[offset : offset + n].astype(np.uint32).tobytes())
            offset += n
        self._next_stamp = len(stamps)
        self._oldest.clear()

    def clear_worker(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` but keep it known (AllBlocksCleared, resubscribe)."""
        w = self._slot_by_worker.get(worker_id)
        if w is None:
            return
        self._oldest.pop(w, None)
        if self._num_blocks_by_slot[w]:
            rows = np.concatenate(self._inline_rows(w)).tolist() + self._overflow_rows(w)
            for row in rows:
                self._release(row, w)
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
        live = self._num_live_rows
        if (len(self._heads) > _MIN_ROWS and live * 4 < len(self._heads)) or (
            self._slot_bits > _MIN_SLOT_BITS and live < self._max_live_rows // 8
        ):
            self._compact()

    def _compact(self) -> None:
        """Renumber the live rows from 0 in slot order and size the arrays and the table to them."""
        n = self._num_live_rows
        slot_bits = _MIN_SLOT_BITS
        while n > (1 << slot_bits) * _MAX_LOAD / 2:
            slot_bits += 1
        old_rows, keys = self._rows_by_home(slot_bits)
        capacity = max(_MIN_ROWS, 2 * n)
        heads = np.zeros((capacity, 2), np.uint64)
        heads[:n] = self._heads[old_rows]
        tail_holders = np.zeros(capacity, np.uint16)
        tail_holders[:n] = self._tail_holders[old_rows]
        tail_stamps = np.zeros((capacity, 2), np.uint32)
        tail_stamps[:n] = self._tail_stamps[old_rows]
        overflow_of_row = np.zeros(capacity, np.int32)
        overflow_of_row[:n] = self._overflow_of_row[old_rows]
        if self._overflow:
            new_row = np.empty(self._num_rows, np.int64)
            new_row[old_rows] = np.arange(n)
            self._overflow = {int(new_row[r]): extra for r, extra in self._overflow.items()}
        num_bits_rows = max(_MIN_OVERFLOW_ROWS, 2 * len(self._overflow))
        if num_bits_rows < len(self._overflow_bits):  # renumber the bitsets too, from 0
            bits = np.zeros((num_bits_rows, self._overflow_bits.shape[1]), np.uint64)
            for i, (row, extra) in enumerate(self._overflow.items()):
                bits[i] = self._overflow_bits[extra.bits_row]
                extra.bits_row = i
                overflow_of_row[row] = i + 1
            self._overflow_bits = bits
            self._free_bits_rows = list(range(num_bits_rows - 1, len(self._overflow) - 1, -1))
        self._heads, self._tail_holders, self._tail_stamps = heads, tail_holders, tail_stamps
        self._overflow_of_row = overflow_of_row
        self._num_rows, self._free_row, self._num_free_rows = n, -1, 0
        self._oldest.clear()
        self._place(np.arange(n, dtype=np.int32), keys, slot_bits)

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
        hashes = _leading_u64(block_hashes)
        found = np.empty(len(hashes), np.int32)
        # Every block's row at once; a block the index lacks ends the match there.
        num_found = kv_kernels.find_rows(self._slots, self._keys, np.uint64(self._home_mask), hashes, found)
        if num_found:
            h0, h1, h2 = self._holder_columns
            kv_kernels.match_slots(
                found, num_found, h0, h1, h2, self._overflow_of_row, self._overflow_bits,
                self._alive_bits, self._held_bits, out,
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
        size = self._heads.nbytes + self._tail_holders.nbytes + self._tail_stamps.nbytes + self._slots.nbytes
        size += self._overflow_of_row.nbytes + self._overflow_bits.nbytes
        size += self._alive_bits.nbytes + self._held_bits.nbytes + sys.getsizeof(self._free_bits_rows)
        views = (self._key_view, self._slot_view, *self._holder_views, *self._stamp_views)
        size += sum(sys.getsizeof(v) for v in views)
        size += sys.getsizeof(self._overflow)
        size += sum(sys.getsizeof(row) + extra.nbytes() for row, extra in self._overflow.items())
        size += sys.getsizeof(self._oldest) + sum(queue.nbytes() for queue in self._oldest.values())
        size += sys.getsizeof(self._slot_by_worker) + sum(sys.getsizeof(w) for w in self._slot_by_worker)
        size += self._num_blocks_by_slot.nbytes
        for per_slot in (self._worker_by_slot, self._bit_by_slot, self._free_slots):
            size += sys.getsizeof(per_slot) + sum(sys.getsizeof(v) for v in per_slot)
        return size
