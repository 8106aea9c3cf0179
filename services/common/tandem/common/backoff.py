"""Exponential backoff within a time budget, for calls that are safe to repeat.

The gateway repeats three idempotent calls while their peer restarts: the
router's ``Schedule`` and ``Release`` and the usage store's record. Each used to
carry its own doubling loop; they share this one::

    delays = backoff_delays(within_s=30.0)
    while True:
        try:
            return await call()
        except RetryableError:
            delay_s = next(delays, None)
            if delay_s is None:
                raise
            await asyncio.sleep(delay_s)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator


def backoff_delays(
    *,
    within_s: float,
    first_s: float = 0.25,
    max_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[float]:
    """Waits of ``first_s``, doubling up to ``max_s``, for as long as the next wait ends within
    ``within_s`` of this call. Empty when ``within_s`` is shorter than ``first_s``."""
    if first_s <= 0 or max_s < first_s:
        raise ValueError(f"need 0 < first_s <= max_s, got first_s={first_s}, max_s={max_s}")
    deadline = clock() + within_s
    delay_s = first_s
    while clock() + delay_s <= deadline:
        yield delay_s
        delay_s = min(delay_s * 2, max_s)
