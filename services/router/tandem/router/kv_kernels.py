"""The KV index's lookup, compiled: every prompt block probed in one native call, every worker credited in another.

Called by :meth:`tandem.router.kv_index.KVIndex.match_by_slot` on every Schedule; calls nothing.

The profile behind it (2026-12-04, ``benchmarks/router_fleet.py --skip-replicas --skip-fairness``
with timing wrappers, 1,000 SIMULATED workers, 10 M indexed entries): the lookup was a quarter of a
decision, a Python probe of the slot table per prompt block (230 us for a ~130-block prompt).
:func:`find_rows` probes every block in one call, and :func:`match_slots` credits every worker in
another, walking the found rows with one bitset of the workers still matching (the random-operation
tests check it against a plain reference). Before it (2026-12-05), the walk over the rows that many
workers hold, such as a system prompt's, ran in Python on bitmask ints, and only the last few
workers were followed in compiled code: under the fleet benchmark's load the lookup took p50 90 us,
p90 146 us.

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

_F = TypeVar("_F", bound=Callable[..., Any])


def _native(signature: str) -> Callable[[_F], _F]:
    """``njit`` with an explicit signature, cached on disk when numba finds a writable place."""

    def decorate(function: _F) -> _F:
        try:
            return njit(signature, cache=True, nogil=True)(function)  # type: ignore[no-any-return]
        except RuntimeError:  # "cannot cache function ...: no locator available": read-only everywhere
            return njit(signature, cache=False, nogil=True)(function)  # type: ignore[no-any-return]

    return decorate


@_native("i8(i4[::1], u8[:], u8, u8[::1], i4[::1])")
def find_rows(
    slots: npt.NDArray[np.int32],
    keys: npt.NDArray[np.uint64],
    home_mask: np.uint64,
    hashes: npt.NDArray[np.uint64],
    rows_out: npt.NDArray[np.int32],
) -> int:
    """The index rows of ``hashes``, in order, into ``rows_out``, up to the first hash the index does
    not hold (no worker holds it, so no match goes past it); returns how many were found.

    The probe of :class:`~tandem.router.kv_index.KVIndex`: linear probing from the home slot (the
    hash's low bits), each run sorted by home slot, so a probe stops at an empty slot or at the first
    row homed past its own."""
    for j in range(hashes.shape[0]):
        h = hashes[j]
        home = np.int64(h & home_mask)
        i = home
        row = -1
        while True:
            r = slots[i]
            if r < 0:
                break
            k = keys[r]
            if k == h:
                row = r
                break
            if np.int64(k & home_mask) > home:
                break
            i += 1
        if row < 0:
            return j
        rows_out[j] = row
    return len(hashes)


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
