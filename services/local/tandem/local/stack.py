"""Starts and stops the local stack: Redis (unless one answers already), the
Ray Serve router, one prefill and one decode worker, and the gateway, each a
child process with its own log file. Readiness is probed the way a client
would see it (Health RPC, a router Release call, the gateway's /readyz)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import redis

from tandem.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

#: Ports handed to the stack's servers come from here: below Linux's ephemeral range (where
#: bind(0), outgoing connections and Ray's gRPC servers take theirs) and above Ray's worker ports.
_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free right now on all interfaces, never handed out before by this process."""
    for _ in range(1000):
        port = random.randrange(*_PORT_RANGE)
        if port in _handed_out:
            continue
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
        except OSError:
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


def default_model_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"


@dataclass
class StackConfig:
    """Ports and places of one local stack."""

    model_dir: Path = field(default_factory=default_model_dir)
    served_model_name: str = "SmolLM2-135M-Instruct"
    host: str = "127.0.0.1"
    gateway_port: int = 8080
    router_grpc_port: int = 9000
    router_http_port: int = 8001
    prefill_port: int = 50051
    prefill_kv_port: int = 50061
    prefill_metrics_port: int = 9101
    decode_port: int = 50052
    decode_kv_port: int = 50062
    decode_metrics_port: int = 9102
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tandem"
    max_model_len: int = 4096
    kv_cache_bytes: int = 1 << 30
    kv_lease_s: float = 60.0
    log_dir: Path = Path(".run/logs")
    #: Give each engine its own core when there are at least two.
    pin_engine_cores: bool = True
    #: Extra environment for every child.
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def with_free_ports(cls, **overrides: object) -> StackConfig:
        ports = {
            name: free_port()
            for name in (
                "gateway_port",
                "router_grpc_port",
                "router_http_port",
                "prefill_port",
                "prefill_kv_port",
                "prefill_metrics_port",
                "decode_port",
                "decode_kv_port",
                "decode_metrics_port",
            )
        }
        return cls(**{**ports, **overrides})  # type: ignore[arg-type]

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.gateway_port}"


class StackError(RuntimeError):
    """A component failed to start; the message names it and its log."""


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


