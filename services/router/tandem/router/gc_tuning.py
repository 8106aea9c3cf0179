"""Python's cyclic garbage collector in a router replica.

A replica's event loop makes and drops asyncio futures, handles and coroutines by the thousand a
second (a task per followed worker, a Schedule, a ledger message), and Python runs a pass of its
youngest generation after every 700 container objects made and not yet freed. In the fleet
benchmark (``benchmarks/router_fleet.py``, 1,000 SIMULATED workers, 250 schedules/s, 2026-12-05)
those passes ran 50-230 times in 33 s and took 0.4-1.2 ms each (2.7 ms at worst; the middle
generation's 3-4 ms): a Schedule that arrived during one waited for it, and the passes were a good
part of the from-arrival p99 (1.14-1.33 ms with them; 0.99 ms with the threshold at 20,000, when no
pass ran in the 33 s at all). What they collect is small: the replica's state is long-lived, and
little of its garbage is cyclic, so a higher threshold costs little memory.
"""

from __future__ import annotations

import gc


def tune_gc(young_threshold: int) -> None:
    """Set the youngest generation's threshold (0: leave Python's), keeping the older two."""
    if young_threshold > 0:
        _, middle, oldest = gc.get_threshold()
        gc.set_threshold(young_threshold, middle, oldest)
