"""The KV handle, and every form it takes, converted here and nowhere else.

The prefill engine's ``request_finished`` produces it (:meth:`KVHandleParams.to_dict`,
inside vLLM's ``kv_transfer_params``), ``AsyncLLM`` returns it in
``RequestOutput.kv_transfer_params``, the worker service sends it to the gateway
as a ``tandem.v1.KVHandle`` (:meth:`KVHandleParams.to_proto`), and the decode
worker service reads it back (:meth:`KVHandleParams.from_proto`) into the
decode engine's ``kv_transfer_params`` (:func:`decode_params`).

One id names a prompt's KV on the whole KV path: the gateway's request id. The
prefill worker passes it to its engine in ``kv_transfer_params``
(:func:`prefill_params`), so the KV server holds the blocks under it; the
decode worker's ``PrefetchKV`` stages the KV under it, and its ``Decode``
carries it beside the handle (:meth:`KVHandleParams.from_proto`), so a load
finds the staged KV, or pulls and releases the hold, by that same id. vLLM's
own request ids (the caller's id with ``-`` and 8 random characters appended)
stay inside each engine: they are what vLLM's scheduler is told of
(``engine_request_id`` in the connector's messages), and no id is ever parsed
back out of one. Why the gateway's id and not one minted for the KV: it exists
before the prefill starts (a prefetch names the KV while the prefill runs, when
vLLM's id of it is not known anywhere outside the prefill engine), every call
on a request already carries it (``Abort`` frees the hold or the staging by it),
and it is unique per request (random, minted by the gateway; a prefill retried
goes to another worker). A second id would only have to be mapped back to it.

A prefetch is ordered by one :class:`PrefetchOrder`, read from ``PrefetchKV``
(:meth:`PrefetchOrder.from_proto`, once the worker service has checked the
request) and passed unchanged through the engine protocol, vLLM's
``collective_rpc`` (as a dict: :meth:`PrefetchOrder.to_dict`), the engine's KV
connector and its puller, which keeps it beside what it staged.

On the way back, what a decode engine's load did (:class:`LoadRecord`) travels
from its puller to its scheduler-side connector (vLLM's connector worker
metadata) and out in the finished request's ``kv_transfer_params``
(:func:`load_record_of`): the worker service never asks its KV server."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.v1 import common_pb2, worker_pb2

#: Set on a prefill request: keep its KV for a decode engine.
DO_REMOTE_DECODE = "do_remote_decode"
#: Set on a decode request: load the prompt's KV from the handle.
DO_REMOTE_PREFILL = "do_remote_prefill"
HANDLE = "tandem_kv_handle"
#: Set on a prefill request that keeps its KV: the capability that reads and releases it
#: (tandem.common.kv_capability); kept beside the blocks by the KV server.
CAPABILITY = "tandem_kv_capability"
#: Set on a prefill request that keeps its KV: the gateway's request id, which names the KV on the KV
#: path (vLLM's scheduler knows the request by its own id only).
REQUEST_ID = "tandem_request_id"
#: In a finished decode request's ``kv_transfer_params``: what its KV load did.
KV_LOAD = "tandem_kv_load"


@dataclass(frozen=True)
class KVHandleParams:
    """Where a prefill engine holds a request's KV blocks. The block layout is
    checked separately, against the live tensors on both sides."""

    engine_id: str
    kv_address: str
    #: The gateway's request id, which names the KV on the KV path (not part of the proto handle: the
    #: decode worker adds it from ``DecodeRequest.request_id``).
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_expires_unix_s: float
    #: Decode side: the capability the KV server asks for (tandem.common.kv_capability). Not part of the
    #: handle the gateway gets (it minted it): the decode worker adds it from ``DecodeRequest``.
    capability: str = field(default="", repr=False)
    #: The LoRA adapter the blocks were computed with (its engine name, tandem.common.adapters; "" for the
    #: base model), as the prefill engine itself ran the request.
    adapter: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "kv_address": self.kv_address,
            "request_id": self.request_id,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "lease_expires_unix_s": self.lease_expires_unix_s,
            "capability": self.capability,
            "adapter": self.adapter,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVHandleParams:
        return cls(
            engine_id=str(data["engine_id"]),
            kv_address=str(data["kv_address"]),
            request_id=str(data["request_id"]),
            block_ids=tuple(int(b) for b in data["block_ids"]),
            num_tokens=int(data["num_tokens"]),
            lease_expires_unix_s=float(data["lease_expires_unix_s"]),
            capability=str(data.get("capability", "")),
            adapter=str(data.get("adapter", "")),
        )

    def to_proto(self, layout: common_pb2.KVLayout) -> common_pb2.KVHandle:
        """The handle for the gateway, with the prefill engine's block ``layout``."""
        return common_pb2.KVHandle(
            engine_id=self.engine_id,
            kv_address=self.kv_address,
            block_ids=list(self.block_ids),
            num_tokens=self.num_tokens,
            layout=layout,
            lease_expires_unix_s=self.lease_expires_unix_s,
            adapter=self.adapter,
        )

    @classmethod
    def from_proto(cls, handle: common_pb2.KVHandle, request_id: str, capability: str) -> KVHandleParams:
        """The handle a decode request carries, for the KV of ``request_id`` (the request's own id) read
        with ``capability`` (its layout is checked by the caller)."""
        return cls(
            engine_id=handle.engine_id,
            kv_address=handle.kv_address,
            request_id=request_id,
            block_ids=tuple(handle.block_ids),
            num_tokens=handle.num_tokens,
            lease_expires_unix_s=handle.lease_expires_unix_s,
            capability=capability,
            adapter=handle.adapter,
        )


