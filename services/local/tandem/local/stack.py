"""Starts and stops the local stack: Redis (unless one answers already), the
Ray Serve router, one prefill (or ``num_prefill_workers``) and one decode
(or ``num_decode_workers``) worker, and the gateway, each a child process with
its own log file. ``extra_models`` adds a pool per further base model (its own
prefill and decode worker, ``prefill-m1``/``decode-m1``, ...), served by the
same router and gateway (``TANDEM_GATEWAY_MODELS``). Readiness is probed the way a client
would see it (Health RPC, a router Release call, the gateway's /readyz and the worker counts it reports).

Internal gRPC runs over mutual TLS unless the config says otherwise: before
anything starts, the local CA in the cache folder (:mod:`tandem.local.pki`)
issues or renews one certificate per role, and each component gets its own
(the gateway's, the router's for its TLS front, prefill's, decode's), as in
the chart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import redis

from tandem.common.registry import WorkerRegistry
from tandem.common.tls import TLSSettings, channel
from tandem.local.pki import default_pki_dir, ensure_pki, settings_for
from tandem.local.redis_users import RedisLogin, RedisUsersError, default_users_dir, drop_users, ensure_users
from tandem.local.supervisor import Supervisor
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


def default_ledger_secret_file() -> Path:
    return Path.home() / ".cache" / "tandem" / "router-ledger-secret"


def ensure_ledger_secret(path: Path) -> Path:
    """``path`` holding a random secret for the router replicas' ledger (tandem.router.ledger_auth),
    made (mode 0600) when missing and kept for the next start, as the chart keeps its Secret."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


@dataclass(frozen=True)
class WorkerPorts:
    """The ports of one worker: gRPC service, KV server, metrics, KV events (PUB and replay)."""

    port: int
    kv_port: int
    metrics_port: int
    kv_events_port: int
    kv_events_replay_port: int

    @classmethod
    def free(cls) -> WorkerPorts:
        return cls(free_port(), free_port(), free_port(), free_port(), free_port())


@dataclass(frozen=True)
class ExtraModel:
    """A further base model of the stack: its served name, its folder, and its own prefill and decode worker."""

    name: str
    model_dir: Path
    prefill: WorkerPorts
    decode: WorkerPorts

    @classmethod
    def free(cls, model_dir: Path, name: str = "") -> ExtraModel:
        """The model in ``model_dir`` (named after the folder unless ``name``) on free ports."""
        return cls(name or model_dir.name, model_dir, WorkerPorts.free(), WorkerPorts.free())


def default_second_model_dir() -> Path:
    """The second base model ``make model`` prepares (SmolLM2-135M-Instruct with a LoRA adapter merged in)."""
    return Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct-tandem-merged"


