"""Router settings, read once by :mod:`tandem.router.__main__` from the
environment (prefix ``TANDEM_ROUTER_``, groups nested with ``__``, e.g.
``TANDEM_ROUTER_REDIS__URL``, ``TANDEM_ROUTER_POLICY``) and passed down: the
Ray/Serve bootstrap uses the whole of it, each Serve replica gets a
:class:`RouterConfig` (plain, picklable data)."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.common.settings import RedisSettings, RegistrySettings
from tandem.router.burst import DEFAULT_STALL_WEIGHT
from tandem.router.ledger import DEFAULT_MAX_MESSAGE_AGE_S, DEFAULT_MAX_REPLICAS
from tandem.router.policy import DEFAULT_POLICY, CacheAwareWeights

#: See :class:`DisaggregationSettings`.
DEFAULT_MIN_UNCACHED_TOKENS_TO_DISAGGREGATE = 128


class BudgetSettings(BaseModel):
    """Token budgets per worker (see tandem.router.budget)."""

    #: Uncached prompt tokens a prefill worker may have in flight.
    prefill_tokens_in_flight: int = Field(16_384, gt=0)
    #: Share of a decode worker's KV cache (block_size x num_kv_blocks) the router fills.
    decode_kv_fraction: float = Field(0.9, gt=0, le=1)


class DisaggregationSettings(BaseModel):
    """When a request goes through a prefill worker, and when its decode worker prefills it alone."""

    #: A request goes through a prefill worker (and its KV is handed to the decode worker) only when at
    #: least this many of its prompt tokens are missing from the chosen decode worker's prefix cache
    #: (the router's KV index, fed by the workers' KV events); shorter ones are prefilled by the decode
    #: worker itself, with no handoff. 0 sends every request through a prefill worker. The default
    #: comes from ``make bench-local-prefill`` (benchmarks/local_prefill.py; see services/router/README.md).
    min_uncached_tokens: int = Field(DEFAULT_MIN_UNCACHED_TOKENS_TO_DISAGGREGATE, ge=0)
    #: In a burst, a request over that threshold also runs on its decode worker alone when the prefill
    #: worker it would be handed to has more prompt tokens ahead of it than the decode worker's own
    #: backlog and its other streams' stall (tandem.router.burst, one formula). False: never (and with
    #: ``min_uncached_tokens`` 0, never either).
    burst_local_prefill: bool = True
    #: How much one other stream's stall on the decode worker counts against the request's wait for the
    #: prefill worker (tandem.router.burst); 0: any wait sends a long prompt to a decode worker with budget.
    burst_stall_weight: float = Field(DEFAULT_STALL_WEIGHT, ge=0)


class QueueSettings(BaseModel):
    """The admission queue (see tandem.router.admission)."""

    #: Priority classes, highest first; callers send one in ``tandem-priority`` metadata.
    priority_classes: list[str] = Field(default_factory=lambda: ["high", "normal", "low"])
    default_priority: str = "normal"
    #: Tenant → priority class for callers that send none.
    tenant_priorities: dict[str, str] = Field(default_factory=dict)
    #: Longest wait for budget; keep it below the gateway's router timeout (10 s).
    timeout_s: float = Field(5.0, gt=0)
    poll_interval_s: float = Field(0.05, gt=0)
    max_depth: int = Field(10_000, gt=0)
    #: Tenant → weight of its fair share (1 unless listed); shares are uncached prompt tokens.
    tenant_weights: dict[str, float] = Field(default_factory=dict)
    #: Half-life of a tenant's recent service in the fair-share order.
    fair_share_half_life_s: float = Field(60.0, gt=0)
    #: Longest a placement made for another replica's waiter holds its budget unanswered.
    handoff_timeout_s: float = Field(2.0, gt=0)
    #: A request refused because its pool had no worker at all counts as pending demand for this long
    #: (``tandem_router_pending_demand``): at least the operator's interval plus the metrics' export and
    #: scrape delays, so the autoscaler sees it and starts the pool (see tandem.router.pending_demand).
    pending_demand_window_s: float = Field(60.0, gt=0)


class KVIndexSettings(BaseModel):
    """The prefix-cache index fed by the workers' KV events."""

    #: Memory bound: blocks remembered per worker (an engine holds at most its num_kv_blocks).
    max_blocks_per_worker: int = Field(1 << 20, gt=0)
    #: How long a (re)subscriber waits for a publisher's replay.
    replay_timeout_s: float = Field(2.0, gt=0)
    #: An idle worker is asked for the batches it published since the last one applied this long
    #: after its last event or replay, so a batch lost at the end of a burst is repaired (an
    #: up-to-date publisher answers only its end marker).
    catch_up_interval_s: float = Field(2.0, gt=0)