@dataclass(frozen=True)
class PrefetchOrder:
    """Stream a running prefill's prompt KV into this decode engine's staging (``PrefetchKV``, decode side;
    tandem.worker.kv_connector.puller): the same six fields on every layer it crosses."""

    #: The gateway's request id, which names the KV on the KV path (the load's handle carries it too).
    request_id: str
    #: The prefill engine's KV server.
    kv_address: str
    num_prompt_tokens: int
    #: The decode worker's prefix hit the router expects: these tokens' whole blocks are not prefetched.
    num_decode_cached_tokens: int
    #: The prompt's capability (tandem.common.kv_capability), ``PrefetchKVRequest.kv_capability``.
    capability: str = field(repr=False)
    #: The LoRA adapter the decode will run with (its engine name; "" for the base model): the stream asks for
    #: KV computed with it.
    adapter: str

    @classmethod
    def from_proto(cls, request: worker_pb2.PrefetchKVRequest) -> PrefetchOrder:
        """The order of a ``PrefetchKV`` (checked by the caller: tandem.worker.validation.check_prefetch)."""
        return cls(
            request_id=request.request_id,
            kv_address=request.kv_address,
            num_prompt_tokens=request.num_prompt_tokens,
            num_decode_cached_tokens=request.num_decode_cached_tokens,
            capability=request.kv_capability,
            adapter=request.adapter,
        )

    def to_dict(self) -> dict[str, Any]:
        """For ``collective_rpc``: vLLM's engine-core client encodes a utility call's arguments with msgpack
        (msgspec), which turns a dataclass into a map, so the worker process gets a dict either way."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefetchOrder:
        return cls(**data)


def prefill_params(request_id: str, capability: str) -> dict[str, Any]:
    """``kv_transfer_params`` for the prefill of ``request_id`` (the gateway's id), whose KV a decode engine
    will pull with ``capability``."""
    return {DO_REMOTE_DECODE: True, REQUEST_ID: request_id, CAPABILITY: capability}


def decode_params(handle: KVHandleParams) -> dict[str, Any]:
    """``kv_transfer_params`` for a decode request that loads its prompt KV from ``handle``."""
    return {DO_REMOTE_PREFILL: True, HANDLE: handle.to_dict()}


@dataclass(frozen=True)
class LoadRecord:
    """What one decode-side KV load did (summed over tensor-parallel ranks)."""

    num_kv_tokens_loaded: int
    num_blocks_loaded: int
    num_bytes: int
    seconds: float
    failed: bool = False
    error: str = ""
    #: Copied from a prefetch's staging (streamed while the prefill ran), not pulled now.
    prefetched: bool = False
    #: From the load's end to the engine step that reported it to vLLM's scheduler.
    reported_after_s: float = 0.0
    #: Of ``seconds``, for a load copied from a prefetch: waiting for its stream to end.
    prefetch_wait_s: float = 0.0

    def merge(self, other: LoadRecord) -> LoadRecord:
        """The same request's load on another rank: bytes add up, the slower rank sets the time."""
        return LoadRecord(
            num_kv_tokens_loaded=max(self.num_kv_tokens_loaded, other.num_kv_tokens_loaded),
            num_blocks_loaded=max(self.num_blocks_loaded, other.num_blocks_loaded),
            num_bytes=self.num_bytes + other.num_bytes,
            seconds=max(self.seconds, other.seconds),
            failed=self.failed or other.failed,
            error=self.error or other.error,
            prefetched=self.prefetched and other.prefetched,
            reported_after_s=max(self.reported_after_s, other.reported_after_s),
            prefetch_wait_s=max(self.prefetch_wait_s, other.prefetch_wait_s),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_kv_tokens_loaded": self.num_kv_tokens_loaded,
            "num_blocks_loaded": self.num_blocks_loaded,
            "num_bytes": self.num_bytes,
            "seconds": self.seconds,
            "failed": self.failed,
            "error": self.error,
            "prefetched": self.prefetched,
            "reported_after_s": self.reported_after_s,
            "prefetch_wait_s": self.prefetch_wait_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadRecord:
        return cls(
            num_kv_tokens_loaded=int(data["num_kv_tokens_loaded"]),
            num_blocks_loaded=int(data["num_blocks_loaded"]),
            num_bytes=int(data["num_bytes"]),
            seconds=float(data["seconds"]),
            failed=bool(data.get("failed", False)),
            error=str(data.get("error", "")),
            prefetched=bool(data.get("prefetched", False)),
            reported_after_s=float(data.get("reported_after_s", 0.0)),
            prefetch_wait_s=float(data.get("prefetch_wait_s", 0.0)),
        )


def load_record_of(kv_transfer_params: dict[str, Any] | None) -> LoadRecord | None:
    """The load record a finished decode's output carries; None when nothing was loaded."""
    data = (kv_transfer_params or {}).get(KV_LOAD)
    return LoadRecord.from_dict(data) if data else None
