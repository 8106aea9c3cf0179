"""Builds vLLM's ``AsyncLLM`` for one worker role, with the gRPC KV connector
wired in. Called by ``__main__``; the only module (with ``kv_connector``)
that imports vLLM."""

from __future__ import annotations

import os
import uuid
from typing import Any

from tandem.worker.settings import WorkerSettings

CONNECTOR_MODULE = "tandem.worker.kv_connector.connector"
#: tandem.worker.first_token.ReplayFirstToken by name: vLLM imports it in the model-runner process.
FIRST_TOKEN_REPLAY = "tandem.worker.first_token:ReplayFirstToken"
CONNECTOR_CLASS = "GrpcKVConnector"


def resolve_dtype(dtype: str) -> str:
    """``auto`` means float32 on vLLM's CPU backend: its bfloat16 path (what
    ``auto`` picks there) answers nonsense for SmolLM2 (measured), float32 is
    correct and, for a small model, not slower on CPUs without AMX."""
    if dtype != "auto":
        return dtype
    from vllm.platforms import current_platform

    return "float32" if current_platform.is_cpu() else "auto"


#: vLLM's default prefix-caching hash; the router reproduces only this one.
PREFIX_CACHING_HASH_ALGO = "sha256"


def none_hash_seed() -> str:
    """The seed of the engine's first-block parent hash, as vLLM resolves it
    (PYTHONHASHSEED, inherited by the engine process, else a fixed default)."""
    from tandem.common.block_hash import DEFAULT_NONE_HASH_SEED

    return os.environ.get("PYTHONHASHSEED") or DEFAULT_NONE_HASH_SEED


def kv_events_config(settings: WorkerSettings) -> dict[str, Any] | None:
    """vLLM's ``kv_events_config``: a ZMQ publisher bound on all interfaces
    (``*`` makes vLLM bind rather than connect) plus its replay socket."""
    ev = settings.kv_events
    if not ev.enabled:
        return None
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ev.port}",
        "replay_endpoint": f"tcp://*:{ev.replay_port}",
        "buffer_steps": ev.buffer_steps,
        "topic": "",
    }


def kv_events_endpoints(settings: WorkerSettings) -> tuple[str, str]:
    """(PUB endpoint, replay endpoint) as others reach them; ("", "") when off."""
    if not settings.kv_events.enabled:
        return "", ""
    host = settings.advertise_host or settings.bind_host
    return f"tcp://{host}:{settings.kv_events.port}", f"tcp://{host}:{settings.kv_events.replay_port}"


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
        # Decode replays the prefill's first token; see tandem.worker.first_token.
        "logits_processors": [FIRST_TOKEN_REPLAY],
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
                "kv_host": settings.kv.host,
                "kv_port": settings.kv.port,
                "lease_s": settings.kv.lease_s,
                "max_chunk_bytes": settings.kv.max_chunk_bytes,
                "pull_timeout_s": settings.kv.pull_timeout_s,
                "tls": settings.tls.to_dict(),
            },
        },
    }


def build_engine(settings: WorkerSettings) -> Any:
    """Start an ``AsyncLLM`` (spawns the engine-core and model-runner processes)."""
    if settings.engine.cpu_threads_bind:
        # Read by vLLM's CPU worker in the child process it spawns.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.engine.cpu_threads_bind
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_id = f"{settings.role}-{uuid.uuid4().hex[:12]}"
    args = AsyncEngineArgs(**engine_args_kwargs(settings, engine_id=engine_id))
    return AsyncLLM.from_engine_args(args)