class LedgerSettings(BaseModel):
    """How replicas share reservations and queues (see tandem.router.ledger)."""

    #: Changes are published this often at most (a batch per flush); 0: at the end of the event-loop
    #: iteration that made them (the fleet benchmark: ledger lag p50 3.7 ms with 2 ms, see README).
    flush_interval_s: float = Field(0.0, ge=0)
    #: A replica whose liveness key is this old is forgotten (it died).
    replica_ttl_s: float = Field(3.0, gt=0)
    #: File holding the secret (at least 16 bytes, one line) every replica tags and checks the ledger's
    #: messages and snapshots with (HMAC-SHA256, tandem.router.ledger_auth): a mounted Secret; read by
    #: each replica when it starts, never carried in the Serve config. Unset: each replica makes a
    #: random one and so trusts no other replica; refused with more than one replica.
    secret_file: Path | None = None
    #: Other replicas mirrored at most; a message from another new replica id is dropped (and counted).
    max_replicas: int = Field(DEFAULT_MAX_REPLICAS, gt=0)
    #: Messages and snapshots sent longer ago than this (by the sender's clock) are dropped as replays;
    #: keep it above the replicas' clock skew.
    max_message_age_s: float = Field(DEFAULT_MAX_MESSAGE_AGE_S, gt=0)


class RouterConfig(BaseModel):
    """What each Serve replica needs; built by the entry point from the settings."""

    redis: RedisSettings = Field(default_factory=RedisSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    #: Placement policy by name: ``cache_aware``, ``least_loaded`` or ``round_robin``.
    policy: str = DEFAULT_POLICY
    weights: CacheAwareWeights = Field(default_factory=CacheAwareWeights)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    disaggregation: DisaggregationSettings = Field(default_factory=DisaggregationSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    kv_index: KVIndexSettings = Field(default_factory=KVIndexSettings)
    ledger: LedgerSettings = Field(default_factory=LedgerSettings)
    #: How often a replica writes its snapshot and liveness and repairs its mirrors (the changes
    #: themselves are shared as they happen, every ``ledger.flush_interval_s``).
    replica_sync_interval_s: float = Field(default=0.25, gt=0)
    #: A reservation (in-flight count on both workers) expires after this long
    #: unless released, so a crashed gateway cannot leak in-flight counts.
    lease_s: float = Field(default=600.0, gt=0)
    #: The registry is read from Redis at most this often; Schedule uses the cached list in between.
    registry_refresh_interval_s: float = Field(default=0.5, ge=0)
    #: The registry's removals counter is read this often (one small GET), and the list at once when a
    #: worker left: the router stops placing on a worker that is gone within about this (0: off).
    registry_removal_check_interval_s: float = Field(default=0.1, ge=0)
    #: Python's cyclic GC runs its youngest pass after this many more container objects were made
    #: than freed (Python's default: 700); 0 keeps Python's. See :func:`tandem.router.gc_tuning.tune_gc`.
    gc_young_threshold: int = Field(default=20_000, ge=0)


class TandemRouterSettings(BaseSettings, RouterConfig):
    """Everything ``python -m tandem.router`` reads from the environment: the
    replicas' :class:`RouterConfig` (inherited, documented there) plus the
    process's own ports and Ray connection."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_ROUTER_", env_nested_delimiter="__", extra="ignore")

    #: Port of Serve's gRPC proxy (the tandem.v1.Router service).
    grpc_port: int = Field(default=9000, ge=1, le=65535)
    #: Port of Serve's HTTP proxy (health only); 8001 so it does not clash with 8000.
    http_port: int = Field(default=8001, ge=1, le=65535)
    #: Host the HTTP proxy binds to (the gRPC proxy always binds all interfaces).
    http_host: str = "127.0.0.1"
    #: Router replicas; above 1, Schedule and Release of one request stick to
    #: one replica by consistent hashing on the request id.
    num_replicas: int = Field(default=1, ge=1)
    #: Address of an existing Ray cluster; unset starts a local one.
    ray_address: str | None = Field(
        default=None, validation_alias=AliasChoices("TANDEM_ROUTER_RAY_ADDRESS", "RAY_ADDRESS")
    )
    #: Port of Ray's Prometheus endpoint (tandem_router_* and Ray's own metrics)
    #: for a local Ray; unset lets Ray choose. Ignored when connecting to a cluster.
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    #: CPUs a local Ray may use (ignored when connecting to a cluster).
    ray_num_cpus: int = Field(default=2, ge=1)
    log_level: str = "INFO"

    def router_config(self) -> RouterConfig:
        """The part every Serve replica needs (plain, picklable data)."""
        return RouterConfig(**{name: getattr(self, name) for name in RouterConfig.model_fields})
