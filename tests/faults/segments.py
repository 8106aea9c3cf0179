"""The KV handoff's shared-memory segment files (``tandem-kv-seg-*``, :mod:`tandem.worker.kv_connector.shm`)
in a stack's directory, and which of them no live worker owns any more.

A prefill worker keeps its segments mapped read-write as long as it lives (its pool reuses them; it
unlinks one it replaces), a decode worker maps its peers' segments read-only. So a segment file that no
live process maps read-write is a dead worker's, and the promise is that the surviving workers' sweepers
remove it within the KV lease of its death (its owner touched it every quarter lease while alive, and
they remove what was untouched for three quarters of a lease): :func:`left_behind` waits for that and
names what outlived it. The owner is read from ``/proc/<pid>/maps``, not from the file's time, so that a
sweeper that never runs, or a touch that never happens, cannot hide a leak from the check."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.worker.kv_connector.shm import SEGMENT_PREFIX

#: Beyond the lease: a sweeper's pass is not instantaneous on a loaded 2-core machine.
SLACK_S = 3.0


def segment_dir(label: str) -> Path:
    """A fresh directory for one stack's segments, in the host's shared memory (/dev/shm) where there is one,
    so that no other stack's segments (nor vLLM's own files there) are counted with this one's."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix=f"tandem-faults-{label}-", dir=base))


def segment_files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.name.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []


def writers(directory: Path, pids: list[int] | None = None) -> dict[Path, set[int]]:
    """Each segment file of ``directory`` that a live process (of ``pids``; None: any) maps shared and writable,
    with those processes."""
    prefix = os.path.join(os.path.realpath(directory), SEGMENT_PREFIX)
    found: dict[Path, set[int]] = {}
    maps_files = [Path(f"/proc/{pid}/maps") for pid in pids] if pids is not None else Path("/proc").glob("[0-9]*/maps")
    for maps in maps_files:
        try:
            text = os.fsdecode(maps.read_bytes())  # a path as the file system names it
        except OSError:  # gone meanwhile, or another user's
            continue
        if prefix not in text:
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            # address, perms ("rw-s": shared, writable), offset, device, inode, path
            shared_writable = len(fields) == 6 and fields[1].startswith("rw") and fields[1].endswith("s")
            if shared_writable and fields[5].startswith(prefix):
                found.setdefault(Path(fields[5]), set()).add(int(maps.parent.name))
    return found


def session_of(pid: int) -> int | None:
    """The session of process ``pid`` (None: gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[3])  # after the command: state, ppid, pgrp, session


def owned_by(directory: Path, session_id: int) -> set[Path]:
    """The segment files of ``directory`` that processes of session ``session_id`` map writable: one local
    stack component's (each is started in a session of its own, its engine's processes in it too)."""
    return {path for path, pids in writers(directory).items() if any(session_of(p) == session_id for p in pids)}


@dataclass(frozen=True)
class Orphan:
    """A segment file no live process owns: a dead worker's."""

    path: Path
    #: Seconds since its owner last touched it.
    age_s: float

    def describe(self, lease_s: float) -> str:
        return f"{self.path} (untouched for {self.age_s:.0f} s, KV lease {lease_s:g} s; no live process maps it)"


def orphans(directory: Path) -> list[Orphan]:
    owned = writers(directory)
    now = time.time()
    found = []
    for path in segment_files(directory):
        if path in owned:
            continue
        try:
            found.append(Orphan(path, now - path.stat().st_mtime))
        except FileNotFoundError:
            continue  # swept meanwhile
    return found


def left_behind(directory: Path, lease_s: float) -> list[Orphan]:
    """The dead workers' segments of ``directory`` still there past their lease: waits while any orphan is
    within its lease (one a sweeper may still remove), so a check after a kill costs at most the lease (and
    gives up then: a file that keeps looking fresh with nobody mapping it is left behind too)."""
    deadline = time.monotonic() + lease_s + SLACK_S
    while True:
        found = orphans(directory)
        if all(o.age_s > lease_s + SLACK_S for o in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
