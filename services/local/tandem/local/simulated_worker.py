"""SIMULATED workers: stand-ins for vLLM workers when testing the router at scale.

Nothing here runs a model. A :class:`SimulatedWorker` speaks the same
protocols as a real worker so that the router cannot tell the difference:

* it registers in the Redis worker registry with a heartbeat (worker ids
  start with ``simulated-``), with block size, KV capacity and load;
* it serves ``tandem.v1.Worker`` (Prefill, Decode, GetLoad, Health) over gRPC,
  sleeping as long as :class:`SimulatedLatencyModel` says a CPU engine would;
* it keeps a prefix cache of ``num_kv_blocks`` blocks (LRU, hashed exactly as
  vLLM does, :mod:`tandem.common.block_hash`) and publishes BlockStored /
  BlockRemoved on a ZMQ PUB socket with a replay ROUTER socket, in vLLM's
  wire format (:mod:`tandem.common.kv_events`);
* with ``max_adapters`` > 0 it holds SIMULATED LoRA adapter slots as the real worker does
  (:mod:`tandem.worker.adapters`): an adapter is loaded on first use (``adapter_load_s`` of engine
  time, no prefill computes meanwhile), evicts the least recently used adapter no running request
  uses, and its record reports ``max_adapters`` and ``adapters`` (loaded now, least recently used
  first); a request for an adapter on a worker with ``max_adapters`` 0 is refused with
  FAILED_PRECONDITION, as the real worker refuses it. Nothing is loaded: an adapter is its name.
  Its blocks hash with the adapter as vLLM's do (``lora_name`` the engine name, ``lora_path``
  :func:`simulated_adapter_path`), so two adapters never share blocks here either.

The latency model is fitted to measured CPU numbers (``benchmarks/data/
simulated_latency_cpu.json`` says how they were measured). Numbers from
simulated workers describe the router, never model speed. Used by the router
tests (tests/unit/router, tests/integration) and ``benchmarks/bench_router.py``.

One module per job, their public names re-exported here: the latency model
(:mod:`tandem.local.simulated_latency`), the prefix cache and KV-event publisher
(:mod:`tandem.local.simulated_kv`), the gRPC Worker servicer (:mod:`tandem.local.simulated_servicer`)
and the cluster that starts, scales and stops many of them (:mod:`tandem.local.simulated_cluster`).
"""

from tandem.local.simulated_cluster import SimulatedCluster
from tandem.local.simulated_kv import MAX_SOCKETS, SimulatedKVEventPublisher, SimulatedPrefixCache
from tandem.local.simulated_latency import DEFAULT_LATENCY_MODEL_PATH, SimulatedLatencyModel
from tandem.local.simulated_servicer import (
    SIMULATED_ADAPTER_PATH_PREFIX,
    SimulatedAdapterRefused,
    SimulatedWorker,
    SimulatedWorkerConfig,
    simulated_adapter_path,
)

__all__ = [
    "DEFAULT_LATENCY_MODEL_PATH",
    "MAX_SOCKETS",
    "SIMULATED_ADAPTER_PATH_PREFIX",
    "SimulatedAdapterRefused",
    "SimulatedCluster",
    "SimulatedKVEventPublisher",
    "SimulatedLatencyModel",
    "SimulatedPrefixCache",
    "SimulatedWorker",
    "SimulatedWorkerConfig",
    "simulated_adapter_path",
]
