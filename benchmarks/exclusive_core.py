"""Run a benchmark on a core of its own: ``python benchmarks/exclusive_core.py CMD [ARGS...]``.

While ``CMD`` runs, every other thread on the host that may be re-pinned (any process not started by
``CMD``; this needs root or the same user) is moved off core 0, so the router replica that
``benchmarks/router_fleet.py`` pins to core 0 shares it with nothing but its own threads: what
Kubernetes' static CPU manager gives a Guaranteed pod with whole CPUs. ``CMD`` and its descendants
are left alone (they pin themselves). New processes are swept every 0.5 s. Every thread moved is
put back as it was when ``CMD`` ends, or when this script is interrupted or terminated.

Only for a host that runs nothing that must keep core 0 (per-CPU kernel threads cannot be moved and
are left where they are). The router README's fleet figures of 2026-12-06 late evening were measured
this way: ``python benchmarks/exclusive_core.py python benchmarks/router_fleet.py --skip-replicas
--skip-fairness``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

#: The core left to the command.
CORE = 0
SWEEP_INTERVAL_S = 0.5


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def descends_from(pid: int, ancestors: set[int]) -> bool:
    for _ in range(64):
        if pid in ancestors:
            return True
        if pid <= 1:
            return False
        pid = parent_of(pid)
    return False


class Mover:
    def __init__(self, keep: set[int]) -> None:
        self._keep = keep
        self.moved: dict[int, set[int]] = {}

    def sweep(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or descends_from(int(entry), self._keep):
                continue
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{entry}/task")]
            except OSError:
                continue
            for tid in tids:
                if tid in self.moved:
                    continue
                try:
                    cores = os.sched_getaffinity(tid)
                    if CORE in cores:
                        os.sched_setaffinity(tid, (cores - {CORE}) or (set(range(os.cpu_count() or 2)) - {CORE}))
                        self.moved[tid] = cores
                except OSError:  # gone, or a per-CPU kernel thread
                    pass

    def restore(self) -> None:
        for tid, cores in self.moved.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass
        self.moved.clear()


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    if (os.cpu_count() or 1) < 2:
        print("exclusive_core: one core only; running the command as it is", file=sys.stderr)
        return subprocess.call(sys.argv[1:])
    command = subprocess.Popen(sys.argv[1:])
    mover = Mover({command.pid, os.getpid()})

    def stop(signum: int, _frame: FrameType | None) -> None:
        command.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while command.poll() is None:
            mover.sweep()
            time.sleep(SWEEP_INTERVAL_S)
    finally:
        mover.restore()
    return command.returncode


if __name__ == "__main__":
    sys.exit(main())
