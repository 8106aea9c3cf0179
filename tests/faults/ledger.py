"""The fault suite's ledger: what each fault or attack was, how often it was
tried, what the client saw, what leaked, and whether its promise held.

Every fault test wraps its work in ``with ledger.fault("name") as f:``. An
exception escaping the block (a failed assertion) is recorded as a broken
promise and re-raised, so the ledger cannot say "held" for a test that failed.
Records are appended as JSON lines to one file per run; ``tests.faults.report``
turns them into the table that ``make faults`` prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_LEDGER_PATH = Path(".run/faults/ledger.jsonl")


def ledger_path() -> Path:
    return Path(os.environ.get("TANDEM_FAULTS_LEDGER", str(DEFAULT_LEDGER_PATH)))


@dataclass
class FaultRecord:
    """One fault or attack, as one test exercised it."""

    name: str
    num_tried: int = 0
    client_saw: Counter[str] = field(default_factory=Counter)
    #: What leaked, by kind ("kv blocks", "running requests", "router budget", "quota tokens", ...).
    leaks: dict[str, float] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)

    def tried(self, num: int = 1) -> None:
        """Count attempts of this fault (one killed worker, one hostile request, ...)."""
        self.num_tried += num

    def saw(self, what: str, num: int = 1) -> None:
        """What the client observed, in a few words ("HTTP 413 invalid_request_error", "SSE error event")."""
        self.client_saw[what] += num

    def leaked(self, kind: str, amount: float, what: str = "") -> None:
        """Record a leak measurement (0 means nothing leaked); a non-zero amount fails the promise, its
        message naming ``what`` leaked (the files, the keys) where the caller knows."""
        self.leaks[kind] = self.leaks.get(kind, 0) + amount
        if amount:
            raise AssertionError(f"{self.name}: leaked {amount} {kind}" + (f": {what}" if what else ""))

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "tried": self.num_tried,
            "client_saw": dict(self.client_saw),
            "leaks": self.leaks,
            "broken": self.broken,
            "at": time.time(),
        }


class FaultLedger:
    """Appends one JSON line per :meth:`fault` block to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def fault(self, name: str) -> Iterator[FaultRecord]:
        record = FaultRecord(name)
        try:
            yield record
        except BaseException as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            record.broken.append(f"{type(exc).__name__}: {first_line}"[:300])
            self._write(record)
            raise
        if record.num_tried == 0:
            record.broken.append("the test tried nothing")
        self._write(record)
        if record.broken:
            raise AssertionError(f"{name}: {record.broken[0]}")

    def _write(self, record: FaultRecord) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record.to_json()) + "\n")
