"""Shared-memory segments: the KV handoff's data path between two workers of one host.

Two workers share the path when they run on the same host (:func:`host_id`: the
configured node name, else the kernel's boot id) and open the same directory
(:func:`dir_token`: a random token kept in a file of the directory, so two
containers that mount one volume at different paths still match, and two that
each have a private ``/dev/shm`` do not). :mod:`shm_transport` decides per pair
and moves the bytes; this module owns the files.

The prefill side keeps a bounded :class:`SegmentPool` of segment files
(``tandem-kv-seg-<random>``, mode 0600), each mapped once and kept: a fresh
file's pages cost a page fault each on first write (measured here at
0.35-0.4 GB/s, against 2-4 GB/s into pages already there), so a segment is
reused by pull after pull and only replaced when a larger pull needs more.
The decode side maps a segment once too (:class:`SegmentMaps`) and keeps the
mapping for the next pull that names it.

No segment outlives its owner for long: the owning process touches its
segments' files every ``max_age_s / 4``; every worker with shared memory on
(either role) removes ``tandem-kv-seg-*`` files of its directory older than
``max_age_s * 3 / 4`` (:class:`Sweeper`), so the segments of a killed worker
are gone within ``max_age_s`` (the KV lease) of its death, as long as one
worker of the host runs (a restarted worker sweeps at its start). A segment's
use by one pull is the hold's: see :mod:`shm_transport`."""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

logger = logging.getLogger(__name__)

SEGMENT_PREFIX: Final = "tandem-kv-seg-"
#: A segment's name as a peer may name it (anything else is refused: no path, no other file).
SEGMENT_NAME: Final = re.compile(r"tandem-kv-seg-[0-9a-f]{32}")
DIR_TOKEN_FILE: Final = "tandem-kv-dir-id"
#: Why a pull through shared memory fell back to gRPC (``tandem_kv_shm_fallbacks_total{reason}``).
FALLBACK_REASONS: Final = ("segment_missing", "wrong_size", "permission", "peer_refused", "failed")
_BOOT_ID: Final = Path("/proc/sys/kernel/random/boot_id")
#: Segments grow in steps of this (a pull slightly larger than the last reuses the same segment).
_SEGMENT_ALIGN_BYTES: Final = 1 << 20


