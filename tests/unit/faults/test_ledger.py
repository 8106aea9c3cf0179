"""The fault suite's ledger and report: a failed promise or a leak can never
read as "held", and a test that tried nothing is a failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults import report
from tests.faults.ledger import FaultLedger


def test_held_broken_leaked_and_idle_faults_are_reported_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ledger.jsonl"
    ledger = FaultLedger(path)
    with ledger.fault("held") as f:
        f.tried(3)
        f.saw("HTTP 413")
        f.leaked("kv blocks", 0)
    with pytest.raises(AssertionError, match="boom"), ledger.fault("broken") as f:
        f.tried()
        raise AssertionError("boom")
    with pytest.raises(AssertionError, match="leaked 4 kv blocks"), ledger.fault("leaky") as f:
        f.tried()
        f.leaked("kv blocks", 4)
    with pytest.raises(AssertionError, match="tried nothing"), ledger.fault("idle"):
        pass

    assert report.main([str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "faults: 5 tried, 3 broken promises, 4 leaked"
    rows = {line.split("  ")[0]: line for line in lines[3:-1]}
    assert rows["held"].rstrip().endswith("held")
    assert "BROKEN: AssertionError: boom" in rows["broken"]
    assert "BROKEN" in rows["leaky"] and "kv blocks 4" in rows["leaky"]
    assert "BROKEN: the test tried nothing" in rows["idle"]


def test_an_empty_ledger_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(tmp_path / "missing.jsonl")]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "faults: 0 tried, 0 broken promises, 0 leaked"