class LocalStack:
    """The local stack's processes. Use as a context manager or call start/stop."""

    def __init__(self, config: StackConfig, *, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._progress = progress or (lambda msg: None)
        self._children: dict[str, _Child] = {}
        self.started_at: dict[str, float] = {}
        self.ready_after_s: dict[str, float] = {}

    # -- environment -------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        env.update({"PYTHONUNBUFFERED": "1", **self.config.extra_env})
        return env

    def _worker_env(self, role: str) -> dict[str, str]:
        c = self.config
        port, kv_port, metrics_port = (
            (c.prefill_port, c.prefill_kv_port, c.prefill_metrics_port)
            if role == "prefill"
            else (c.decode_port, c.decode_kv_port, c.decode_metrics_port)
        )
        env = self._base_env()
        env.update(
            {
                "TANDEM_WORKER_ROLE": role,
                "TANDEM_WORKER_BIND_HOST": c.host,
                "TANDEM_WORKER_PORT": str(port),
                "TANDEM_WORKER_METRICS_PORT": str(metrics_port),
                "TANDEM_WORKER_KV__HOST": c.host,
                "TANDEM_WORKER_KV__PORT": str(kv_port),
                "TANDEM_WORKER_KV__LEASE_S": str(c.kv_lease_s),
                "TANDEM_WORKER_ENGINE__MODEL_DIR": str(c.model_dir),
                "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME": c.served_model_name,
                "TANDEM_WORKER_ENGINE__MAX_MODEL_LEN": str(c.max_model_len),
                "TANDEM_WORKER_ENGINE__KV_CACHE_BYTES": str(c.kv_cache_bytes),
                "TANDEM_WORKER_REDIS__URL": c.redis_url,
                "TANDEM_WORKER_REGISTRY__KEY_PREFIX": c.key_prefix,
            }
        )
        if c.pin_engine_cores and (os.cpu_count() or 1) >= 2:
            env["TANDEM_WORKER_ENGINE__CPU_THREADS_BIND"] = "0" if role == "prefill" else "1"
        return env

    def _router_env(self) -> dict[str, str]:
        c = self.config
        env = self._base_env()
        env.update(
            {
                "TANDEM_ROUTER_GRPC_PORT": str(c.router_grpc_port),
                "TANDEM_ROUTER_HTTP_PORT": str(c.router_http_port),
                "TANDEM_ROUTER_HTTP_HOST": c.host,
                "TANDEM_ROUTER_REDIS__URL": c.redis_url,
                "TANDEM_ROUTER_REGISTRY__KEY_PREFIX": c.key_prefix,
            }
        )
        return env

    def _gateway_env(self) -> dict[str, str]:
        c = self.config
        env = self._base_env()
        env.update(
            {
                "TANDEM_GATEWAY_HOST": c.host,
                "TANDEM_GATEWAY_PORT": str(c.gateway_port),
                "TANDEM_GATEWAY_SERVED_MODEL_NAME": c.served_model_name,
                "TANDEM_GATEWAY_MODEL_DIR": str(c.model_dir),
                "TANDEM_GATEWAY_MAX_MODEL_LEN": str(c.max_model_len),
                "TANDEM_GATEWAY_ROUTER_ADDRESS": f"{c.host}:{c.router_grpc_port}",
                "TANDEM_GATEWAY_REDIS__URL": c.redis_url,
                "TANDEM_GATEWAY_REGISTRY__KEY_PREFIX": c.key_prefix,
            }
        )
        return env

    # -- processes ---------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.config.log_dir / f"{name}.log"
        log = log_path.open("wb")
        # A process group per child so that stop() also reaches the engine's children.
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._children[name] = _Child(name, proc, log_path)
        self.started_at[name] = time.monotonic()

    def _ensure_redis(self) -> None:
        client = redis.Redis.from_url(self.config.redis_url, socket_connect_timeout=1)
        try:
            client.ping()
            return
        except redis.RedisError:
            pass
        if shutil.which("redis-server") is None:
            raise StackError(f"no Redis at {self.config.redis_url} and no redis-server to start")
        port = client.connection_pool.connection_kwargs.get("port", 6379)
        self._spawn(
            "redis", ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], self._base_env()
        )
        self._wait("redis", lambda: bool(client.ping()), timeout_s=15)

    def start(self, *, timeout_s: float = 600.0) -> None:
        c = self.config
        if not (c.model_dir / "config.json").exists():
            raise StackError(f"model folder {c.model_dir} is missing; run `make model`")
        self._progress("starting redis")
        self._ensure_redis()
        self._progress("starting router (Ray Serve), prefill and decode workers (vLLM)")
        py = sys.executable
        self._spawn("router", [py, "-m", "tandem.router"], self._router_env())
        self._spawn("prefill", [py, "-m", "tandem.worker"], self._worker_env("prefill"))
        self._spawn("decode", [py, "-m", "tandem.worker"], self._worker_env("decode"))
        self._wait("prefill", lambda: self._worker_ready(c.prefill_port), timeout_s)
        self._wait("decode", lambda: self._worker_ready(c.decode_port), timeout_s)
        self._wait("router", self._router_ready, timeout_s)
        self._progress("starting gateway")
        self._spawn("gateway", [py, "-m", "tandem.gateway"], self._gateway_env())
        self._wait("gateway", self._gateway_ready, timeout_s)

    def _wait(self, name: str, probe: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_note = time.monotonic()
        while time.monotonic() < deadline:
            child = self._children.get(name)
            if child is not None and child.proc.poll() is not None:
                raise StackError(
                    f"{name} exited with {child.proc.returncode}; see {child.log_path}:\n" + self.tail(name)
                )
            with contextlib.suppress(Exception):
                if probe():
                    self.ready_after_s[name] = time.monotonic() - self.started_at.get(name, time.monotonic())
                    self._progress(f"{name} ready after {self.ready_after_s[name]:.1f} s")
                    return
            if time.monotonic() - last_note > 15:
                self._progress(f"waiting for {name} ...")
                last_note = time.monotonic()
            time.sleep(0.5)
        raise StackError(
            f"{name} not ready after {timeout_s:.0f} s; see "
            f"{self._children[name].log_path if name in self._children else '-'}:\n" + self.tail(name)
        )

    def _worker_ready(self, port: int) -> bool:
        with grpc.insecure_channel(f"{self.config.host}:{port}") as channel:
            reply = worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(), timeout=2)
            return bool(reply.ready)

    def _router_ready(self) -> bool:
        with grpc.insecure_channel(f"{self.config.host}:{self.config.router_grpc_port}") as channel:
            router_pb2_grpc.RouterStub(channel).Release(
                router_pb2.RouterReleaseRequest(request_id="readiness-probe"),
                timeout=2,
                metadata=(("application", "tandem-router"),),
            )
            return True

    def _gateway_ready(self) -> bool:
        return httpx.get(f"{self.config.gateway_url}/readyz", timeout=2).status_code == 200

    def tail(self, name: str, num_lines: int = 30) -> str:
        child = self._children.get(name)
        if child is None or not child.log_path.exists():
            return ""
        return "\n".join(child.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def pid(self, name: str) -> int:
        return self._children[name].proc.pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a component's whole process group (fault tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._children[name].proc.pid, sig)

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """SIGTERM every child (gateway first), then SIGKILL what is left."""
        order = ["gateway", "router", "decode", "prefill", "redis"]
        for name in order:
            if name in self._children and self._children[name].proc.poll() is None:
                self.kill(name, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in order:
            child = self._children.get(name)
            if child is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            self.kill(name, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)
        self._children.clear()

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
