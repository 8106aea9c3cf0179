"""The fault suite (``make faults``; also part of ``make test``): real local
stacks on loopback (Redis, Ray Serve router, vLLM workers, gateway) that the
tests break on purpose. Each test module or package starts the stack it needs,
so that two stacks never run at once on a small machine; every fault is
recorded in the ledger (:mod:`tests.faults.ledger`).

Each stack's workers share a shared-memory directory of its own for the KV handoff (as a node's
workers share the chart's volume), and after every test no segment file in it may have outlived
its worker by more than the KV lease (:mod:`tests.faults.segments`): a leftover is a leak in the
report, named."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.local.stack import LocalStack, StackConfig
from tests.faults import segments
from tests.faults.ledger import FaultLedger, ledger_path

_ledger: FaultLedger | None = None
#: The stacks :func:`running_stack` has up now (checked for segments left behind after every test).
_open_stacks: list[LocalStack] = []
#: The ledger's row of the segment check, one for every test that ran with a stack up.
SEGMENTS_SWEPT = "no KV segment file outlives its worker by more than the KV lease (after every test)"


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
    # The stack's own shared-memory directory (the segment check counts exactly its workers' files).
    made_shm_dir = None if "kv_shm_dir" in overrides else segments.segment_dir(label)
    if made_shm_dir is not None:
        overrides["kv_shm_dir"] = made_shm_dir
    try:
        config = StackConfig.with_free_ports(
            key_prefix=f"tandem-faults-{label}-{uuid.uuid4().hex[:6]}", log_dir=log_dir, **overrides
        )
        with LocalStack(config, progress=lambda msg: print(f"[{label} stack] {msg}", flush=True)) as stack:
            _open_stacks.append(stack)
            try:
                yield stack
            finally:
                _open_stacks.remove(stack)
    finally:
        if made_shm_dir is not None:
            shutil.rmtree(made_shm_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def kv_segments_swept(ledger: FaultLedger) -> Iterator[None]:
    """After each test: every segment file of a stack up is a live worker's, or goes within the KV lease
    of its worker's death (the check waits that long at most); one left past it is a leak, named."""
    yield
    stacks = [s for s in _open_stacks if s.config.kv_shm_dir is not None]
    if not stacks:
        return
    with ledger.fault(SEGMENTS_SWEPT) as f:
        for stack in stacks:
            assert stack.config.kv_shm_dir is not None
            lease_s = stack.config.kv_lease_s
            left = segments.left_behind(stack.config.kv_shm_dir, lease_s)
            f.tried()
            f.leaked("KV segment files", len(left), "; ".join(o.describe(lease_s) for o in left))
