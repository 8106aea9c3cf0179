"""The fault suite's segment check: a segment file is a live worker's while a live process maps it writable
(a decode's read-only mapping does not make it anyone's), a dead worker's is waited for within the lease,
and one left past it is reported as a leak that names it (real processes, killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tandem.worker.kv_connector.shm import SEGMENT_PREFIX
from tests.faults import report, segments
from tests.faults.ledger import FaultLedger

_MAPPER = textwrap.dedent(
    """
    import mmap, os, sys, time
    path, writable = sys.argv[1], sys.argv[2] == "rw"
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    mapped = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    print("mapped", flush=True)
    time.sleep(600)
    """
)


def _segment(directory: Path, name: str) -> Path:
    path = directory / (SEGMENT_PREFIX + name)
    path.write_bytes(b"\0" * 4096)
    return path


def _map(path: Path, mode: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", _MAPPER, str(path), mode], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
    return child


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "shm ü 東京 \u202eevil"  # the maps file prints the path as it is
    directory.mkdir()
    return directory


def test_a_segment_is_a_live_writers_and_an_orphan_once_its_writer_is_killed(shm_dir: Path) -> None:
    owned, read_only = _segment(shm_dir, "a" * 32), _segment(shm_dir, "b" * 32)
    (shm_dir / "tandem-kv-dir-id").write_text("not a segment")
    writer, reader = _map(owned, "rw"), _map(read_only, "r")
    try:
        assert segments.writers(shm_dir) == {owned: {writer.pid}}
        session = segments.session_of(writer.pid)  # 0 where the session's leader is outside this PID namespace
        assert session is not None and segments.owned_by(shm_dir, session) == {owned}
        assert [o.path for o in segments.orphans(shm_dir)] == [read_only]  # a decode's mapping owns nothing
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        assert sorted(o.path for o in segments.orphans(shm_dir)) == [owned, read_only]
    finally:
        for child in (writer, reader):
            child.kill()
            child.wait(10)


def test_the_check_waits_for_a_sweep_within_the_lease_and_names_what_outlived_it(
    shm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    swept = _segment(shm_dir, "c" * 32)
    sweeper = threading.Timer(1.0, swept.unlink)  # a survivor's sweeper, a second after the check began
    sweeper.start()
    started = time.monotonic()
    assert segments.left_behind(shm_dir, lease_s=30.0) == []
    assert 0.9 < time.monotonic() - started < 5
    sweeper.join()

    stale = _segment(shm_dir, "d" * 32)
    os.utime(stale, (time.time() - 100, time.time() - 100))  # untouched past its lease: nobody swept it
    left = segments.left_behind(shm_dir, lease_s=20.0)
    assert [o.path for o in left] == [stale] and 99 < left[0].age_s < 110
    ledger = FaultLedger(tmp_path / "ledger.jsonl")
    with pytest.raises(AssertionError, match=f"leaked 1 KV segment files: {stale}"), ledger.fault("swept") as f:
        f.tried()
        f.leaked("KV segment files", len(left), "; ".join(o.describe(20.0) for o in left))
    assert report.main([str(tmp_path / "ledger.jsonl")]) == 1
    out = capsys.readouterr().out
    assert str(stale) in out and "no live process maps it" in out
    assert out.splitlines()[-1] == "faults: 1 tried, 1 broken promises, 1 leaked"


def test_the_check_gives_up_after_the_lease_on_a_file_kept_fresh_by_no_owner(shm_dir: Path) -> None:
    fresh = _segment(shm_dir, "e" * 32)
    stop = threading.Event()

    def touch() -> None:
        while not stop.wait(0.1):
            os.utime(fresh)

    toucher = threading.Thread(target=touch)
    toucher.start()
    try:
        started = time.monotonic()
        assert [o.path for o in segments.left_behind(shm_dir, lease_s=0.2)] == [fresh]
        assert time.monotonic() - started < 0.2 + segments.SLACK_S + 2
    finally:
        stop.set()
        toucher.join()
