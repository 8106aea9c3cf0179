"""The fault suite (``make faults``; also part of ``make test``): real local
stacks on loopback (Redis, Ray Serve router, vLLM workers, gateway) that the
tests break on purpose. Each test module or package starts the stack it needs,
so that two stacks never run at once on a small machine; every fault is
recorded in the ledger (:mod:`tests.faults.ledger`)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.local.stack import LocalStack, StackConfig
from tests.faults.ledger import FaultLedger, ledger_path

_ledger: FaultLedger | None = None


@pytest.fixture(scope="session")
def ledger() -> FaultLedger:
    """One ledger per session; the file is started afresh by the first test that uses it."""
    global _ledger
    if _ledger is None:
        path = ledger_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        _ledger = FaultLedger(path)
    return _ledger


@contextlib.contextmanager
def running_stack(tmp_path_factory: pytest.TempPathFactory, label: str, **overrides: object) -> Iterator[LocalStack]:
    """A local stack on free ports with a private registry prefix; its logs' tails are printed if it fails."""
    log_dir = Path(tmp_path_factory.mktemp(f"{label}-logs"))
    # The fault suite is about the handoff: every request goes through a prefill worker unless a test
    # asks otherwise (local prefills are tested in tests/integration/test_local_prefill.py).
    overrides.setdefault("min_uncached_tokens_to_disaggregate", 0)
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-faults-{label}-{uuid.uuid4().hex[:6]}", log_dir=log_dir, **overrides
    )
    with LocalStack(config, progress=lambda msg: print(f"[{label} stack] {msg}", flush=True)) as stack:
        yield stack
