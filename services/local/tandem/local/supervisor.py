"""Restarts the local stack's components that exit, as Kubernetes restarts a pod's container: a
worker whose engine died exits (tandem.worker.liveness) and comes back.

A worker that exits is first forgotten: its registration is deleted within one poll (0.05 s), so
that the router, which notices a removal within ``registry_removal_check_interval_s`` (0.1 s; see
tandem.router.worker_view), stops placing on it within a second of its death, not after the
registry's TTL. A worker whose engine died deletes its own; one that was SIGKILLed or crashed cannot.

Started by :class:`tandem.local.stack.LocalStack` once the stack is up, when
``StackConfig.supervise`` is on (``make run``); it calls back into the stack to restart a
component (which kills what is left of it first: an engine's processes may outlive their worker,
holding its ports) and to wait for it to be ready.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class Supervised(Protocol):
    """What the supervisor needs of the stack."""

    @property
    def components(self) -> list[str]: ...

    def exit_status(self, name: str) -> int | None:
        """The component's exit status; None while it runs."""
        ...

    def forget(self, name: str) -> None:
        """``name`` exited: remove what it registered that it could not remove itself (a worker's
        registration), so that nothing is placed on it while it restarts."""
        ...

    def restart(self, name: str) -> None:
        """Start the component again (killing what is left of it first) and wait until it is ready;
        raises when it does not come back. Holds :attr:`lifecycle`."""
        ...

    @property
    def lifecycle(self) -> threading.RLock:
        """Held while a component is (re)started."""
        ...


class Supervisor:
    """Every ``poll_s``: a component that exited is started again after a backoff that doubles for
    each restart within a minute of the last one (``backoff_s`` up to ``max_backoff_s``, Kubernetes'
    CrashLoopBackOff shortened)."""

    def __init__(
        self,
        stack: Supervised,
        *,
        backoff_s: float,
        max_backoff_s: float,
        progress: Callable[[str], None],
        poll_s: float = 0.05,
    ) -> None:
        self._stack = stack
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._progress = progress
        self._poll_s = poll_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: Restarts so far, by component.
        self.restarts: dict[str, int] = {}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-supervisor", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def stopping_in_own_thread(self) -> bool:
        """True in the supervisor's thread once the stack is stopping: a restart it is waiting on gives up."""
        return self._stopping.is_set() and threading.current_thread() is self._thread

    def _run(self) -> None:
        backoff_s: dict[str, float] = {}
        last_restart_s: dict[str, float] = {}
        forgotten: set[str] = set()  # exited components whose registration was removed
        while not self._stopping.wait(self._poll_s):
            for name in self._stack.components:
                status = self._stack.exit_status(name)
                if status is None:
                    forgotten.discard(name)
                    continue
                if name not in forgotten:
                    forgotten.add(name)
                    try:
                        self._stack.forget(name)
                    except Exception as exc:  # Redis away: the registration expires by its TTL instead
                        self._progress(f"{name}: could not remove its registration: {exc}")
                if time.monotonic() - last_restart_s.get(name, -1e9) > 60:
                    backoff_s[name] = self._backoff_s
                wait_s = backoff_s.get(name, self._backoff_s)
                self._progress(f"{name} exited with {status}; restarting in {wait_s:.0f} s")
                if self._stopping.wait(wait_s):
                    return
                backoff_s[name] = min(self._max_backoff_s, wait_s * 2)
                last_restart_s[name] = time.monotonic()
                try:
                    with self._stack.lifecycle:
                        if self._stopping.is_set() or self._stack.exit_status(name) is None:
                            continue  # stopping, or someone else started it meanwhile
                        self.restarts[name] = self.restarts.get(name, 0) + 1
                        self._stack.restart(name)
                except RuntimeError as exc:  # StackError: it did not come back; tried again next round
                    self._progress(f"{name} did not come back: {exc}")
