"""Which CPUs the connector's own threads run on.

On the CPU backend vLLM pins the model-runner process's threads to the engine's cores
(``VLLM_CPU_OMP_THREADS_BIND``; OpenMP binds the main thread, and every thread started from it
inherits the pin). The KV server's and the puller's threads are started from those threads, so
without this module they share the one core that runs the forward pass: a prefill's KV stream
could only move while the forward pass waited, never beside it (read from ``/proc/<pid>/task/*/
status`` of a running stack on 2026-12-05: every thread of both workers' model runners, gRPC's
``event_engine`` threads included, allowed one core). vLLM's own NIXL connector on CPU moves its
transfer threads to a core it reserves (``nixl/base_worker.py``) for the same reason.

``kv.thread_cpus`` (``kv_connector_extra_config["thread_cpus"]``) moves the connector's threads
to other CPUs: "all" (every CPU the worker process could use before the engine pinned it, read
in the unpinned API process by ``tandem.worker.engine``) or a list. **It is off by default
("inherit"), because on a host where every core runs an engine it measured worse**: ``make
bench-kv --engines --num-requests 12`` twice on 2026-12-05, 1 prefill + 1 decode on two cores,
~2k-token prompts, plain ITL p50 74 ms both times:

=============================  ===================  ======================
                               inherit (the pin)    all (moved)
=============================  ===================  ======================
second-token gap p50, prefetch 214 ms (2.90x ITL)   299 ms (4.03x)
prefetch's wait for its tail   39 ms                81 ms
pull after the prefill         103 ms               387 ms
=============================  ===================  ======================

Moved threads land on the other engine's core, where they are time-sliced against an engine
that is also busy (or spinning in OpenMP's wait), and both sides of a transfer lose their cache.
Where a core is free for the transfer (vLLM's NIXL connector reserves one), name it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}; ``""`` -> the empty set. Raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if low < 0 or high < low:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def move_this_thread(cpus: Iterable[int]) -> bool:
    """Let the calling thread (and the threads it starts from now on) run on ``cpus``; False, and
    nothing changed, when the set is empty, the platform cannot pin, or the OS refuses it (CPUs
    outside the container's cpuset)."""
    wanted = set(cpus)
    if not wanted or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, wanted)  # 0: the calling thread on Linux, not the whole process
    except OSError as exc:
        logger.warning("KV threads stay on CPUs %s: cannot move them to %s (%s)", _allowed(), sorted(wanted), exc)
        return False
    return True


@contextlib.contextmanager
def threads_started_on(cpus: Iterable[int]) -> Iterator[None]:
    """Threads started inside the block (by this thread, or by native code it calls, such as a gRPC
    server's pollers) run on ``cpus``; the calling thread gets its own CPUs back afterwards."""
    before = _allowed()
    moved = move_this_thread(cpus)
    try:
        yield
    finally:
        if moved and before:
            os.sched_setaffinity(0, before)


def _allowed() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
