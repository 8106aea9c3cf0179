"""Starts and stops the local stack: Redis (unless one answers already), the
Ray Serve router, one prefill (or ``num_prefill_workers``) and one decode
(or ``num_decode_workers``) worker, and the gateway, each a child process with
its own log file. ``extra_models`` adds a pool per further base model (its own
prefill and decode worker, ``prefill-m1``/``decode-m1``, ...), served by the
same router and gateway (``TANDEM_GATEWAY_MODELS``). Readiness is probed the way a client
would see it (Health RPC, a router Release call, the gateway's /readyz and the worker counts it reports).
What a stack is made of is its :class:`~tandem.local.stack_config.StackConfig`; each component's
environment comes from :mod:`tandem.local.stack_env`.

Internal gRPC runs over mutual TLS unless the config says otherwise: before
anything starts, the local CA in the cache folder (:mod:`tandem.local.pki`)
issues or renews one certificate per role, and each component gets its own
(the gateway's, the router's for its TLS front, prefill's, decode's), as in
the chart."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import redis

from tandem.common.registry import WorkerRegistry
from tandem.common.tls import TLSSettings, channel
from tandem.local import stack_env
from tandem.local.pki import ensure_pki, settings_for
from tandem.local.redis_users import RedisLogin, RedisUsersError, drop_users, ensure_users
from tandem.local.stack_config import (
    ExtraModel,
    StackConfig,
    WorkerPorts,
    default_ledger_secret_file,
    default_model_dir,
    default_second_model_dir,
    ensure_ledger_secret,
    free_port,
)
from tandem.local.supervisor import Supervisor
from tandem.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

#: The config's names are re-exported: callers build a config and a stack from this module.
__all__ = [
    "ExtraModel",
    "LocalStack",
    "StackConfig",
    "StackError",
    "WorkerPorts",
    "default_ledger_secret_file",
    "default_model_dir",
    "default_second_model_dir",
    "ensure_ledger_secret",
    "free_port",
]


def _session_members(session_id: int) -> list[int]:
    """Processes whose session is ``session_id`` (Linux /proc; elsewhere none)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp, session, ...
        if len(fields) > 3 and int(fields[3]) == session_id:
            members.append(int(stat.parent.name))
    return members


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
        self._commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self._redis_args: list[str] = []
        #: Each component's Redis user (``config.redis_users``), by component: gateway, router, worker, admin.
        self.redis_logins: dict[str, RedisLogin] = {}
        self.started_at: dict[str, float] = {}
        self.ready_after_s: dict[str, float] = {}
        #: Each worker component's registry id, as its Health call last said (a restart makes a new one).
        self.worker_ids: dict[str, str] = {}
        #: The dev tenant's API key (``Authorization: Bearer …``), created at start; "" with auth disabled.
        self.api_key = ""
        #: Credential of the gateway's admin endpoints, fresh at every start.
        self.admin_key = secrets.token_urlsafe(24)
        #: Held while a component is (re)started, so that the supervisor and a caller never race.
        self.lifecycle = threading.RLock()
        #: Restarts components that exit, once the stack is up (``config.supervise``).
        self.supervisor = Supervisor(
            self,
            backoff_s=config.restart_backoff_s,
            max_backoff_s=config.max_restart_backoff_s,
            progress=self._progress,
        )

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # -- environment -------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        return stack_env.base_env(self.config)

    def _worker_env(self, name: str) -> dict[str, str]:
        role = stack_env.worker_role(name)
        return stack_env.worker_env(self.config, name, login=self.redis_logins.get("worker"), tls=self.tls(role))

    def tls(self, role: str) -> TLSSettings:
        """The TLS settings of a component (or a tool) of ``role``; disabled when the stack runs plaintext."""
        if not self.config.internal_tls:
            return TLSSettings(enabled=False)
        return settings_for(self.config.pki_dir, role)

    def _router_env(self) -> dict[str, str]:
        return stack_env.router_env(self.config, login=self.redis_logins.get("router"), tls=self.tls("router"))

    def _gateway_env(self) -> dict[str, str]:
        return stack_env.gateway_env(
            self.config, admin_key=self.admin_key, login=self.redis_logins.get("gateway"), tls=self.tls("gateway")
        )

    @property
    def router_address(self) -> str:
        """What the gateway dials: the router's TLS front, or Serve's proxy when the stack runs plaintext."""
        return stack_env.router_address(self.config)

    @property
    def admin_redis_url(self) -> str:
        """Redis as the admin CLI logs in (tenants, keys): its own user, or ``redis_url`` without users."""
        login = self.redis_logins.get("admin")
        return login.url(self.config.redis_url) if login is not None else self.config.redis_url

    def _ensure_redis_users(self) -> None:
        c = self.config
        if c.redis_users:
            try:
                self.redis_logins = ensure_users(c.redis_url, c.key_prefix, c.redis_users_dir)
            except RedisUsersError as exc:
                raise StackError(str(exc)) from exc

    def _create_dev_key(self) -> None:
        """The dev tenant (unlimited) and a fresh key; the previous start's keys are revoked."""
        self.api_key = self.create_tenant_key(self.config.dev_tenant_id, name="local development")

    def create_tenant_key(self, tenant_id: str, *, name: str = "", label: str = "local-stack") -> str:
        """Create ``tenant_id`` (unlimited) if missing and return a fresh API key for it;
        earlier keys with the same label are revoked. For local use and tests."""
        from tandem.gateway.redis_client import connect
        from tandem.gateway.tenancy.models import Tenant
        from tandem.gateway.tenancy.store import TenantStore

        async def create() -> str:
            client = connect(self.admin_redis_url, timeout_s=5.0)
            try:
                store = TenantStore(client, key_prefix=self.config.key_prefix)
                if await store.get_tenant(tenant_id) is None:
                    await store.put_tenant(Tenant(id=tenant_id, name=name or tenant_id))
                for old in await store.list_keys(tenant_id):
                    if old.label == label and not old.revoked:
                        await store.revoke_key(old.key_id)
                _, key = await store.create_key(tenant_id, label=label)
                return key
            finally:
                await client.aclose()

        return asyncio.run(create())

    # -- processes ---------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.config.log_dir / f"{name}.log"
        log = log_path.open("ab" if name in self._commands else "wb")  # a restart appends
        # A process group per child so that stop() also reaches the engine's children.
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._children[name] = _Child(name, proc, log_path)
        self._commands[name] = (args, env)
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
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        if self.config.redis_data_dir is None:
            args += ["--appendonly", "no"]
        else:
            self.config.redis_data_dir.mkdir(parents=True, exist_ok=True)
            args += ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.config.redis_data_dir)]
        self._spawn("redis", args, self._base_env())
        self._redis_args = args
        self._wait("redis", lambda: bool(client.ping()), timeout_s=15)

    def start(self, *, timeout_s: float = 600.0) -> None:
        c = self.config
        for _, model_dir in c.served_models():
            if not (model_dir / "config.json").exists():
                raise StackError(f"model folder {model_dir} is missing; run `make model`")
        if c.internal_tls:
            ensure_pki(c.pki_dir)
            self._progress(f"internal gRPC over mutual TLS, one certificate per role ({c.pki_dir})")
        if c.kv_shm_dir is not None:
            c.kv_shm_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._progress("starting redis")
        self._ensure_redis()
        self._ensure_redis_users()
        workers = c.worker_ports() if c.start_workers else {}
        self._progress(
            ("starting router (Ray Serve), " if c.start_router else "starting ")
            + f"{sum(not n.startswith('decode') for n in workers)} prefill and "
            + f"{sum(n.startswith('decode') for n in workers)} decode worker(s) (vLLM)"
        )
        py = sys.executable
        if c.start_router:
            ensure_ledger_secret(c.router_ledger_secret_file)
            self._spawn("router", [py, "-m", "tandem.router"], self._router_env())
        for name in workers:
            self._spawn(name, [py, "-m", "tandem.worker"], self._worker_env(name))
        for name in workers:
            self._wait(name, lambda name=name: self._worker_ready(name), timeout_s)  # type: ignore[misc]
        if c.start_router:
            self._wait("router", self._router_ready, timeout_s)
        if not c.start_gateway:
            return
        if c.auth_mode == "api_key":
            self._create_dev_key()
            self._progress(f"created an API key for tenant {c.dev_tenant_id}")
        self._progress("starting gateway")
        self._spawn("gateway", [py, "-m", "tandem.gateway"], self._gateway_env())
        # Ready no longer needs workers (a pool may be at zero); at start-up the stack waits until the
        # gateway's registry read lists the workers it started, as the first request expects.
        num_prefill = sum(not n.startswith("decode") for n in workers)
        expect = (num_prefill, len(workers) - num_prefill)
        self._wait("gateway", lambda: self._gateway_ready(expect), timeout_s)
        if c.supervise:
            self.supervisor.start()

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts by the supervisor so far, by component."""
        return self.supervisor.restarts

    def exit_status(self, name: str) -> int | None:
        return self._children[name].proc.poll()

    def start_gateway_variant(self, name: str, port: int, env: dict[str, str], *, timeout_s: float = 120.0) -> str:
        """Another gateway in front of the same router and workers, configured as the first one plus
        ``env`` (``TANDEM_GATEWAY_*``), on ``port``: an A/B of a gateway setting in one run. Its name
        must start with ``gateway``; stopped with the stack. Returns its base URL."""
        if not name.startswith("gateway") or name in self._children:
            raise ValueError(f"a gateway variant needs a new name starting with 'gateway', not {name!r}")
        variant_env = {**self._gateway_env(), **env, "TANDEM_GATEWAY_PORT": str(port)}
        self._spawn(name, [sys.executable, "-m", "tandem.gateway"], variant_env)
        url = f"http://{self.config.host}:{port}"
        self._wait(name, lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, timeout_s)
        return url

    def _wait(self, name: str, probe: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_note = time.monotonic()
        while time.monotonic() < deadline:
            if self.supervisor.stopping_in_own_thread():
                raise StackError(f"{name}: the stack is stopping")
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

    def worker_channel(self, name: str, *, role: str = "gateway") -> grpc.Channel:
        """A blocking channel to a worker's gRPC service, as a component of ``role`` would dial it (over
        mTLS with that role's certificate when the stack runs it)."""
        return channel(f"{self.config.host}:{self.config.worker_ports()[name].port}", self.tls(role))

    def _worker_ready(self, name: str) -> bool:
        with self.worker_channel(name, role="operator") as probe_channel:
            reply = worker_pb2_grpc.WorkerStub(probe_channel).Health(worker_pb2.HealthRequest(), timeout=2)
            if reply.ready:
                self.worker_ids[name] = reply.worker_id
            return bool(reply.ready)

    def forget(self, name: str) -> None:
        """``name`` exited: delete the registration it left behind, as a worker whose engine died does
        itself (tandem.worker.liveness), so that the router stops placing on it at once (it watches the
        registry's removals: tandem.router.worker_view), not the registry's TTL later. A worker that was
        SIGKILLed or crashed could not. Nothing for the other components."""
        worker_id = self.worker_ids.get(name)
        if worker_id is None:
            return
        login = self.redis_logins.get("worker")
        url = login.url(self.config.redis_url) if login is not None else self.config.redis_url

        async def unregister() -> None:
            registry = WorkerRegistry(url, key_prefix=self.config.key_prefix)
            try:
                await registry.unregister(worker_id)
            finally:
                await registry.aclose()

        asyncio.run(unregister())

    @property
    def components(self) -> list[str]:
        """Every component this stack started (also those that died since)."""
        return list(self._commands)

    def is_running(self, name: str) -> bool:
        child = self._children.get(name)
        return child is not None and child.proc.poll() is None

    def restart(self, name: str, *, timeout_s: float = 600.0) -> None:
        """Start a component again with its first command line (after a fault test killed it) and wait
        until it is ready. A running one is killed first, and so is what is left of a dead one (an
        engine's processes may outlive their worker). Holds the stack's lifecycle lock: the supervisor
        and a caller never start the same component at once."""
        with self.lifecycle:
            self.kill(name, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._children[name].proc.wait(timeout=30)
            args, env = self._commands[name]
            self._spawn(name, args, env)
        self._wait_ready(name, timeout_s)
        if name == "redis":
            self._ensure_redis_users()  # a Redis of its own comes back without them (users are not data)

    def _wait_ready(self, name: str, timeout_s: float) -> None:
        if name == "redis":
            client = redis.Redis.from_url(self.config.redis_url, socket_connect_timeout=1)
            self._wait(name, lambda: bool(client.ping()), timeout_s)
        elif name == "router":
            self._wait(name, self._router_ready, timeout_s)
        elif name == "gateway":
            self._wait(name, self._gateway_ready, timeout_s)
        else:
            self._wait(name, lambda: self._worker_ready(name), timeout_s)

    def _router_ready(self) -> bool:
        # The way the gateway reaches it (through the TLS front, as a gateway, when the stack runs mTLS).
        with channel(self.router_address, self.tls("gateway")) as router_channel:
            router_pb2_grpc.RouterStub(router_channel).Release(
                router_pb2.RouterReleaseRequest(request_id="readiness-probe"),
                timeout=2,
                metadata=(("application", "tandem-router"),),
            )
            return True

    def _gateway_ready(self, workers: tuple[int, int] = (0, 0)) -> bool:
        """/readyz answers 200 and counts at least ``workers`` (prefill, decode) registered."""
        response = httpx.get(f"{self.config.gateway_url}/readyz", timeout=2)
        if response.status_code != 200 or workers == (0, 0):
            return response.status_code == 200
        body = response.json()
        return bool(body["num_prefill_workers"] >= workers[0] and body["num_decode_workers"] >= workers[1])

    def tail(self, name: str, num_lines: int = 30) -> str:
        child = self._children.get(name)
        if child is None or not child.log_path.exists():
            return ""
        return "\n".join(child.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def pid(self, name: str) -> int:
        return self._children[name].proc.pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a component and everything it started: its process group, and the processes
        of its session that moved to groups of their own (Ray's actors do)."""
        pid = self._children[name].proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        for other in _session_members(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(other, sig)

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """SIGTERM every child (gateway first), then SIGKILL what is left of each, its process group and
        session included."""
        self.supervisor.stop()
        order = [
            *[n for n in self._children if n.startswith("gateway")],
            "router",
            *[n for n in self._children if n.startswith("decode")],
            *[n for n in self._children if n.startswith("prefill")],
            "redis",
        ]
        for name in order:
            if name in self._children and self._children[name].proc.poll() is None:
                # The component, not its process group: as in a pod, where only PID 1 gets SIGTERM, each
                # one stops what it started (the router Serve and its Ray processes). Signalled together,
                # Ray's processes died under the router's Serve shutdown, which then waited out the
                # deadline: ~30 s per stack stopped. What is left is killed below.
                self._children[name].proc.send_signal(signal.SIGTERM)
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
        if self.redis_logins and not self.config.keep_redis_users:
            with contextlib.suppress(redis.RedisError):
                drop_users(self.config.redis_url, self.config.key_prefix, self.config.redis_users_dir)
            self.redis_logins = {}

    def log_tails(self, num_lines: int = 30) -> str:
        """The last ``num_lines`` of every component's log, each under its name: what a failed start
        reports (a fixture's ``with LocalStack(...)`` does it itself)."""
        return "\n".join(f"--- {name} log tail ---\n{self.tail(name, num_lines)}" for name in self._children)

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self._progress("the stack did not start:\n" + self.log_tails())
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Stops the stack; when the block failed (a fixture's set-up after the start), the components'
        log tails are reported first."""
        if exc_type is not None and issubclass(exc_type, Exception):
            self._progress("the stack's user failed:\n" + self.log_tails())
        self.stop()
