"""Builds vLLM's ``AsyncLLM`` for one worker role, with the gRPC KV connector
wired in, and :class:`VLLMEngine`, the worker's engine protocol over it.
Called by ``__main__``; with ``kv_connector``, the only code that starts vLLM."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tandem.common.adapters import AdapterEntry
from tandem.common.kv_fingerprint import model_revision
from tandem.v1 import kv_transfer_pb2
from tandem.worker import vllm_plugin
from tandem.worker.engine_api import EngineLoad
from tandem.worker.kv_connector.cpus import parse_cpu_list
from tandem.worker.kv_connector.extension import WORKER_EXTENSION
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.params import PrefetchOrder
from tandem.worker.kv_events_relay import WILDCARD_HOSTS, KVEventEndpoints, KVEventRelay, plan_endpoints
from tandem.worker.settings import WorkerSettings
from tandem.worker.validation import ModelLimits

CONNECTOR_MODULE = "tandem.worker.kv_connector.connector"
#: tandem.worker.first_token.ReplayFirstToken by name: vLLM imports it in the model-runner process.
FIRST_TOKEN_REPLAY = "tandem.worker.first_token:ReplayFirstToken"
#: tandem.worker.carried_penalties.CarriedPenalties, likewise by name.
CARRIED_PENALTIES = "tandem.worker.carried_penalties:CarriedPenalties"
CONNECTOR_CLASS = "GrpcKVConnector"


def resolve_dtype(dtype: str) -> str:
    """``auto`` means float32 on vLLM's CPU backend: its bfloat16 path (what
    ``auto`` picks there) answers nonsense for SmolLM2 (measured), float32 is
    correct and, for a small model, not slower on CPUs without AMX."""
    if dtype != "auto":
        return dtype
    from vllm.platforms import current_platform

    return "float32" if current_platform.is_cpu() else "auto"


#: ``engine.mq_poll_s`` on vLLM's CPU backend when unset (see :mod:`tandem.worker.vllm_plugin`).
CPU_MQ_POLL_S = 0.0005


def resolve_mq_poll_s(mq_poll_s: float | None) -> float:
    """``None`` means :data:`CPU_MQ_POLL_S` on vLLM's CPU backend and 0 (vLLM's busy loop) elsewhere."""
    if mq_poll_s is not None:
        return mq_poll_s
    from vllm.platforms import current_platform

    return CPU_MQ_POLL_S if current_platform.is_cpu() else 0.0


class NoDeviceError(RuntimeError):
    """vLLM found no device to run on (its platform is ``UnspecifiedPlatform``): the CUDA image on a node
    or in a pod without a GPU. Permanent: a restart finds no GPU either."""


def require_device() -> None:
    """Raise :class:`NoDeviceError` when vLLM detected no platform. Without this check vLLM goes on and
    fails deep in its configuration with ``RuntimeError: Device string must not be empty`` (vllm 0.32.0,
    ``DeviceConfig``), which names neither the GPU nor what the pod lacks."""
    from vllm.platforms import current_platform

    if not current_platform.is_unspecified():
        return
    import torch

    cuda = torch.version.cuda
    built_for = f"torch {torch.__version__} is built for CUDA {cuda}" if cuda else f"torch {torch.__version__}"
    raise NoDeviceError(
        f"no GPU found: {built_for} and sees no GPU (torch.cuda.is_available() is False). "
        "The worker needs an NVIDIA GPU (on Kubernetes: an nvidia.com/gpu limit, on a node with the NVIDIA "
        f"driver{f' for CUDA {cuda}' if cuda else ''} and container toolkit); without one, run the worker-cpu image."
    )


#: vLLM's default prefix-caching hash; the router reproduces only this one.
PREFIX_CACHING_HASH_ALGO = "sha256"


def none_hash_seed() -> str:
    """The seed of the engine's first-block parent hash, as vLLM resolves it
    (PYTHONHASHSEED, inherited by the engine process, else a fixed default)."""
    from tandem.common.block_hash import DEFAULT_NONE_HASH_SEED

    return os.environ.get("PYTHONHASHSEED") or DEFAULT_NONE_HASH_SEED


def kv_events_plan(settings: WorkerSettings) -> KVEventEndpoints | None:
    """Where the engine's KV-event publisher and replay socket bind (None when events are off):
    private ipc sockets that :class:`~tandem.worker.kv_events_relay.KVEventRelay` serves, token ids
    redacted, on the worker's own address (``kv_events.host``, else the advertised host, else the
    bind host), or on all interfaces for ``0.0.0.0``."""
    ev = settings.kv_events
    if not ev.enabled:
        return None
    host = ev.host or settings.advertise_host or settings.bind_host
    return plan_endpoints(host, ev.port, ev.replay_port)


def kv_events_config(settings: WorkerSettings) -> dict[str, Any] | None:
    """vLLM's ``kv_events_config`` for :func:`kv_events_plan`."""
    plan = kv_events_plan(settings)
    if plan is None:
        return None
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": plan.engine_publish,
        "replay_endpoint": plan.engine_replay,
        "buffer_steps": settings.kv_events.buffer_steps,
        "topic": "",
    }


