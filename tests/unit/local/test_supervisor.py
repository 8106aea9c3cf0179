"""The local stack's supervisor and ``python -m tandem.local``'s flags: a component that exits is
started again (a real child process, killed for real), an exited worker is forgotten (its
registration removed) at once, once, before its restart (against a scripted stack), and the command
line takes --help and the pool sizes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tandem.local.__main__ import config_from_args, parse_args
from tandem.local.stack import LocalStack, StackConfig, free_port
from tandem.local.supervisor import Supervisor

#: A stand-in gateway: answers /readyz, nothing else (the supervisor restarts what exited and waits for
#: its readiness as it would for the real gateway).
_READY_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_component_that_exits_is_started_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    config = StackConfig(gateway_port=port, log_dir=tmp_path, supervise=True, restart_backoff_s=0.2)
    stack = LocalStack(config)
    try:
        stack._spawn("gateway", [sys.executable, "-c", _READY_SERVER, str(port)], stack._base_env())
        stack._wait("gateway", stack._gateway_ready, timeout_s=30)
        stack.supervisor.start()
        first_pid = stack.pid("gateway")
        stack.kill("gateway", signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (stack.restarts.get("gateway") and _ready(stack)):
            time.sleep(0.1)
        assert stack.restarts == {"gateway": 1}
        assert stack.is_running("gateway") and stack.pid("gateway") != first_pid
    finally:
        stack.stop()
    assert not stack.is_running("gateway")


def _ready(stack: LocalStack) -> bool:
    """The restarted child answers /readyz (refused while it is still starting)."""
    try:
        return stack._gateway_ready()
    except httpx.HTTPError:
        return False


def test_flags_set_the_pool_sizes_and_supervision() -> None:
    config = config_from_args(parse_args(["--prefill-workers", "2", "--decode-workers", "3"]))
    assert list(config.worker_ports()) == ["prefill", "prefill-1", "decode", "decode-1", "decode-2"]
    assert config.supervise
    assert not config_from_args(parse_args(["--no-supervise"])).supervise
    with pytest.raises(SystemExit):
        parse_args(["--decode-workers", "0"])


def test_help_prints_the_flags_and_starts_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.local", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "--prefill-workers" in result.stdout and "--decode-workers" in result.stdout
    assert "starting" not in result.stdout


class ScriptedStack:
    def __init__(self, *, forget_fails: bool = False) -> None:
        self.status: dict[str, int | None] = {"decode": None, "router": None}
        self.events: list[tuple[str, str]] = []
        self.lifecycle = threading.RLock()
        self._forget_fails = forget_fails

    @property
    def components(self) -> list[str]:
        return list(self.status)

    def exit_status(self, name: str) -> int | None:
        return self.status[name]

    def forget(self, name: str) -> None:
        self.events.append(("forget", name))
        if self._forget_fails:
            raise ConnectionError("redis away")

    def restart(self, name: str) -> None:
        self.events.append(("restart", name))
        self.status[name] = None


def _run(stack: ScriptedStack, notes: list[str], until: float = 3.0) -> Supervisor:
    supervisor = Supervisor(stack, backoff_s=0.3, max_backoff_s=1.0, progress=notes.append, poll_s=0.01)
    supervisor.start()
    stack.status["decode"] = -9  # SIGKILLed
    deadline = time.monotonic() + until
    while ("restart", "decode") not in stack.events and time.monotonic() < deadline:
        time.sleep(0.01)
    supervisor.stop()
    return supervisor


def test_an_exited_worker_is_forgotten_at_once_then_restarted_after_the_backoff() -> None:
    stack = ScriptedStack()
    notes: list[str] = []
    started = time.monotonic()
    forgotten_at: list[float] = []
    forget = stack.forget

    def timed_forget(name: str) -> None:
        forgotten_at.append(time.monotonic() - started)
        forget(name)

    stack.forget = timed_forget  # type: ignore[method-assign]
    supervisor = _run(stack, notes)
    assert stack.events == [("forget", "decode"), ("restart", "decode")]
    assert forgotten_at[0] < 0.25  # within a poll or two, not after the 0.3 s backoff
    assert supervisor.restarts == {"decode": 1}


def test_a_failure_to_forget_is_reported_and_the_restart_still_happens() -> None:
    stack = ScriptedStack(forget_fails=True)
    notes: list[str] = []
    supervisor = _run(stack, notes)
    assert stack.events == [("forget", "decode"), ("restart", "decode")]
    assert any("could not remove its registration" in n for n in notes), notes
    assert supervisor.restarts == {"decode": 1}
