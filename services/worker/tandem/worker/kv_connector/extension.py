"""What the worker service asks of its engine's KV server, through the engine.

vLLM mixes :class:`KVWorkerExtension` into its model-runner worker
(``worker_extension_cls``); ``AsyncLLM.collective_rpc`` calls these methods on
every tensor-parallel rank, between engine steps, over the engine's own IPC.
So the worker service needs no gRPC channel to its own KV server, and an
abort reaches every rank's holds and prefetches, not rank 0's alone. Values are plain
(msgpack-able): the layout and a prefetch's order as dicts, the counters as
serialized ``tandem.v1.KVStats``."""

from __future__ import annotations

from typing import Any

from tandem.worker.kv_connector.params import PrefetchOrder

#: For ``worker_extension_cls``.
WORKER_EXTENSION = "tandem.worker.kv_connector.extension.KVWorkerExtension"


def _side() -> Any:
    """This rank's :class:`~tandem.worker.kv_connector.worker_side.WorkerSide`."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        raise RuntimeError("this engine runs without the Tandem KV connector")
    side = getattr(get_kv_transfer_group(), "_worker", None)
    if side is None:
        raise RuntimeError("the engine's KV connector is not Tandem's GrpcKVConnector")
    return side


class KVWorkerExtension:
    """Methods vLLM adds to its worker class; names carry a ``tandem_kv_`` prefix (vLLM refuses clashes)."""

    def tandem_kv_layout(self) -> dict[str, Any] | None:
        layout = _side().layout
        return layout.to_dict() if layout is not None else None

    def tandem_kv_abort(self, request_id: str) -> bool:
        """``request_id`` was aborted: release its hold (prefill) and drop its prefetch's staging (decode);
        False if there was neither."""
        return bool(_side().abort(request_id))

    def tandem_kv_prefetch(self, order: dict[str, Any]) -> str:
        """Start prefetching a prompt's KV as ``order`` (:meth:`PrefetchOrder.to_dict`) says (decode side); ""
        if started, else why not."""
        return str(_side().prefetch(PrefetchOrder.from_dict(order)))

    def tandem_kv_stats(self) -> bytes:
        return bytes(_side().stats().SerializeToString())