@dataclass
class StackConfig:
    """Ports and places of one local stack."""

    model_dir: Path = field(default_factory=default_model_dir)
    served_model_name: str = "SmolLM2-135M-Instruct"
    host: str = "127.0.0.1"
    gateway_port: int = 8080
    router_grpc_port: int = 9000
    #: The router's TLS front (mTLS for the gateway; Serve's proxy on router_grpc_port has no TLS).
    router_tls_port: int = 9443
    router_http_port: int = 8001
    #: Ray's Prometheus export of the router's metrics (ray_tandem_router_*); 0: a port Ray picks. A fixed
    #: port is for a scraper (the live-query test, the autoscaling demo); a router SIGKILLed and restarted at
    #: once may find it still held by the dead router's Ray agents, so the fault suite leaves it to Ray.
    router_metrics_port: int = 0
    prefill_port: int = 50051
    prefill_kv_port: int = 50061
    prefill_metrics_port: int = 9101
    decode_port: int = 50052
    decode_kv_port: int = 50062
    decode_metrics_port: int = 9102
    prefill_kv_events_port: int = 5557
    prefill_kv_events_replay_port: int = 6557
    decode_kv_events_port: int = 5558
    decode_kv_events_replay_port: int = 6558
    #: Prefill workers beyond the first (named prefill-1, prefill-2, ...).
    extra_prefill_workers: list[WorkerPorts] = field(default_factory=list)
    #: Decode workers beyond the first (named decode-1, decode-2, ...).
    extra_decode_workers: list[WorkerPorts] = field(default_factory=list)
    #: Base models beyond ``served_model_name``, each with one prefill and one decode worker of its own (named
    #: prefill-m1 and decode-m1 for the first, ...), the same ``max_model_len`` and engine settings; the
    #: gateway serves them all (the first, ``served_model_name``, is its default).
    extra_models: list[ExtraModel] = field(default_factory=list)
    #: Start the router and the gateway too (benchmarks that drive the workers directly say no).
    start_router: bool = True
    start_gateway: bool = True
    #: Start the vLLM workers (the autoscaling demo brings SIMULATED workers of its own instead).
    start_workers: bool = True
    #: TANDEM_ROUTER_POLICY for the router ("" = the router's default, cache_aware).
    router_policy: str = ""
    #: TANDEM_ROUTER_DISAGGREGATION__MIN_UNCACHED_TOKENS: requests with fewer uncached prompt tokens on the
    #: decode worker are prefilled there, with no handoff (None = the router's default; 0 = always hand off).
    min_uncached_tokens_to_disaggregate: int | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: When the stack starts its own Redis: keep its data here (append-only file), so that a restarted
    #: Redis comes back with its tenants and keys, as a production Redis does. None: in memory only.
    redis_data_dir: Path | None = None
    #: One Redis ACL user per component (tandem.common.redis_acl), as in the chart: created at start through
    #: ``redis_url`` (which must be allowed ACL SETUSER; locally Redis's default user), each process logging
    #: in as its own with its own password file. False: every process logs in as ``redis_url``'s user.
    redis_users: bool = True
    #: Where the users' passwords are kept (mode 0600), found again at the next start.
    redis_users_dir: Path = field(default_factory=default_users_dir)
    #: Keep the users and their password files after stop (``make run``); False: the stack leaves none (a
    #: test's stack, with a key prefix of its own).
    keep_redis_users: bool = False
    #: Mutual TLS on every internal gRPC hop (gateway → router's TLS front, gateway → workers, decode →
    #: prefill KV), each component with its role's certificate, and each RPC checking the caller's role.
    #: False: plaintext, and no role checks (the components warn at start).
    internal_tls: bool = True
    #: The local CA and the roles' keys and certificates (tandem.local.pki; created or renewed at start).
    pki_dir: Path = field(default_factory=default_pki_dir)
    #: The router replicas' shared ledger secret (TANDEM_ROUTER_LEDGER__SECRET_FILE; made at start if missing).
    router_ledger_secret_file: Path = field(default_factory=default_ledger_secret_file)
    key_prefix: str = "tandem"
    max_model_len: int = 4096
    kv_cache_bytes: int = 1 << 30
    kv_lease_s: float = 60.0
    #: LoRA adapters each worker's engine holds at once (TANDEM_WORKER_ADAPTERS__MAX_ADAPTERS, vLLM's
    #: max_loras); 0: LoRA off on every worker, as the workers' default (requests naming an adapter are refused).
    max_adapters: int = 0
    #: The highest LoRA rank an adapter may have (TANDEM_WORKER_ADAPTERS__MAX_ADAPTER_RANK); used with LoRA on.
    max_adapter_rank: int = 16
    log_dir: Path = Path(".run/logs")
    #: Give each engine its own core when there are at least two.
    pin_engine_cores: bool = True
    #: Extra environment for every child.
    extra_env: dict[str, str] = field(default_factory=dict)
    #: ``api_key`` (as in production: the stack creates the tenant ``local-dev`` and a fresh key at every
    #: start, see :attr:`LocalStack.api_key`) or ``disabled`` (no keys at all).
    auth_mode: str = "api_key"
    #: Tenant the local stack creates and hands a key for.
    dev_tenant_id: str = "local-dev"
    #: Start a component again when it exits (after the stack is up), as Kubernetes restarts a pod's
    #: container: a worker whose engine died exits, and comes back. Off for tests that kill and
    #: restart components themselves.
    supervise: bool = False
    #: The supervisor's first wait before a restart; doubled for each restart within a minute of the last
    #: one, up to ``max_restart_backoff_s`` (Kubernetes' CrashLoopBackOff, shortened).
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0

    @classmethod
    def with_free_ports(cls, **overrides: object) -> StackConfig:
        ports = {
            name: free_port()
            for name in (
                "gateway_port",
                "router_grpc_port",
                "router_tls_port",
                "router_http_port",
                "prefill_port",
                "prefill_kv_port",
                "prefill_metrics_port",
                "decode_port",
                "decode_kv_port",
                "decode_metrics_port",
                "prefill_kv_events_port",
                "prefill_kv_events_replay_port",
                "decode_kv_events_port",
                "decode_kv_events_replay_port",
            )
        }
        num_prefill = int(overrides.pop("num_prefill_workers", 1))  # type: ignore[call-overload]
        num_decode = int(overrides.pop("num_decode_workers", 1))  # type: ignore[call-overload]
        extra = [WorkerPorts.free() for _ in range(max(0, num_prefill - 1))]
        extra_decode = [WorkerPorts.free() for _ in range(max(0, num_decode - 1))]
        return cls(
            **{**ports, "extra_prefill_workers": extra, "extra_decode_workers": extra_decode, **overrides}  # type: ignore[arg-type]
        )

    def worker_ports(self) -> dict[str, WorkerPorts]:
        """Every worker by component name: prefill, prefill-1, ..., decode, decode-1, ..."""
        workers = {
            "prefill": WorkerPorts(
                self.prefill_port,
                self.prefill_kv_port,
                self.prefill_metrics_port,
                self.prefill_kv_events_port,
                self.prefill_kv_events_replay_port,
            )
        }
        for i, ports in enumerate(self.extra_prefill_workers, start=1):
            workers[f"prefill-{i}"] = ports
        workers["decode"] = WorkerPorts(
            self.decode_port,
            self.decode_kv_port,
            self.decode_metrics_port,
            self.decode_kv_events_port,
            self.decode_kv_events_replay_port,
        )
        for i, ports in enumerate(self.extra_decode_workers, start=1):
            workers[f"decode-{i}"] = ports
        for i, model in enumerate(self.extra_models, start=1):
            workers[f"prefill-m{i}"] = model.prefill
            workers[f"decode-m{i}"] = model.decode
        return workers

    def worker_model(self, name: str) -> tuple[str, Path]:
        """The served name and folder of the model the worker ``name`` runs."""
        prefix, _, index = name.rpartition("-m")
        if prefix in ("prefill", "decode") and index.isdigit() and 1 <= int(index) <= len(self.extra_models):
            model = self.extra_models[int(index) - 1]
            return model.name, model.model_dir
        return self.served_model_name, self.model_dir

    def served_models(self) -> list[tuple[str, Path]]:
        """Every base model of the stack (name, folder), the default first."""
        return [(self.served_model_name, self.model_dir), *((m.name, m.model_dir) for m in self.extra_models)]

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.gateway_port}"


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
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        env.update({"PYTHONUNBUFFERED": "1", **self.config.extra_env})
        return env

    def _worker_env(self, name: str) -> dict[str, str]:
        c = self.config
        role = "decode" if name.startswith("decode") else "prefill"
        ports = c.worker_ports()[name]
        port, kv_port, metrics_port = ports.port, ports.kv_port, ports.metrics_port
        model_name, model_dir = c.worker_model(name)
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
                "TANDEM_WORKER_KV_EVENTS__PORT": str(ports.kv_events_port),
                "TANDEM_WORKER_KV_EVENTS__REPLAY_PORT": str(ports.kv_events_replay_port),
                "TANDEM_WORKER_ENGINE__MODEL_DIR": str(model_dir),
                "TANDEM_WORKER_ENGINE__SERVED_MODEL_NAME": model_name,
                "TANDEM_WORKER_ENGINE__MAX_MODEL_LEN": str(c.max_model_len),
                "TANDEM_WORKER_ENGINE__KV_CACHE_BYTES": str(c.kv_cache_bytes),
                "TANDEM_WORKER_REDIS__URL": c.redis_url,
                "TANDEM_WORKER_REGISTRY__KEY_PREFIX": c.key_prefix,
            }
        )
        if c.max_adapters:
            env["TANDEM_WORKER_ADAPTERS__MAX_ADAPTERS"] = str(c.max_adapters)
            env["TANDEM_WORKER_ADAPTERS__MAX_ADAPTER_RANK"] = str(c.max_adapter_rank)
        env.update(self._redis_env("TANDEM_WORKER_", "worker"))
        num_cpus = os.cpu_count() or 1
        if c.pin_engine_cores and num_cpus >= 2:
            # Prefill workers one core each, round the cores; the first decode on the last core
            # (with two cores and two prefill workers it shares core 1 with prefill-1), further
            # decode workers round the cores from the other end (two models on two cores: prefill 0,
            # decode 1, prefill-m1 1, decode-m1 0).
            names = list(c.worker_ports())
            if role == "decode":
                decode_names = [n for n in names if n.startswith("decode")]
                core = num_cpus - 1 - decode_names.index(name) % num_cpus
            else:
                prefill_names = [n for n in names if not n.startswith("decode")]
                core = prefill_names.index(name) % num_cpus
            env["TANDEM_WORKER_ENGINE__CPU_THREADS_BIND"] = str(core)
        env.update(self._tls_env("TANDEM_WORKER_TLS__", role))
        return env

    def tls(self, role: str) -> TLSSettings:
        """The TLS settings of a component (or a tool) of ``role``; disabled when the stack runs plaintext."""
        if not self.config.internal_tls:
            return TLSSettings(enabled=False)
        return settings_for(self.config.pki_dir, role)

    def _tls_env(self, prefix: str, role: str) -> dict[str, str]:
        tls = self.tls(role)
        if not tls.enabled:
            return {f"{prefix}ENABLED": "false"}  # plaintext, said explicitly
        return {f"{prefix}{key.upper()}": str(value) for key, value in tls.to_dict().items() if value is not None}

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
                "TANDEM_ROUTER_LEDGER__SECRET_FILE": str(c.router_ledger_secret_file),
            }
        )
        env.update(self._redis_env("TANDEM_ROUTER_", "router"))
        if c.internal_tls:
            env.update({"TANDEM_ROUTER_TLS_HOST": c.host, "TANDEM_ROUTER_TLS_PORT": str(c.router_tls_port)})
        env.update(self._tls_env("TANDEM_ROUTER_TLS__", "router"))
        if c.router_metrics_port:
            env["TANDEM_ROUTER_METRICS_PORT"] = str(c.router_metrics_port)
        if c.router_policy:
            env["TANDEM_ROUTER_POLICY"] = c.router_policy
        if c.min_uncached_tokens_to_disaggregate is not None:
            env["TANDEM_ROUTER_DISAGGREGATION__MIN_UNCACHED_TOKENS"] = str(c.min_uncached_tokens_to_disaggregate)
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
                "TANDEM_GATEWAY_ROUTER_ADDRESS": self.router_address,
                "TANDEM_GATEWAY_REDIS__URL": c.redis_url,
                "TANDEM_GATEWAY_REGISTRY__KEY_PREFIX": c.key_prefix,
                "TANDEM_GATEWAY_TENANCY__KEY_PREFIX": c.key_prefix,
                "TANDEM_GATEWAY_AUTH__MODE": c.auth_mode,
                "TANDEM_GATEWAY_AUTH__ADMIN_KEY": self.admin_key,
            }
        )
        if c.extra_models:
            models = [{"name": n, "model_dir": str(d), "max_model_len": c.max_model_len} for n, d in c.served_models()]
            env["TANDEM_GATEWAY_MODELS"] = json.dumps(models)
        env.update(self._redis_env("TANDEM_GATEWAY_", "gateway"))
        env.update(self._tls_env("TANDEM_GATEWAY_TLS__", "gateway"))
        return env

    @property
    def router_address(self) -> str:
        """What the gateway dials: the router's TLS front, or Serve's proxy when the stack runs plaintext."""
        c = self.config
        return f"{c.host}:{c.router_tls_port if c.internal_tls else c.router_grpc_port}"

    def _redis_env(self, prefix: str, component: str) -> dict[str, str]:
        login = self.redis_logins.get(component)
        return login.env(prefix) if login is not None else {}

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

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