def kv_events_endpoints(settings: WorkerSettings) -> tuple[str, str]:
    """(PUB endpoint, replay endpoint) as others reach them; ("", "") when off."""
    plan = kv_events_plan(settings)
    if plan is None:
        return "", ""
    if (settings.kv_events.host or settings.advertise_host or settings.bind_host) not in WILDCARD_HOSTS:
        return plan.public_publish, plan.public_replay
    host = settings.advertise_host or settings.bind_host  # bound on all interfaces: reached at this one
    return f"tcp://{host}:{settings.kv_events.port}", f"tcp://{host}:{settings.kv_events.replay_port}"


def kv_thread_cpus(setting: str) -> list[int]:
    """The CPUs of the KV connector's threads (``kv.thread_cpus``): "inherit" -> [] (the engine's
    own), "all" -> every CPU this process may use now (the API process, which vLLM does not pin),
    else the list given."""
    if setting == "inherit":
        return []
    if setting == "all":
        return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return sorted(parse_cpu_list(setting))


def engine_args_kwargs(settings: WorkerSettings, *, engine_id: str) -> dict[str, Any]:
    """Keyword arguments for ``AsyncEngineArgs`` (kept plain for tests)."""
    eng = settings.engine
    events = kv_events_config(settings)
    return {
        **({"kv_events_config": events} if events else {}),
        "prefix_caching_hash_algo": PREFIX_CACHING_HASH_ALGO,
        "model": str(eng.model_dir),
        "served_model_name": eng.served_model_name,
        "max_model_len": eng.max_model_len,
        "enforce_eager": eng.enforce_eager,
        "dtype": resolve_dtype(eng.dtype),
        "kv_cache_memory_bytes": eng.kv_cache_bytes,
        "max_num_seqs": eng.max_num_seqs,
        "tensor_parallel_size": eng.tensor_parallel_size,
        "enable_prefix_caching": True,
        **lora_kwargs(settings),
        # Decode replays the prefill's first token (tandem.worker.first_token), or takes output tokens as
        # prompt with their penalties carried (tandem.worker.carried_penalties).
        "logits_processors": [FIRST_TOKEN_REPLAY, CARRIED_PENALTIES],
        # The worker service reaches its KV server through the engine (tandem.worker.kv_connector.extension).
        "worker_extension_cls": WORKER_EXTENSION,
        # Our connector serves one full-attention group; HMA would need SupportsHMA.
        "disable_hybrid_kv_cache_manager": True,
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer" if settings.role == "prefill" else "kv_consumer",
            "engine_id": engine_id,
            "kv_load_failure_policy": settings.kv.load_failure_policy,
            "kv_connector_extra_config": {
                "model": eng.served_model_name,
                # The same revision the worker registers (tandem.worker.registration.kv_identity).
                "model_revision": model_revision(eng.model_dir, eng.model_revision),
                "kv_host": settings.kv.host,
                "kv_port": settings.kv.port,
                "lease_s": settings.kv.lease_s,
                "max_chunk_bytes": settings.kv.max_chunk_bytes,
                "pull_timeout_s": settings.kv.pull_timeout_s,
                "prefetch_max_bytes": settings.kv.prefetch_max_bytes if settings.role == "decode" else 0,
                "thread_cpus": kv_thread_cpus(settings.kv.thread_cpus),
                "shm_dir": settings.kv.shm_dir,
                "shm_max_segments": settings.kv.shm_max_segments,
                "node_name": settings.kv.node_name,
                "tls": settings.tls.to_dict(),
            },
        },
    }


def lora_kwargs(settings: WorkerSettings) -> dict[str, Any]:
    """LoRA's engine arguments: none with LoRA off; else as many adapters in a batch as in memory, so that
    vLLM holds exactly what tandem.worker.adapters loaded (and never evicts on its own)."""
    adapters = settings.adapters
    if not adapters.max_adapters:
        return {}
    return {
        "enable_lora": True,
        "max_loras": adapters.max_adapters,
        "max_cpu_loras": adapters.max_adapters,
        "max_lora_rank": adapters.max_adapter_rank,
    }