class ShmError(Exception):
    """The shared-memory path cannot serve this pull; ``reason`` is the metric's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def host_id(node_name: str = "") -> str:
    """This host's identity: ``node_name`` when configured, else the kernel's boot id (the same in
    every container of the host), else the host name."""
    if node_name:
        return node_name
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()


def dir_token(directory: str) -> str:
    """The identity of ``directory``: the token in its :data:`DIR_TOKEN_FILE`, written by the first
    worker that looks (atomically: written aside, then linked into place)."""
    path = Path(directory) / DIR_TOKEN_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    token = secrets.token_hex(16)
    aside = Path(directory) / f".{DIR_TOKEN_FILE}.{token}"
    aside.write_text(token)
    try:
        os.link(aside, path)
    except FileExistsError:
        pass  # another worker was first: its token is the directory's
    finally:
        aside.unlink(missing_ok=True)
    return path.read_text().strip()


@dataclass
class Segment:
    """One segment file, mapped read-write; ``owner`` (a request id) uses it, "" when free."""

    name: str
    path: Path
    size_bytes: int
    map: mmap.mmap
    owner: str = ""
    #: When ``owner`` took it (monotonic seconds).
    owned_since_s: float = 0.0

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view still exported: the mapping goes with it
            logger.warning("segment %s still viewed at close", self.name)
        self.path.unlink(missing_ok=True)


class SegmentPool:
    """At most ``max_segments`` segment files in ``directory``, each used by one owner at a time, and for at
    most ``max_owned_s`` (the KV lease: past it, no hold can still need it, whatever missed releasing it)."""

    def __init__(self, directory: str, max_segments: int, max_owned_s: float) -> None:
        self._directory = Path(directory)
        self.max_segments = max_segments
        #: The longest one owner keeps a segment (the KV lease).
        self.max_owned_s = max_owned_s
        self._segments: list[Segment] = []
        self._lock = threading.Lock()
        #: Notified when a segment is freed (an acquire waiting for one looks again).
        self._freed = threading.Condition(self._lock)

    def acquire(self, num_bytes: int, owner: str, wait_s: float = 0.0) -> Segment | None:
        """A free segment of at least ``num_bytes`` for ``owner`` (created, or replacing a smaller free
        one); None when every segment is still in use after ``wait_s`` seconds, or the directory has no room."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                segment, busy = self._acquire_locked(num_bytes, owner)
                left_s = deadline - time.monotonic()
                if segment is not None or not busy or left_s <= 0:
                    return segment
                self._freed.wait(left_s)

    def _acquire_locked(self, num_bytes: int, owner: str) -> tuple[Segment | None, bool]:
        """(the segment, or None and whether because every segment is in use); the lock held."""
        now = time.monotonic()
        for segment in self._segments:
            if segment.owner and now - segment.owned_since_s > self.max_owned_s:
                logger.warning("KV segment of %s was not released within the lease; reused", segment.owner)
                segment.owner = ""
        free = sorted((s for s in self._segments if not s.owner), key=lambda s: s.size_bytes)
        fitting = next((s for s in free if s.size_bytes >= num_bytes), None)
        if fitting is None:
            if len(self._segments) >= self.max_segments:
                if not free:
                    return None, True
                smallest = free[0]
                self._segments.remove(smallest)
                smallest.close()
            fitting = self._create(num_bytes)
            if fitting is None:
                return None, False
            self._segments.append(fitting)
        fitting.owner, fitting.owned_since_s = owner, now
        return fitting, False

    def _create(self, num_bytes: int) -> Segment | None:
        size = max(_SEGMENT_ALIGN_BYTES, -(-num_bytes // _SEGMENT_ALIGN_BYTES) * _SEGMENT_ALIGN_BYTES)
        name = SEGMENT_PREFIX + secrets.token_hex(16)
        path = self._directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            logger.warning("cannot create a KV segment in %s: %s", self._directory, exc)
            return None
        try:
            # The pages now, not a fault each on the first pull (tmpfs: fails when the directory is full).
            os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            path.unlink(missing_ok=True)
            logger.warning("cannot size a KV segment of %d bytes in %s: %s", size, self._directory, exc)
            return None
        finally:
            os.close(fd)
        return Segment(name, path, size, mapped)

    def release(self, segment: Segment) -> None:
        with self._lock:
            segment.owner = ""
            self._freed.notify_all()

    def release_owner(self, owner: str) -> int:
        """Free every segment ``owner`` uses; how many there were."""
        with self._lock:
            mine = [s for s in self._segments if s.owner == owner]
            for segment in mine:
                segment.owner = ""
            if mine:
                self._freed.notify_all()
            return len(mine)

    def names(self) -> set[str]:
        with self._lock:
            return {s.name for s in self._segments}

    def in_use(self) -> int:
        with self._lock:
            return sum(1 for s in self._segments if s.owner)

    def touch(self) -> None:
        """Mark this pool's files alive for the sweepers (theirs and other workers')."""
        for name in self.names():
            try:
                os.utime(self._directory / name)
            except FileNotFoundError:
                logger.warning("KV segment %s was removed under this worker", name)

    def close(self) -> None:
        with self._lock:
            segments, self._segments = self._segments, []
        for segment in segments:
            segment.close()


def sweep(directory: str, max_age_s: float, keep: set[str]) -> list[str]:
    """Remove the segment files of ``directory`` not in ``keep`` and untouched for ``max_age_s``
    (their owner died); the names removed."""
    cutoff = time.time() - max_age_s
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(SEGMENT_PREFIX) or entry.name in keep:
            continue
        try:
            if entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue  # gone already, or another user's
    if removed:
        logger.info("removed %d KV segments of dead workers from %s", len(removed), directory)
    return removed


class SegmentMaps:
    """The decode side's read-only mappings of peers' segments, by name, the latest ``max_maps`` kept."""

    def __init__(self, directory: str, max_maps: int = 8) -> None:
        self._directory = Path(directory)
        self._max_maps = max_maps
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()

    def view(self, name: str, num_bytes: int) -> memoryview:
        """The first ``num_bytes`` of segment ``name`` (release the view when done). Raises
        :class:`ShmError` (segment_missing, permission, wrong_size, peer_refused)."""
        if not SEGMENT_NAME.fullmatch(name):
            raise ShmError("peer_refused", f"the peer named a segment {name[:80]!r}")
        with self._lock:
            mapped = self._maps.get(name)
            if mapped is not None and len(mapped) >= num_bytes:
                self._maps.move_to_end(name)
                return memoryview(mapped)[:num_bytes]
        path = self._directory / name
        try:
            # Never through a link: a name in a shared directory is not proof of who made the file.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError as exc:
            raise ShmError("segment_missing", f"no segment {name} in {self._directory}") from exc
        except PermissionError as exc:
            raise ShmError("permission", f"segment {name} in {self._directory}: {exc.strerror}") from exc
        except OSError as exc:  # ELOOP: a symbolic link
            raise ShmError("peer_refused", f"segment {name} in {self._directory}: {exc.strerror}") from exc
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise ShmError("peer_refused", f"segment {name} in {self._directory} is not a file")
            size = status.st_size
            if size < num_bytes:
                raise ShmError("wrong_size", f"segment {name} has {size} bytes, the pull {num_bytes}")
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with self._lock:
            self._maps[name] = mapped
            while len(self._maps) > self._max_maps:
                _, old = self._maps.popitem(last=False)
                _close_map(old)
        return memoryview(mapped)[:num_bytes]

    def prune(self) -> None:
        """Drop the mappings of segments whose files are gone (their memory goes with the mapping)."""
        with self._lock:
            gone = [n for n in self._maps if not (self._directory / n).exists()]
            for name in gone:
                _close_map(self._maps.pop(name))

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), OrderedDict()
        for mapped in maps:
            _close_map(mapped)


def _close_map(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:
        logger.warning("a KV segment mapping is still viewed; left to the garbage collector")


class Sweeper:
    """Every ``max_age_s / 4`` on a thread of its own (and once at start): ``touch`` this worker's segments,
    remove dead workers' (:func:`sweep`), and ``prune`` stale mappings."""

    def __init__(
        self,
        directory: str,
        max_age_s: float,
        pool: SegmentPool,
        maps: SegmentMaps,
        on_sweep: Callable[[list[str]], None] = lambda removed: None,
    ) -> None:
        self._directory = directory
        self._max_age_s = max_age_s
        self._pool = pool
        self._maps = maps
        self._on_sweep = on_sweep
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-kv-shm-sweeper", daemon=True)

    def start(self) -> None:
        self.once()
        self._thread.start()

    def once(self) -> None:
        self._pool.touch()
        self._on_sweep(sweep(self._directory, self._max_age_s * 0.75, self._pool.names()))
        self._maps.prune()

    def _run(self) -> None:
        while not self._stop.wait(self._max_age_s / 4):
            try:
                self.once()
            except Exception:  # the sweeper must not die of one bad entry
                logger.exception("KV segment sweep failed")

    def stop(self) -> None:
        self._stop.set()
