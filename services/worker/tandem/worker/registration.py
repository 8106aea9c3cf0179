"""Keeps this worker registered in Redis (role, addresses, capacity, load)
with a heartbeat, so the router and the gateway see it and a dead worker
disappears after the registry's TTL. Run by ``__main__``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from tandem.common.errors import BackendUnavailableError
from tandem.common.kv_fingerprint import model_revision
from tandem.common.registry import WorkerLoad, WorkerRecord, WorkerRegistry
from tandem.worker.kv_connector import shm
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.service import WorkerService
from tandem.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)


def build_record(
    settings: WorkerSettings,
    worker_id: str,
    *,
    num_kv_blocks: int,
    block_size_tokens: int,
    model_revision: str = "",
    kv_fingerprint: str = "",
) -> WorkerRecord:
    """The record this worker registers; ``model_revision`` and ``kv_fingerprint`` from
    :func:`kv_identity` (the router pairs prefill and decode workers by the fingerprint)."""
    from tandem.worker.engine import PREFIX_CACHING_HASH_ALGO, kv_events_endpoints, none_hash_seed

    host = settings.advertise_host or settings.bind_host
    events_endpoint, replay_endpoint = kv_events_endpoints(settings)
    return WorkerRecord(
        worker_id=worker_id,
        role=settings.role,
        model=settings.engine.served_model_name,
        address=f"{host}:{settings.port}",
        kv_address=f"{settings.kv.host}:{settings.kv.port}",
        kv_events_endpoint=events_endpoint,
        kv_events_replay_endpoint=replay_endpoint,
        block_hash_algo=PREFIX_CACHING_HASH_ALGO,
        block_hash_seed=none_hash_seed(),
        block_size_tokens=block_size_tokens,
        num_kv_blocks=num_kv_blocks,
        max_model_len=settings.engine.max_model_len,
        started_unix_s=time.time(),
        max_adapters=settings.adapters.max_adapters,
        model_revision=model_revision,
        kv_fingerprint=kv_fingerprint,
        **shm_advertisement(settings),
    )


def shm_advertisement(settings: WorkerSettings) -> dict[str, Any]:
    """The record's data-path fields: shared memory with this host's and directory's identity where
    ``kv.shm_dir`` is set and usable (the engine's KV connector reads the same), else gRPC alone."""
    if not settings.kv.shm_dir:
        return {}
    try:
        token = shm.dir_token(settings.kv.shm_dir)
    except OSError as exc:
        logger.warning("kv.shm_dir %s is not usable (%s): KV over gRPC only", settings.kv.shm_dir, exc)
        return {}
    return {
        "kv_data_paths": ("grpc", "shm"),
        "kv_shm_host_id": shm.host_id(settings.kv.node_name),
        "kv_shm_dir_token": token,
    }


def kv_identity(settings: WorkerSettings, layout: KVLayout) -> tuple[str, str]:
    """(model revision, KV fingerprint) of this worker's engine, from its own KV ``layout`` (read from the
    engine at start) and the weights' revision: the one the engine's KV server checks (``layout``'s,
    resolved once when the engine was configured), else declared in the settings or read from the
    model folder."""
    revision = layout.model_revision or model_revision(settings.engine.model_dir, settings.engine.model_revision)
    return revision, layout.fingerprint(revision)


async def heartbeat_forever(
    registry: WorkerRegistry, record: WorkerRecord, service: WorkerService, interval_s: float
) -> None:
    """Refresh the registration every ``interval_s`` until cancelled; survives Redis outages."""
    was_down = False
    while True:
        if not (service.draining or service.engine_dead):
            try:
                await registry.heartbeat(await _current(record, service))
                if was_down:
                    logger.info("registry reachable again; worker re-registered")
                was_down = False
            except BackendUnavailableError as exc:
                if not was_down:
                    logger.warning("cannot refresh registration: %s", exc)
                was_down = True
            except Exception:  # a heartbeat must never die: a silent stop unregisters the worker
                logger.exception("heartbeat failed; retrying")
        await asyncio.sleep(interval_s)


async def _current(record: WorkerRecord, service: WorkerService) -> WorkerRecord:
    """``record`` with the load of this moment (held KV from the engine's KV server, read at most every
    ``KV_STATS_REFRESH_S``: no Tandem component scores on it)."""
    num_held = (await service.recent_kv_stats()).num_held_requests
    engine = service.engine_load()
    return dataclasses.replace(
        record,
        adapters=service.loaded_adapters,
        load=WorkerLoad(
            num_running_requests=service.num_running,
            num_waiting_requests=engine.num_waiting_requests,
            kv_usage=engine.kv_usage,
            num_held_kv_requests=num_held,
            num_prompt_tokens_in_flight=service.num_prompt_tokens_in_flight,
            num_kv_tokens_in_flight=service.num_kv_tokens_in_flight,
        ),
    )
