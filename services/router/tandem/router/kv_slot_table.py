"""The KV index's slot table: block hash → row, open addressing with linear probing.

Owned by :class:`tandem.router.kv_index.KVIndex`, which keeps the rows (their keys included) and
calls :meth:`SlotTable.find` on every lookup and removal, :meth:`SlotTable.find_or_add` on every store,
:meth:`SlotTable.unlink` for rows that lost their last holder and :meth:`SlotTable.place` when it
renumbers its rows. Every probe is :func:`tandem.router.kv_kernels.find_rows`,
:func:`~tandem.router.kv_kernels.add_rows` or :func:`~tandem.router.kv_kernels.unlink_rows`, one
compiled loop over a batch of hashes or rows.

Home slot = the hash's low bits (block hashes are digests, so their bits are uniform; other keys
work, clustered ones only slowly). Each run is kept sorted by home slot (linear probing's "ordered"
variant), so a lookup stops at the first row homed past its own, a deletion shifts the run back
instead of leaving a tombstone, and doubling the table needs no sort: the rows in slot order, split
by one more bit, are in order for the larger table. The table doubles past 0.7 load; it has spare
slots past the last home instead of wrapping around, and its last slot always stays empty so that
every probe ends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from tandem.router import kv_kernels

_EMPTY = -1
MIN_SLOT_BITS = 10
#: Spare slots past the last home slot, so probes never wrap around; a run that would reach the end
#: (odds ~1e-6 at 0.7 load) gets twice as many.
_PAD_SLOTS = 256
#: Linear probing slows sharply past 0.7 load: the table doubles there.
MAX_LOAD = 0.7
#: Rows compared per numpy call in scans: keeps temporaries small.
SCAN_CHUNK_ROWS = 1 << 20


def as_keys(block_hashes: Iterable[int], *, skip_refused: bool = False) -> tuple[npt.NDArray[np.uint64], int | None]:
    """``block_hashes`` as the table's keys (uint64) up to the first that is not a 64-bit unsigned
    int (never stored, so no match goes past it), and that one (None if there is none); with
    ``skip_refused``, all the others."""
    # An event's hashes are a list: the ABC check for other sequences (~1 us) only after that.
    hashes = block_hashes if type(block_hashes) is list or isinstance(block_hashes, Sequence) else list(block_hashes)
    try:
        return np.fromiter(hashes, np.uint64, len(hashes)), None
    except OverflowError:
        end = next(i for i, h in enumerate(hashes) if not 0 <= h < 1 << 64)
        if skip_refused:
            return np.array([h for h in hashes if 0 <= h < 1 << 64], np.uint64), hashes[end]
        return np.fromiter(hashes[:end], np.uint64, end), hashes[end]


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


class SlotTable:
    """Which row holds each key; the keys themselves are the caller's (``keys[row]``), passed to
    every call since the caller's row arrays grow. Not thread-safe, like the index."""

    def __init__(self) -> None:
        self._set(np.full((1 << MIN_SLOT_BITS) + _PAD_SLOTS, _EMPTY, np.int32), MIN_SLOT_BITS)

    def _set(self, slots: npt.NDArray[np.int32], slot_bits: int) -> None:
        self.slots, self.slot_bits = slots, slot_bits
        self.home_mask = np.uint64((1 << slot_bits) - 1)
        #: Live rows the table takes before it doubles.
        self.max_live_rows = int((1 << slot_bits) * MAX_LOAD)

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes + sys.getsizeof(self)

    def find(
        self,
        keys: npt.NDArray[np.uint64],
        hashes: npt.NDArray[np.uint64],
        rows_out: npt.NDArray[np.int32],
        *,
        stop_at_missing: bool,
    ) -> int:
        """:func:`tandem.router.kv_kernels.find_rows` on this table."""
        return int(kv_kernels.find_rows(self.slots, keys, self.home_mask, hashes, rows_out, stop_at_missing))

    def find_or_add(
        self,
        keys: npt.NDArray[np.uint64],
        hashes: npt.NDArray[np.uint64],
        rows_out: npt.NDArray[np.int32],
        start: int,
        rows: npt.NDArray[np.int64],
    ) -> int:
        """:func:`tandem.router.kv_kernels.add_rows` on this table; where it stops for want of room in
        the table, the table makes it (doubling at its load, more spare slots past its end if a run
        reached it) and it goes on. Returns where it stopped for want of rows (the caller grows them
        and calls again) or the end."""
        rows[kv_kernels.MAX_LIVE_ROWS] = self.max_live_rows
        while (done := int(kv_kernels.add_rows(self.slots, keys, self.home_mask, hashes, rows_out, start, rows))) < len(
            hashes
        ):
            start = done
            if rows[kv_kernels.NUM_LIVE_ROWS] >= self.max_live_rows:
                self._rebuild(keys, self.slot_bits + 1)
                rows[kv_kernels.MAX_LIVE_ROWS] = self.max_live_rows
            elif rows[kv_kernels.FREE_ROW] < 0 and rows[kv_kernels.NUM_ROWS] >= rows[kv_kernels.ROW_CAPACITY]:
                return done
            else:  # a run reached the end: more room there
                self._rebuild(keys, self.slot_bits, 2 * (len(self.slots) - (1 << self.slot_bits)))
        return done

    def unlink(self, keys: npt.NDArray[np.uint64], rows: npt.NDArray[np.int32]) -> None:
        """Take ``rows`` (in the table, keys still theirs) out of it."""
        kv_kernels.unlink_rows(self.slots, keys, self.home_mask, rows)

    def rows_by_home(
        self, keys: npt.NDArray[np.uint64], slot_bits: int
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint64]]:
        """The rows in the table and their keys, sorted by home slot in a table of ``2**slot_bits``
        home slots."""
        table = self.slots
        rows = table[table >= 0]  # sorted by home in the current table
        row_keys = keys[rows]
        if slot_bits != self.slot_bits:  # shrinking (or see _double): timsort merges the presorted runs
            order = np.argsort(row_keys & np.uint64((1 << slot_bits) - 1), kind="stable")
            return rows[order], row_keys[order]
        return rows, row_keys

    def slot_bits_for(self, num_live_rows: int) -> int:
        """The smallest table that holds ``num_live_rows`` at half its largest load."""
        slot_bits = MIN_SLOT_BITS
        while num_live_rows > (1 << slot_bits) * MAX_LOAD / 2:
            slot_bits += 1
        return slot_bits

    def _rebuild(self, keys: npt.NDArray[np.uint64], slot_bits: int, num_pad_slots: int = _PAD_SLOTS) -> None:
        """A table of ``2**slot_bits`` home slots holding the same rows."""
        if slot_bits == self.slot_bits + 1 and num_pad_slots == _PAD_SLOTS and self._double(keys):
            return
        rows, row_keys = self.rows_by_home(keys, slot_bits)
        self.place(rows, row_keys, slot_bits, num_pad_slots)

    def _double(self, keys: npt.NDArray[np.uint64]) -> bool:
        """:meth:`place` into a table twice as large, a chunk of the old one at a time: small
        temporaries, since growing a large table pauses the event loop. False if the last run
        would not fit before the end."""
        old_bits, old_table = self.slot_bits, self.slots
        table = np.full((2 << old_bits) + _PAD_SLOTS, _EMPTY, np.int32)
        home_mask, new_bit = np.uint64((2 << old_bits) - 1), np.uint64(1 << old_bits)
        next_free = 0
        # The rows whose new bit is 0 come first, in order (placed as found), then the others.
        upper_half: list[tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]] = []
        for a in range(0, len(old_table), SCAN_CHUNK_ROWS):
            rows = old_table[a : a + SCAN_CHUNK_ROWS]
            rows = rows[rows >= 0]
            row_keys = keys[rows]
            upper = (row_keys & new_bit) != 0
            upper_half.append((rows[upper], (row_keys[upper] & home_mask).view(np.int64)))
            lower = ~upper
            next_free = _place_run(table, rows[lower], (row_keys[lower] & home_mask).view(np.int64), next_free)
        for rows, homes in upper_half:
            next_free = _place_run(table, rows, homes, next_free)
        if next_free >= len(table):
            return False
        self._set(table, old_bits + 1)
        return True

    def place(
        self,
        rows: npt.NDArray[np.int32],
        keys: npt.NDArray[np.uint64],
        slot_bits: int,
        num_pad_slots: int = _PAD_SLOTS,
    ) -> None:
        """A new table of ``2**slot_bits`` home slots with ``rows`` (sorted by home slot; ``keys``
        theirs), filled the way inserting them in order would."""
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
        self._set(table, slot_bits)
