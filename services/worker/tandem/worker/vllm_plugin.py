"""A vLLM general plugin (entry point ``vllm.general_plugins``, loaded by vLLM
in each of its processes) that changes how an engine's processes wait for each
other; it acts only where :data:`ENV` is set, which the worker sets for its own
engines (``engine.mq_poll_s``), so a plain vLLM on the same host is untouched.

vLLM's shared-memory message queues (scheduler to model runner and back) wait
for the next message by spinning on ``sched_yield`` for a second after each
one (``SpinCondition.wait``). On a GPU that keeps a step's hand-off in
microseconds while host cores idle. On vLLM's CPU backend the cores are the
accelerator: a process spinning there takes a fair share of the core a forward
pass needs. Measured on the two-core local stack: the idle prefill engine's
model runner held its core at 100 % for a second after each step, the decode
engine's scheduler spun while its model runner computed, and the decode's first
step after a handoff took 62-450 ms against plain vLLM's 58 ms steps. With a
waiting reader sleeping ``engine.mq_poll_s`` (0.5 ms) between looks, ``make
bench-kv``'s second-token gap p50 went from 181 ms (3.10x plain vLLM's ITL) to
100 ms (1.76x). After the busy second vLLM's own wait (a socket poll) runs as
before.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

# Under vLLM's logger: its engine processes configure only that one.
logger = logging.getLogger("vllm.plugins.tandem_mq_poll")

#: Seconds a waiting message-queue reader sleeps between looks; unset or 0: vLLM's own busy loop.
ENV = "TANDEM_ENGINE_MQ_POLL_S"
_PATCHED = "_tandem_poll_s"


def register() -> None:
    """Entry point: patch ``SpinCondition.wait`` in this process when :data:`ENV` asks for it."""
    poll_s = float(os.environ.get(ENV) or 0)
    if poll_s <= 0:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # pragma: no cover - depends on the vLLM version
        logger.warning("%s is set but this vLLM has no shm_broadcast.SpinCondition; left as it is", ENV)
        return
    original = getattr(SpinCondition, "wait", None)
    if original is None or getattr(original, _PATCHED, None) is not None:
        return  # not this vLLM's shape, or patched already (vLLM may load plugins more than once)

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        # vLLM's wait: within busy_loop_s of the last read it yields and returns, the caller looks
        # again; past it, it polls the notify socket. Sleep instead of yielding in the busy part.
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(poll_s)
            return
        original(self, timeout_ms)

    setattr(wait, _PATCHED, poll_s)
    SpinCondition.wait = wait
    logger.info("vLLM message-queue readers sleep %.2g ms between looks while busy (%s)", poll_s * 1e3, ENV)