def lora_request(adapter: AdapterEntry) -> Any:
    """vLLM's ``LoRARequest`` for one load of an adapter: known by its engine name (hashed into every block
    with its path), its version as the id (unique: one counter for all loads)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.engine_name, lora_int_id=adapter.version, lora_path=adapter.path)


class VLLMEngine:
    """:class:`~tandem.worker.engine_api.WorkerEngine` over a started ``AsyncLLM``. The KV server's
    layout, counters and holds are reached with ``collective_rpc`` on every rank (the methods of
    :class:`~tandem.worker.kv_connector.extension.KVWorkerExtension`)."""

    def __init__(self, llm: Any, *, relay: KVEventRelay | None = None) -> None:
        self.llm = llm
        self._relay = relay

    def generate(
        self, prompt: dict[str, Any], params: Any, request_id: str, adapter: AdapterEntry | None = None
    ) -> AsyncIterator[Any]:
        lora = lora_request(adapter) if adapter is not None else None
        result: AsyncIterator[Any] = self.llm.generate(prompt, params, request_id, lora_request=lora)
        return result

    async def add_adapter(self, entry: AdapterEntry) -> None:
        if not await self.llm.add_lora(lora_request(entry)):
            raise RuntimeError(f"the engine did not load {entry.engine_name}")

    async def remove_adapter(self, entry: AdapterEntry) -> None:
        await self.llm.remove_lora(entry.version)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def sampling_defaults(self) -> dict[str, Any]:
        return dict(self.llm.model_config.get_diff_sampling_param())

    async def kv_layout(self) -> KVLayout:
        layouts = await self.llm.collective_rpc("tandem_kv_layout")
        if not layouts or layouts[0] is None:
            raise RuntimeError("the engine's KV connector has no KV caches registered")
        return KVLayout.from_dict(layouts[0])

    async def kv_abort(self, request_id: str) -> bool:
        return any(await self.llm.collective_rpc("tandem_kv_abort", args=(request_id,)))

    async def kv_prefetch(self, order: PrefetchOrder) -> str:
        reasons = await self.llm.collective_rpc("tandem_kv_prefetch", args=(order.to_dict(),))
        refused = next((str(r) for r in reasons if r), "")
        if refused and any(not r for r in reasons):
            await self.kv_abort(order.request_id)  # started on some ranks only: no use to anyone
        return refused

    async def kv_stats(self) -> kv_transfer_pb2.KVStats:
        total = kv_transfer_pb2.KVStats()
        for rank, raw in enumerate(await self.llm.collective_rpc("tandem_kv_stats")):
            stats = kv_transfer_pb2.KVStats.FromString(raw)
            if rank == 0:
                total.CopyFrom(stats)  # layout and held requests: rank 0 speaks for all
                continue
            for field in ("bytes_sent_total", "bytes_received_total", "transfer_seconds_total", "staged_bytes"):
                setattr(total, field, getattr(total, field) + getattr(stats, field))
        return total

    def load(self) -> EngineLoad:
        """From vLLM's own Prometheus gauges in this process (its stat logger sets them every step):
        the same numbers /metrics shows, so the router scores on what a dashboard sees."""
        from prometheus_client import REGISTRY

        labels = {"engine": "0", "model_name": str(self.llm.model_config.served_model_name)}
        waiting = REGISTRY.get_sample_value("vllm:num_requests_waiting", labels)
        usage = REGISTRY.get_sample_value("vllm:kv_cache_usage_perc", labels)
        return EngineLoad(
            num_waiting_requests=int(waiting or 0),
            kv_usage=min(1.0, max(0.0, float(usage or 0.0))),
            num_kv_blocks=self.kv_cache_shape()[0],
        )

    def decode_tokens(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return str(self.llm.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def limits(self) -> ModelLimits:
        model = self.llm.model_config
        max_logprobs = int(model.max_logprobs)
        return ModelLimits(
            vocab_size=int(model.get_vocab_size()),
            max_model_len=int(model.max_model_len),
            max_logprobs=max_logprobs if max_logprobs >= 0 else int(model.get_vocab_size()),
            block_size_tokens=self.kv_cache_shape()[1],
        )

    def is_dead(self) -> bool:
        """vLLM's own verdict: the engine-core process exited (its monitor thread saw it) or a step raised
        and the engine core reported itself dead, or the output loop ended."""
        return bool(self.llm.errored)

    async def probe(self) -> None:
        """A round trip to the engine-core process, answered between two steps (``is_sleeping`` reads a
        flag there and reaches no model runner; tandem.worker.liveness)."""
        await self.llm.is_sleeping()

    def kv_cache_shape(self) -> tuple[int, int]:
        """(number of KV blocks, tokens per block) of this engine."""
        cache = self.llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0), int(cache.block_size or 0)

    def shutdown(self) -> None:
        self.llm.shutdown()
        if self._relay is not None:
            self._relay.close()


def build_engine(settings: WorkerSettings) -> VLLMEngine:
    """Start an ``AsyncLLM`` (spawns the engine-core and model-runner processes); :class:`NoDeviceError`
    when vLLM found no device to run on."""
    if settings.engine.cpu_threads_bind:
        # Read by vLLM's CPU worker in the child process it spawns.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.engine.cpu_threads_bind
    # After the environment above: it imports vLLM's platform, as resolve_mq_poll_s does.
    require_device()
    # Read by tandem.worker.vllm_plugin in the engine's processes.
    os.environ[vllm_plugin.ENV] = str(resolve_mq_poll_s(settings.engine.mq_poll_s))
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_id = f"{settings.role}-{uuid.uuid4().hex[:12]}"
    args = AsyncEngineArgs(**engine_args_kwargs(settings, engine_id=engine_id))
    plan = kv_events_plan(settings)
    relay = None if plan is None else KVEventRelay(plan)
    if relay is not None:
        relay.start()
    try:
        return VLLMEngine(AsyncLLM.from_engine_args(args), relay=relay)
    except BaseException:
        if relay is not None:
            relay.close()
        raise
