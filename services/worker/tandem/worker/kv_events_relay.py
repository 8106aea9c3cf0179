"""The engine's KV-event publisher, bound on the worker's own address only.

BlockStored events carry token ids: anyone who can subscribe reads every
tenant's recent prompts. vLLM's ZMQ publisher *binds* only a wildcard
(``tcp://*:port``) or an ipc/inproc endpoint and *connects* to any other, so it
cannot bind one address. When the worker's KV-event host is a specific address
(the pod IP in Kubernetes, 127.0.0.1 locally), the engine publishes on a private
ipc socket in this worker's temp folder and :class:`KVEventRelay` (XSUB → XPUB in
a thread of the worker process) republishes on ``tcp://<host>:<port>``, the
endpoint the worker registers. The replay socket needs no relay: vLLM binds its
ROUTER on any endpoint, the specific address included. With host ``0.0.0.0`` the
engine binds all interfaces itself, as before (then only the NetworkPolicy
keeps others out).

Started by :func:`tandem.worker.engine.build_engine` before the engine, closed at
shutdown.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass

import zmq

logger = logging.getLogger(__name__)

#: As vLLM's publisher: a subscriber that lags is dropped from, not waited for.
HWM_MESSAGES = 100_000
WILDCARD_HOSTS = ("", "0.0.0.0", "*", "::")


@dataclass(frozen=True)
class KVEventEndpoints:
    """Where the engine publishes and replays, and what the relay binds (None: no relay)."""

    engine_publish: str
    engine_replay: str
    #: (ipc endpoint the engine publishes on, tcp endpoint the relay republishes on)
    relay: tuple[str, str] | None


def plan_endpoints(host: str, port: int, replay_port: int, *, run_dir: str | None = None) -> KVEventEndpoints:
    """The engine's endpoints for a publisher reachable at ``host``: all interfaces when ``host`` is a
    wildcard, else a private ipc socket relayed to ``tcp://host:port``."""
    if host in WILDCARD_HOSTS:
        return KVEventEndpoints(f"tcp://*:{port}", f"tcp://*:{replay_port}", None)
    folder = run_dir or tempfile.gettempdir()
    ipc = f"ipc://{os.path.join(folder, f'tandem-kv-events-{port}-{os.getpid()}.sock')}"
    public = f"tcp://{_uri_host(host)}:{port}"
    return KVEventEndpoints(ipc, f"tcp://{_uri_host(host)}:{replay_port}", (ipc, public))


def _uri_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class KVEventRelay:
    """XSUB (connected to the engine's ipc publisher) → XPUB (bound on the worker's address)."""

    def __init__(self, engine_endpoint: str, public_endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._xsub = self._ctx.socket(zmq.XSUB)
        self._xpub = self._ctx.socket(zmq.XPUB)
        for sock in (self._xsub, self._xpub):
            sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
            sock.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
            sock.setsockopt(zmq.LINGER, 0)
        if public_endpoint.startswith("tcp://["):
            self._xpub.setsockopt(zmq.IPV6, 1)
        # Binding first: a taken port fails the worker's start, not a thread later.
        self._xpub.bind(public_endpoint)
        self._xsub.connect(engine_endpoint)  # the engine binds it when it starts; ZMQ reconnects until then
        self.public_endpoint = public_endpoint
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("kv events relayed", extra={"endpoint": self.public_endpoint})

    def _run(self) -> None:
        try:
            zmq.proxy(self._xsub, self._xpub)
        except zmq.ContextTerminated:
            pass
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                logger.exception("kv event relay stopped")
        finally:
            self._xsub.close(linger=0)
            self._xpub.close(linger=0)

    def close(self) -> None:
        if not self._thread.is_alive():
            self._xsub.close(linger=0)
            self._xpub.close(linger=0)
        self._ctx.term()  # the proxy's thread sees ETERM and closes its sockets
        self._thread.join(timeout=5)
