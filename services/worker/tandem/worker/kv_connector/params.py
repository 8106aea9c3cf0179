"""The KV handle, and every form it takes, converted here and nowhere else.

The prefill engine's ``request_finished`` produces it (:meth:`KVHandleParams.to_dict`,
inside vLLM's ``kv_transfer_params``), ``AsyncLLM`` returns it in
``RequestOutput.kv_transfer_params``, the worker service sends it to the gateway
as a ``tandem.v1.KVHandle`` (:meth:`KVHandleParams.to_proto`), and the decode
worker service reads it back (:meth:`KVHandleParams.from_proto`) into the
decode engine's ``kv_transfer_params`` (:func:`decode_params`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.v1 import common_pb2

#: Set on a prefill request: keep its KV for a decode engine.
DO_REMOTE_DECODE = "do_remote_decode"
#: Set on a decode request: load the prompt's KV from the handle.
DO_REMOTE_PREFILL = "do_remote_prefill"
HANDLE = "tandem_kv_handle"


@dataclass(frozen=True)
class KVHandleParams:
    """Where a prefill engine holds a request's KV blocks. The block layout is
    checked separately, against the live tensors on both sides."""

    engine_id: str
    kv_address: str
    remote_request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_expires_unix_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "kv_address": self.kv_address,
            "remote_request_id": self.remote_request_id,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "lease_expires_unix_s": self.lease_expires_unix_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVHandleParams:
        return cls(
            engine_id=str(data["engine_id"]),
            kv_address=str(data["kv_address"]),
            remote_request_id=str(data["remote_request_id"]),
            block_ids=tuple(int(b) for b in data["block_ids"]),
            num_tokens=int(data["num_tokens"]),
            lease_expires_unix_s=float(data["lease_expires_unix_s"]),
        )

    def to_proto(self, layout: common_pb2.KVLayout) -> common_pb2.KVHandle:
        """The handle for the gateway, with the prefill engine's block ``layout``."""
        return common_pb2.KVHandle(
            engine_id=self.engine_id,
            kv_address=self.kv_address,
            remote_request_id=self.remote_request_id,
            block_ids=list(self.block_ids),
            num_tokens=self.num_tokens,
            layout=layout,
            lease_expires_unix_s=self.lease_expires_unix_s,
        )

    @classmethod
    def from_proto(cls, handle: common_pb2.KVHandle) -> KVHandleParams:
        """The handle a decode request carries (its layout is checked by the caller)."""
        return cls(
            engine_id=handle.engine_id,
            kv_address=handle.kv_address,
            remote_request_id=handle.remote_request_id,
            block_ids=tuple(handle.block_ids),
            num_tokens=handle.num_tokens,
            lease_expires_unix_s=handle.lease_expires_unix_s,
        )


def prefill_params() -> dict[str, Any]:
    """``kv_transfer_params`` for a prefill request whose KV a decode engine will pull."""
    return {DO_REMOTE_DECODE: True}


def decode_params(handle: KVHandleParams) -> dict[str, Any]:
    """``kv_transfer_params`` for a decode request that loads its prompt KV from ``handle``."""
    return {DO_REMOTE_PREFILL: True, HANDLE: handle.to_dict()}


def external_request_id(internal_request_id: str) -> str:
    """vLLM appends ``-<8 random chars>`` to the id a caller passes in."""
    head, sep, tail = internal_request_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_request_id
