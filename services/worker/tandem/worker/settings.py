"""Worker settings, read once by ``python -m tandem.worker`` from environment
variables (prefix ``TANDEM_WORKER_``, groups nested with ``__``) and flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.common.registry import MODEL_NAME
from tandem.common.settings import RedisSettings, RegistrySettings
from tandem.common.tls import TLSSettings
from tandem.worker.kv_connector.cpus import parse_cpu_list

Role = Literal["prefill", "decode"]


def default_model_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"


class EngineSettings(BaseModel):
    """How the vLLM engine is built."""

    #: A Hugging Face model folder (safetensors + config + tokenizer).
    model_dir: Path = Field(default_factory=default_model_dir)
    #: The model name clients use.
    #: Registered with every heartbeat; readers skip a record whose name breaks MODEL_NAME (tandem.common.registry).
    served_model_name: str = Field("SmolLM2-135M-Instruct", pattern=MODEL_NAME.pattern)
    #: Which weights ``model_dir`` holds (a Hugging Face commit, a tag); part of the KV fingerprint. "": a
    #: digest of the folder's config and weight file sizes (tandem.common.kv_fingerprint.model_revision).
    model_revision: str = Field("", max_length=128)
    max_model_len: int = Field(4096, gt=0)
    #: Memory for the KV cache (vLLM's kv_cache_memory_bytes).
    kv_cache_bytes: int = Field(1 << 30, gt=0)
    #: Skip graph capture/compilation: engine start ~30 s instead of ~100 s on CPU.
    enforce_eager: bool = True
    #: Weights and KV dtype; "auto" is float32 on CPU (see engine.resolve_dtype).
    dtype: str = "auto"
    #: CPU cores for this engine's OpenMP threads ("" = vLLM's default).
    cpu_threads_bind: str = ""
    max_num_seqs: int = Field(64, gt=0)
    tensor_parallel_size: int = Field(1, gt=0)
    #: How the engine's processes wait for each other's next message while busy: sleep this many
    #: seconds between looks, or 0 for vLLM's own busy loop (sched_yield for a second after each
    #: message). None: 0.0005 on vLLM's CPU backend, where a spinning process takes the share of a
    #: core that forward passes need (see tandem.worker.vllm_plugin), else 0.
    mq_poll_s: float | None = Field(None, ge=0)
    #: The engine is stuck, and the worker exits, when requests are in flight and the engine core has
    #: not answered a probe (served between two steps) for this long (tandem.worker.liveness). Longer
    #: than the slowest step a healthy engine takes (a whole long prompt's prefill chunk on a CPU takes
    #: seconds) and than ``kv.pull_timeout_s``.
    step_timeout_s: float = Field(120.0, gt=0)


class KVSettings(BaseModel):
    """The gRPC KV connector."""

    #: Address other engines use to reach this engine's KV server.
    host: str = "127.0.0.1"
    port: int = 50061
    #: How long a prefill engine holds blocks that no decode engine released.
    lease_s: float = Field(60.0, gt=0)
    #: The largest KV message of a pull (whole blocks of every layer; the prefill side makes each one
    #: before sending it). A small pull asks for smaller ones, down to 1 MiB, so that it is cut into
    #: several (``wire.pull_chunk_bytes``).
    max_chunk_bytes: int = Field(4 << 20, gt=0)
    #: A decode engine gives up a pull after this long (a hung or dead prefill worker) and applies
    #: ``load_failure_policy``; shorter than ``lease_s``, so it gives up before the blocks it waits
    #: for could be freed under it.
    pull_timeout_s: float = Field(30.0, gt=0)
    #: Decode role: memory for prefetches, the KV of prompts streamed from prefill workers while they
    #: still prefill, kept until the decode request copies it into the paged cache (~46 KB a token for
    #: SmolLM2 in float32: 256 MiB stages about 5,800 tokens). A prefetch that does not fit is refused
    #: and its request pulls after the prefill as without one. 0: no prefetching.
    prefetch_max_bytes: int = Field(256 << 20, ge=0)
    #: On a failed pull: "recompute" the prompt locally, or "fail" the request.
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    #: CPUs for the KV server's and the puller's threads: "inherit" (the engine's own pinned CPUs),
    #: "all" (every CPU this worker may use, read before vLLM pins the engine), or a list ("0-3,6"),
    #: for a host with a core to spare for the transfer. "inherit" because moving them measured
    #: worse where every core runs an engine (see ``tandem.worker.kv_connector.cpus``).
    thread_cpus: str = "inherit"
    #: A directory of shared memory (tmpfs) for pulls between workers of one host: a decode worker pulls
    #: through it from a prefill worker of the same host (``node_name``) that opens the same directory,
    #: and over gRPC otherwise or when it fails (``tandem.worker.kv_connector.shm_transport``). "": off
    #: (gRPC only). In Kubernetes, both pods mount one ``emptyDir: {medium: Memory}``-like volume of the
    #: node here and run as the same user (segments are mode 0600); see docs/kv-transfer.md.
    shm_dir: str = "/dev/shm"
    #: Prefill role: shared-memory segments kept at most, each as large as the largest pull it served (a
    #: pull finding all in use goes over gRPC). Their sum must fit the directory (Docker's /dev/shm: 64 MB).
    shm_max_segments: int = Field(4, ge=1)
    #: This host's name for the shared-memory path ("": the kernel's boot id). In Kubernetes: the node's
    #: name (the downward API's spec.nodeName).
    node_name: str = ""

    @model_validator(mode="after")
    def _pull_gives_up_within_the_lease(self) -> KVSettings:
        if self.pull_timeout_s >= self.lease_s:
            raise ValueError(f"kv.pull_timeout_s ({self.pull_timeout_s}) must be less than kv.lease_s ({self.lease_s})")
        return self

    @model_validator(mode="after")
    def _thread_cpus_is_a_cpu_list(self) -> KVSettings:
        if self.thread_cpus not in ("inherit", "all") and not parse_cpu_list(self.thread_cpus):
            raise ValueError(f"kv.thread_cpus must be 'inherit', 'all' or a CPU list, not {self.thread_cpus!r}")
        return self


class KVEventsSettings(BaseModel):
    """The engine's KV-event publisher (ZMQ), which the router's prefix index subscribes to."""

    enabled: bool = True
    #: The one address the worker's relay serves the engine's events and replays on ("" = advertise_host,
    #: else bind_host; ``0.0.0.0``: all interfaces). Token ids are zeroed on either (kv_events_relay).
    host: str = ""
    #: PUB port.
    port: int = Field(5557, ge=1, le=65535)
    #: ROUTER port serving replays of the last ``buffer_steps`` batches to (re)subscribers.
    replay_port: int = Field(6557, ge=1, le=65535)
    #: Batches kept for replay (vLLM's buffer_steps).
    buffer_steps: int = Field(10_000, gt=0)


#: The LoRA ranks vLLM can be started for (``vllm.config.lora.MaxLoRARanks``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterSettings(BaseModel):
    """LoRA adapters (issue 40; tandem.worker.adapters): how many the engine holds at once, and how the
    worker reads the adapter catalog."""

    #: Adapters the engine holds at once (vLLM's ``max_loras`` and ``max_cpu_loras``); 0: LoRA off,
    #: every request naming an adapter is refused (FAILED_PRECONDITION).
    max_adapters: int = Field(0, ge=0)
    #: The highest LoRA rank an adapter may have (vLLM's ``max_lora_rank``); one above it fails to load.
    max_adapter_rank: int = 16
    #: A request reads a catalog at most this old (refreshed in the background twice as often).
    catalog_max_age_s: float = Field(1.0, gt=0)
    #: Redis unreachable: the last catalog read serves adapter requests this long, then they are refused.
    catalog_stale_s: float = Field(30.0, gt=0)
    #: Every adapter slot in use by running requests: a request waits this long for one, then is refused
    #: (RESOURCE_EXHAUSTED).
    slot_wait_s: float = Field(2.0, ge=0)

    @model_validator(mode="after")
    def _rank_is_one_vllm_takes(self) -> AdapterSettings:
        if self.max_adapter_rank not in LORA_RANKS:
            raise ValueError(f"adapters.max_adapter_rank must be one of {LORA_RANKS}, not {self.max_adapter_rank}")
        return self


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_WORKER_", env_nested_delimiter="__")

    role: Role = "prefill"
    #: Empty: generated from role, host and pid.
    worker_id: str = ""
    #: gRPC bind address of the tandem.v1.Worker service.
    bind_host: str = "127.0.0.1"
    #: Address registered for others to call ("" = bind_host).
    advertise_host: str = ""
    port: int = 50051
    #: The standard gRPC health service (grpc.health.v1) alone, in plaintext, on this port, for probes
    #: that cannot speak TLS (Kubernetes' gRPC probes); 0: off. The Worker port serves it too.
    health_port: int = Field(0, ge=0, le=65535)
    #: Prometheus metrics (vLLM's and Tandem's) on this port; 0 = off.
    metrics_port: int = 0
    engine: EngineSettings = Field(default_factory=EngineSettings)
    kv: KVSettings = Field(default_factory=KVSettings)
    kv_events: KVEventsSettings = Field(default_factory=KVEventsSettings)
    adapters: AdapterSettings = Field(default_factory=AdapterSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    #: TLS/mTLS for the Worker service and the KV transfer server (off: NetworkPolicies fence them).
    tls: TLSSettings = Field(default_factory=TLSSettings)
    log_level: str = "INFO"
    #: How long a stopping worker lets in-flight requests finish.
    drain_timeout_s: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _stuck_is_longer_than_a_pull(self) -> WorkerSettings:
        if self.engine.step_timeout_s <= self.kv.pull_timeout_s:
            raise ValueError(
                f"engine.step_timeout_s ({self.engine.step_timeout_s}) must be more than kv.pull_timeout_s "
                f"({self.kv.pull_timeout_s}): a decode waiting for its pull steps no forward pass"
            )
        return self
