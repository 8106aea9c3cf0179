"""Is the engine alive? An engine that died is a worker that dies.

Run by ``__main__`` as a task beside the gRPC server: :meth:`EngineWatch.wait_dead`
returns, with the reason, as soon as one of these holds (checked every
``poll_s``, 0.1 s by default, so a death is seen within that):

* ``engine_dead``: vLLM says its engine errored (``AsyncLLM.errored``: the
  engine-core process exited, or an exception in a step killed it; vLLM's own
  monitor thread notices the process at once, and every request in flight gets
  ``EngineDeadError``);
* ``engine_stuck``: requests are in flight and the engine core has not answered
  a probe for ``step_timeout_s`` (a hung kernel, a deadlocked collective). The
  probe is a round trip to the engine-core process that it answers between two
  steps (vLLM's ``is_sleeping`` utility call, which touches no model runner), so a
  step that never ends leaves it unanswered; one probe is in flight at a time,
  at most every ``probe_interval_s``, and only while there is work. (Counting the
  steps that produced outputs was tried first: a long chunked prefill, or a
  request waiting for its grammar, makes none for many seconds, and the
  hypothesis test of hostile calls tripped it on a healthy engine.) The caller
  then shuts the engine down, which turns the stuck requests into
  ``EngineDeadError`` too.

What ``__main__`` does then (in this order, so that nobody places a request
here once the worker knows): the health service answers NOT_SERVING, every RPC
answers UNAVAILABLE, the registration is deleted, and the process exits with
:data:`EXIT_ENGINE_DEAD` for its supervisor (Kubernetes, the local stack) to
start it again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

#: The worker's exit status when its engine died (EX_SOFTWARE): not a clean stop, restart me.
EXIT_ENGINE_DEAD = 70


class WatchedEngine(Protocol):
    def is_dead(self) -> bool:
        """True once the engine can serve nothing again."""
        ...

    async def probe(self) -> None:
        """Return once the engine core has answered a round trip it serves between two steps."""
        ...


class EngineWatch:
    """Tells when the engine is dead or stuck; see the module docstring."""

    def __init__(
        self,
        engine: WatchedEngine,
        *,
        has_work: Callable[[], bool],
        step_timeout_s: float,
        poll_s: float = 0.1,
        probe_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._has_work = has_work
        self._step_timeout_s = step_timeout_s
        self._poll_s = poll_s
        self._probe_interval_s = probe_interval_s
        self._clock = clock
        self._probe: asyncio.Task[None] | None = None
        self._probe_sent_s = 0.0
        self._probe_done_s = -float("inf")

    def check(self) -> str:
        """Empty while the engine is alive, else ``engine_dead`` or ``engine_stuck``; starts a probe when
        one is due."""
        if self._engine.is_dead():
            return "engine_dead"
        now_s = self._clock()
        probe = self._probe
        if probe is not None and not probe.done():
            return "engine_stuck" if now_s - self._probe_sent_s > self._step_timeout_s else ""
        if probe is not None:
            self._probe = None
            self._probe_done_s = now_s
            if not probe.cancelled() and probe.exception() is not None and self._engine.is_dead():
                return "engine_dead"
        if self._has_work() and now_s - self._probe_done_s >= self._probe_interval_s:
            self._probe_sent_s = now_s
            self._probe = asyncio.ensure_future(self._engine.probe())
        return ""

    async def wait_dead(self) -> str:
        """Return the reason as soon as :meth:`check` gives one."""
        try:
            while True:
                reason = self.check()
                if reason:
                    return reason
                await asyncio.sleep(self._poll_s)
        finally:
            if self._probe is not None:
                self._probe.cancel()
