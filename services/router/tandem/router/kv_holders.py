"""The KV index's holders past the inline three, and the age of every entry: which go first.

Used by :class:`tandem.router.kv_index.KVIndex` only, which keeps, per row, three holders inline
(worker slots, 0: none) with a stamp each (one tick per stored entry, so the lower the older), and
the rest of a row's holders in an :class:`Overflow`. The index calls :func:`find_oldest` when a
worker goes over its bound, :func:`stamp_of` to check that a queued entry is still the one found,
and :func:`renumber_stamps` when the stamps reach the largest a uint32 holds. Bulk work, vectorized
over the holder columns a chunk at a time.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from tandem.router.kv_slot_table import SCAN_CHUNK_ROWS


class Overflow:
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


class OldestFirst:
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


#: The index's per-row columns: the three inline holders (uint16) and their stamps (uint32).
Columns = Sequence[npt.NDArray[np.generic]]
#: The same columns as memoryviews (a third of numpy's cost per scalar).
Views = Sequence[memoryview]


def stamp_of(holder_views: Views, stamp_views: Views, overflow: Mapping[int, Overflow], row: int, w: int) -> int:
    """The stamp of worker slot ``w``'s entry in ``row``, -1 if it holds none."""
    for holders, stamps in zip(holder_views, stamp_views, strict=True):
        if holders[row] == w:
            return int(stamps[row])
    extra = overflow.get(row)
    if extra is not None and extra.mask >> w & 1:
        return extra.stamps[extra.slots.index(w)]
    return -1


def inline_rows(holder_columns: Columns, num_rows: int, w: int) -> list[npt.NDArray[np.int64]]:
    """For each inline holder column, the rows where worker slot ``w`` is that holder."""
    step = SCAN_CHUNK_ROWS
    rows = []
    for column in holder_columns:
        found = [np.flatnonzero(column[a : a + step] == w) + a for a in range(0, num_rows, step)]
        rows.append(np.concatenate(found) if found else np.zeros(0, np.int64))
    return rows


def overflow_rows(overflow: Mapping[int, Overflow], w: int) -> list[int]:
    """The rows where worker slot ``w`` is an overflow holder (the mask also has the inline ones)."""
    return [row for row, extra in overflow.items() if extra.mask >> w & 1 and w in extra.slots]


def find_oldest(
    holder_columns: Columns, stamp_columns: Columns, overflow: Mapping[int, Overflow], num_rows: int, w: int, n: int
) -> OldestFirst:
    """Worker slot ``w``'s ``n`` oldest entries, a scan of every row."""
    inline = inline_rows(holder_columns, num_rows, w)
    extra_rows = overflow_rows(overflow, w)
    rows = np.concatenate([*inline, np.array(extra_rows, np.int64)])
    stamps = np.concatenate(
        [
            *(column[r].astype(np.int64) for column, r in zip(stamp_columns, inline, strict=True)),
            np.array([overflow[r].stamps[overflow[r].slots.index(w)] for r in extra_rows], np.int64),
        ]
    )
    if len(stamps) > n:
        chosen = np.argpartition(stamps, n - 1)[:n]
        rows, stamps = rows[chosen], stamps[chosen]
    order = np.argsort(stamps)
    return OldestFirst(rows[order].astype(np.int32), stamps[order].astype(np.uint32))


def renumber_stamps(
    holder_columns: Columns, stamp_columns: Columns, overflow: Mapping[int, Overflow], num_rows: int
) -> int:
    """Replace every stamp by its age rank (stamps are distinct), freeing the values above; returns
    the next stamp."""
    held = [np.flatnonzero(column[:num_rows]) for column in holder_columns]
    extras = list(overflow.values())
    stamps = np.concatenate(
        [column[rows].astype(np.int64) for column, rows in zip(stamp_columns, held, strict=True)]
        + [np.array(extra.stamps, np.int64) for extra in extras]
    )
    ranks = np.empty(len(stamps), np.int64)
    ranks[np.argsort(stamps)] = np.arange(len(stamps))
    offset = 0
    for column, rows in zip(stamp_columns, held, strict=True):
        column[rows] = ranks[offset : offset + len(rows)]
        offset += len(rows)
    for extra in extras:
        n = len(extra.stamps)
        extra.stamps = array("I", ranks[offset : offset + n].astype(np.uint32).tobytes())
        offset += n
    return len(stamps)


#: Overflow rows' bitsets grow by doubling from this many.
_MIN_BITS_ROWS = 16


class OverflowBits:
    """Every :class:`Overflow`'s holder mask as a row of bits (bit ``s`` of word ``s // 64`` for
    worker slot ``s``), for the compiled lookup (:func:`tandem.router.kv_kernels.match_slots`),
    with the lookup's two scratch bitsets of the same width."""

    def __init__(self) -> None:
        self.bits: npt.NDArray[np.uint64] = np.zeros((_MIN_BITS_ROWS, 1), np.uint64)
        self._free_rows: list[int] = list(range(_MIN_BITS_ROWS - 1, -1, -1))
        self.alive = np.zeros(1, np.uint64)
        self.held = np.zeros(1, np.uint64)

    @property
    def num_slots(self) -> int:
        """Worker slots a row has bits for."""
        return 64 * int(self.bits.shape[1])

    def new(self, mask: int) -> Overflow:
        """An overflow holding ``mask``'s workers, with a bitset row of its own."""
        if not self._free_rows:
            used = len(self.bits)
            grown = np.zeros((2 * used, self.bits.shape[1]), np.uint64)
            grown[:used] = self.bits
            self.bits = grown
            self._free_rows.extend(range(2 * used - 1, used - 1, -1))
        extra = Overflow(mask, self._free_rows.pop())
        self.sync(extra)
        return extra

    def sync(self, extra: Overflow) -> None:
        """Copy ``extra``'s holder mask into its bitset row."""
        num_words = self.bits.shape[1]
        self.bits[extra.bits_row] = np.frombuffer(extra.mask.to_bytes(8 * num_words, "little"), np.uint64)

    def give_back(self, extra: Overflow) -> None:
        """``extra`` is gone: its bitset row is free."""
        self._free_rows.append(extra.bits_row)

    def widen(self) -> None:
        """Twice as many bits per row (a new worker slot past the last word)."""
        old_words = self.bits.shape[1]
        wider = np.zeros((len(self.bits), 2 * old_words), np.uint64)
        wider[:, :old_words] = self.bits
        self.bits = wider
        self.alive = np.zeros(2 * old_words, np.uint64)
        self.held = np.zeros(2 * old_words, np.uint64)

    def compact(self, overflow: Mapping[int, Overflow], overflow_of_row: npt.NDArray[np.int32]) -> None:
        """Fewer bitset rows when far fewer are used: those of ``overflow`` (by row) renumbered from
        0, and ``overflow_of_row`` (per row: 0, or 1 + its bitset row) with them."""
        num_rows = max(_MIN_BITS_ROWS, 2 * len(overflow))
        if num_rows >= len(self.bits):
            return
        bits = np.zeros((num_rows, self.bits.shape[1]), np.uint64)
        for i, (row, extra) in enumerate(overflow.items()):
            bits[i] = self.bits[extra.bits_row]
            extra.bits_row = i
            overflow_of_row[row] = i + 1
        self.bits = bits
        self._free_rows = list(range(num_rows - 1, len(overflow) - 1, -1))

    def nbytes(self) -> int:
        return self.bits.nbytes + self.alive.nbytes + self.held.nbytes + sys.getsizeof(self._free_rows)
