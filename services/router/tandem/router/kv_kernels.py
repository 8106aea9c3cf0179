"""The KV index's probe loop, compiled and written once: every lookup and update of the slot table.

Called by :class:`tandem.router.kv_slot_table.SlotTable` (:func:`find_rows`, :func:`add_rows`,
:func:`unlink_rows`) and :meth:`tandem.router.kv_index.KVIndex.match_by_slot` (:func:`match_slots`);
calls nothing. :func:`_probe` is the one linear-probe loop; each kernel runs it over a whole batch.

Why compiled for lookups (2026-12-04, ``benchmarks/router_fleet.py --skip-replicas --skip-fairness``
with timing wrappers, 1,000 SIMULATED workers, 10 M indexed entries): the lookup was a quarter of a
decision, a Python probe of the slot table per prompt block (230 us for a ~130-block prompt).
:func:`find_rows` probes every block in one call, and :func:`match_slots` credits every worker in
another, walking the found rows with one bitset of the workers still matching. Before it
(2026-12-05), the walk over the rows that many workers hold, such as a system prompt's, ran in
Python on bitmask ints, and only the last few workers were followed in compiled code: under the
fleet benchmark's load the lookup took p50 90 us, p90 146 us.

Why compiled for updates too (issue 39, 2026-12-06). Until then ``store`` and ``remove`` each had
their own Python copy of the probe loop (a second and third source of truth). Measured with both
indexes side by side (200 workers x 5,000 blocks, a batch of new blocks stored, stored again and
removed by one worker; the best of 7 rounds, on a 2-core host shared with other work, so +-50 %),
microseconds per batch, Python probe -> compiled batch probe:

=============  ==========  ==========  ===========
blocks/batch   store       re-store    remove
=============  ==========  ==========  ===========
1              1.4 -> 4.1  1.6 -> 4.1  3.2 -> 3.2
16             37 -> 20    23 -> 20    39 -> 31
128            114 -> 41   78 -> 26    118 -> 69
=============  ==========  ==========  ===========

At fleet scale (1,000 workers, 750 of them filled by prompts of 4 system blocks, a 16-block shared
document and 4 blocks of their own to 7.5 M entries; then 20,000 rounds of a prefill's store, a
decode step's one-block store and a removal of 4 blocks; the replica's GC threshold, the long-lived
objects frozen; same host, one after the other): filling 37.4 -> 34.8 s, 17.3 B per entry either
way; p50 (p99) a prefill's store 62 (761) -> 60 (180) us, a one-block store 2.0 (6.1) -> 4.6 (28.7)
us, a removal 19.6 (101) -> 21.4 (75) us, a 130-block lookup 7.0 (16) -> 7.9 (36) us (the same
kernels: noise). Without the GC threshold and the freeze, the compiled path's few more small
containers a call (lists, the counters' array) made Python's full collections of the benchmark's
own millions of ints more frequent (p99 of a prefill's store 0.4 -> 6 ms): a replica keeps both.

A vLLM batch carries one step's newly full blocks: one for a decoding request, the whole prompt
for a prefill. The compiled path costs ~3 us more per one-block batch (numpy and the dispatch),
which at the fleet benchmark's ~255 batches a second is under 1 ms of CPU a second; it is level on
a prompt of mostly known blocks and 2-3x faster on a long one of new blocks, the batches that hold
up the Schedules queued behind them. So the
compiled loop is the only one; the plain reference is the index tests' walk of the table
(``tests/unit/router/test_kv_index.py``: every run sorted by home, every live key found, no absent
one) and their dict-based reference index.

Compiled by numba when this module is imported (the signatures are explicit: nothing compiles
during a Schedule), and cached on disk beside the module where that is writable (numba's own
fallback: ``NUMBA_CACHE_DIR`` or the user's cache folder; the router image compiles them at build
time); with no writable place at all they are compiled at every start, not cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from numba import njit

from tandem.router.jit import native as _native

_F = TypeVar("_F", bound=Callable[..., Any])


def _inner(function: _F) -> _F:
    """``njit`` without a signature: for a function only compiled code calls (compiled into each caller)."""
    return njit(nogil=True, cache=True)(function)  # type: ignore[no-any-return]


@_inner
def _probe(slots: npt.NDArray[np.int32], keys: npt.NDArray[np.uint64], home_mask: np.uint64, h: np.uint64) -> Any:
    """(slot, row) of hash ``h`` in the slot table, or (the slot where it would go, -1): the one probe
    loop of :class:`~tandem.router.kv_slot_table.SlotTable`. Linear probing from the home slot (the
    hash's low bits), each run sorted by home slot, so a probe stops at an empty slot or at the first
    row homed past its own (which is also where a new row of that home goes)."""
    home = np.int64(h & home_mask)
    i = home
    while True:
        r = slots[i]
        if r < 0:
            return i, -1
        k = keys[r]
        if k == h:
            return i, np.int64(r)
        if np.int64(k & home_mask) > home:
            return i, -1
        i += 1


@_native("i8(i4[::1], u8[:], u8, u8[::1], i4[::1], boolean)")
def find_rows(
    slots: npt.NDArray[np.int32],
    keys: npt.NDArray[np.uint64],
    home_mask: np.uint64,
    hashes: npt.NDArray[np.uint64],
    rows_out: npt.NDArray[np.int32],
    stop_at_missing: bool,
) -> int:
    """The rows of ``hashes``, in order, into ``rows_out``; returns how many were written. With
    ``stop_at_missing`` (a lookup), up to the first hash the index does not hold (no worker holds it,
    so no match goes past it); else all of them, -1 for those it does not hold (an update)."""
    for j in range(hashes.shape[0]):
        row = _probe(slots, keys, home_mask, hashes[j])[1]
        if row < 0 and stop_at_missing:
            return j
        rows_out[j] = row
    return len(hashes)


#: Fields of :func:`add_rows`' ``rows`` argument (the index's row counters, updated in place).
FREE_ROW, NUM_ROWS, NUM_LIVE_ROWS, ROW_CAPACITY, MAX_LIVE_ROWS = range(5)


@_native("i8(i4[::1], u8[:], u8, u8[::1], i4[::1], i8, i8[::1])")
def add_rows(
    slots: npt.NDArray[np.int32],
    keys: npt.NDArray[np.uint64],
    home_mask: np.uint64,
    hashes: npt.NDArray[np.uint64],
    rows_out: npt.NDArray[np.int32],
    start: int,
    rows: npt.NDArray[np.int64],
) -> int:
    """The rows of ``hashes[start:]`` into ``rows_out``, with a new row for each hash the table lacks
    (an update): its key set, put after the rows of its home slot (the rest of the run moves one slot
    right). New rows come from the free rows (chained through their keys as next + 1), then from the
    never used ones. ``rows``: the counters named above, updated. Returns where it stopped: at the end,
    or at a hash that needs more room first (the table at its load, no row left, or a run that would
    reach the table's last slot, which stays empty so that every probe ends)."""
    last_slot = slots.shape[0] - 1
    for j in range(start, hashes.shape[0]):
        h = hashes[j]
        i, row = _probe(slots, keys, home_mask, h)
        if row < 0:
            free_row = rows[FREE_ROW]
            if rows[NUM_LIVE_ROWS] >= rows[MAX_LIVE_ROWS] or (free_row < 0 and rows[NUM_ROWS] >= rows[ROW_CAPACITY]):
                return j
            end = i
            while slots[end] >= 0:
                end += 1
            if end >= last_slot:
                return j
            if free_row >= 0:
                row = free_row
                rows[FREE_ROW] = np.int64(keys[free_row]) - 1
            else:
                row = rows[NUM_ROWS]
                rows[NUM_ROWS] += 1
            rows[NUM_LIVE_ROWS] += 1
            keys[row] = h
            while end > i:
                slots[end] = slots[end - 1]
                end -= 1
            slots[i] = row
        rows_out[j] = row
    return len(hashes)


@_native("void(i4[::1], u8[:], u8, i4[::1])")
def unlink_rows(
    slots: npt.NDArray[np.int32], keys: npt.NDArray[np.uint64], home_mask: np.uint64, rows: npt.NDArray[np.int32]
) -> None:
    """Take ``rows`` (in the table, keys still set) out of it: each one's slot is emptied and the rest
    of its run that sits past its home moves back one slot (no tombstones)."""
    for n in range(rows.shape[0]):
        i, row = _probe(slots, keys, home_mask, keys[rows[n]])
        if row != rows[n]:
            continue  # not in the table (already taken out): nothing to move
        j = i + 1
        while True:
            q = slots[j]
            if q < 0 or np.int64(keys[q] & home_mask) >= j:
                break
            slots[j - 1] = q
            j += 1
        slots[j - 1] = -1


@_native("i8(i4[::1], i8, u2[:], u2[:], u2[::1], i4[::1], u8[:, ::1], u8[::1], u8[::1], i8[::1])")
def match_slots(
    rows: npt.NDArray[np.int32],
    num_rows: int,
    holders0: npt.NDArray[np.uint16],
    holders1: npt.NDArray[np.uint16],
    holders2: npt.NDArray[np.uint16],
    overflow_of_row: npt.NDArray[np.int32],
    overflow_bits: npt.NDArray[np.uint64],
    alive: npt.NDArray[np.uint64],
    held: npt.NDArray[np.uint64],
    out: npt.NDArray[np.int64],
) -> int:
    """How many of ``rows[:num_rows]`` (a prompt's blocks, in order) each worker slot holds without a
    gap from the first, into ``out[slot]`` (left as it is for slots holding not even the first);
    returns the number of rows at least one worker held in that way.

    A row's holders are its inline slots (``holders0..2``, 0: none), or, where
    ``overflow_of_row[row]`` is ``k + 1``, the bitset ``overflow_bits[k]`` of all of them (bit ``s`` of
    word ``s // 64`` for slot ``s``). ``alive`` (the slots holding every row so far) and ``held`` are
    scratch bitsets of ``overflow_bits``' width."""
    num_words = alive.shape[0]
    one = np.uint64(1)
    for j in range(num_rows):
        r = rows[j]
        k = overflow_of_row[r] - 1
        if k >= 0:
            for i in range(num_words):
                held[i] = overflow_bits[k, i]
        else:
            for i in range(num_words):
                held[i] = 0
            a = np.int64(holders0[r])
            held[a >> 6] |= one << np.uint64(a & 63)
            b = np.int64(holders1[r])
            if b != 0:
                held[b >> 6] |= one << np.uint64(b & 63)
            c = np.int64(holders2[r])
            if c != 0:
                held[c >> 6] |= one << np.uint64(c & 63)
        any_alive = False
        for i in range(num_words):
            now = held[i] if j == 0 else alive[i] & held[i]
            if j > 0:
                dropped = alive[i] & ~held[i]
                if dropped != 0:  # these held rows[:j] and not this one
                    for bit in range(64):
                        if (dropped >> np.uint64(bit)) & one:
                            out[i * 64 + bit] = j
            alive[i] = now
            if now != 0:
                any_alive = True
        if not any_alive:
            return j
    for i in range(num_words):
        survivors = alive[i] if num_rows > 0 else np.uint64(0)
        if survivors != 0:
            for bit in range(64):
                if (survivors >> np.uint64(bit)) & one:
                    out[i * 64 + bit] = num_rows
    return num_rows
