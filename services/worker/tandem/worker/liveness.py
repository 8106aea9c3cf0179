"""Is the engine alive? An engine that died is a worker that dies.

Run by ``__main__`` as a task beside the gRPC server: :meth:`EngineWatch.wait_dead`
returns, with the reason, as soon as one of these holds (checked every
``poll_s``, 0.1 s by default, so a death is seen within that):

* ``engine_dead``: vLLM says its engine errored (``AsyncLLM.errored``: the
  engine-core process exited, or an exception in a step killed it; vLLM's own
  monitor thread notices the process at once, and every request in flight gets
  ``EngineDeadError``);
* ``engine_stuck``: requests are in flight and the engine has finished no step
  for ``step_timeout_s`` (a hung kernel, a deadlocked collective). The caller
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

    def num_steps(self) -> int:
        """Engine steps finished so far (any monotonic count that moves with each step)."""
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._has_work = has_work
        self._step_timeout_s = step_timeout_s
        self._poll_s = poll_s
        self._clock = clock
        self._last_steps = -1
        #: When the step count last moved, or the engine last had nothing to do.
        self._progress_at_s = clock()

    def check(self) -> str:
        """"" while the engine is alive, else ``engine_dead`` or ``engine_stuck``."""
        if self._engine.is_dead():
            return "engine_dead"
        now_s = self._clock()
        steps = self._engine.num_steps()
        if steps != self._last_steps or not self._has_work():
            self._last_steps = steps
            self._progress_at_s = now_s
            return ""
        if now_s - self._progress_at_s > self._step_timeout_s:
            return "engine_stuck"
        return ""

    async def wait_dead(self) -> str:
        """Return the reason as soon as :meth:`check` gives one."""
        while True:
            reason = self.check()
            if reason:
                return reason
            await asyncio.sleep(self._poll_s)
