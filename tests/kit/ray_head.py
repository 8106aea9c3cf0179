"""A local Ray head's processes, for tests that start one with ``ray start --head`` and must stop or kill
exactly it (never a global ``ray stop``: other Ray clusters may run on the host)."""

from __future__ import annotations

import os
from pathlib import Path


def head_processes(session: int | None, temp_dir: Path) -> list[int]:
    """Pids of a head's processes: its session (``ray start``'s pid, ``session``), and Ray's workers that
    left it for groups of their own (the controller, proxy and replica actors), found by the head's temp
    dir in their command line. Never this process, nor a zombie (dead, not yet reaped)."""
    found = []
    marker = str(temp_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes()
            sid = os.getsid(pid)
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, ProcessLookupError, IndexError):
            continue
        # A zombie is dead, only not yet reaped: in a PID namespace whose init does not reap orphans (pytest
        # as its pid 1 under `unshare -p -f`), the killed head's processes stay zombies.
        if state != "Z" and pid != os.getpid() and (sid == session or marker in cmdline):
            found.append(pid)
    return found
