"""What one local stack is made of: its ports, models, Redis, TLS and process settings
(:class:`StackConfig`), and the free ports a test's stack takes (:func:`free_port`).

Read by :class:`tandem.local.stack.LocalStack`, which starts the processes, and by
:mod:`tandem.local.stack_env`, which turns a config into each component's environment."""

from __future__ import annotations

import os
import random
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from tandem.local.pki import default_pki_dir
from tandem.local.redis_users import default_users_dir

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
    #: The workers' shared-memory directory for the KV handoff (TANDEM_WORKER_KV__SHM_DIR), one for all of the
    #: stack's workers as a node's workers share the chart's volume; made at start. None: the workers' default
    #: (/dev/shm, shared with every other stack of the host).
    kv_shm_dir: Path | None = None
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
