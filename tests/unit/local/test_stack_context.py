"""``with LocalStack(...)``'s exit, as the test fixtures use it: a set-up step that fails after the start
reports every component's log tail before the stack stops (real child processes, stopped for real); a
block that ends normally reports nothing and stops it just the same."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tandem.local.stack import LocalStack, StackConfig

#: A stand-in component: says something distinctive (non-ASCII included), then waits to be stopped.
_CHATTY = "import sys, time; print('ready: naïve café 🚀 ' + sys.argv[1], flush=True); time.sleep(600)"


def _spawned(tmp_path: Path, lines: list[str]) -> LocalStack:
    stack = LocalStack(StackConfig(log_dir=tmp_path), progress=lines.append)
    for name in ("router", "decode"):
        stack._spawn(name, [sys.executable, "-c", _CHATTY, name], stack._base_env())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all("ready" in stack.tail(n) for n in ("router", "decode")):
        time.sleep(0.05)
    return stack


def test_a_failed_set_up_reports_every_log_tail_then_stops(tmp_path: Path) -> None:
    lines: list[str] = []
    stack = _spawned(tmp_path, lines)
    pids = [stack.pid("router"), stack.pid("decode")]
    # What `with LocalStack(...) as stack: load_adapters(stack)` does when the load raises.
    stack.__exit__(RuntimeError, RuntimeError("adapter load refused"), None)
    report = "\n".join(lines)
    assert "--- router log tail ---\nready: naïve café 🚀 router" in report
    assert "--- decode log tail ---\nready: naïve café 🚀 decode" in report
    assert not stack.is_running("router") and not stack.is_running("decode")
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_block_that_ends_normally_reports_nothing(tmp_path: Path) -> None:
    lines: list[str] = []
    stack = _spawned(tmp_path, lines)
    stack.__exit__(None, None, None)
    assert not any("log tail" in line for line in lines)
    assert not stack.is_running("router") and not stack.is_running("decode")
