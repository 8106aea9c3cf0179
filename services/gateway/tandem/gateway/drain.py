"""Graceful shutdown. On SIGTERM :mod:`tandem.gateway.__main__` calls
:meth:`Drain.start`: readiness turns false and new generation requests get 503
at once (another replica takes them), streams in flight get ``grace_s`` to
finish; those still running then end with a terminal SSE error event and their
generation is cancelled (Abort on the workers), and the server stops.

Route handlers register each generation with :meth:`Drain.track`; /readyz asks
:attr:`Drain.draining`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

logger = logging.getLogger(__name__)


class Drain:
    def __init__(self) -> None:
        self.draining = False
        #: Set when the grace period is over: tracked streams must end now.
        self.expired = asyncio.Event()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def start(self, grace_s: float) -> None:
        """Refuse new work, wait up to ``grace_s`` for in-flight streams, then cut the rest."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining", extra={"num_in_flight": self._in_flight, "grace_s": grace_s})
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            logger.warning("grace period over; ending streams", extra={"num_in_flight": self._in_flight})
            self.expired.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5.0)
        logger.info("drained", extra={"num_in_flight": self._in_flight})
