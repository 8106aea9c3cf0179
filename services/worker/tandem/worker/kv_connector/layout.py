"""What one KV block of one layer looks like in memory.

Two engines can exchange blocks only when model, dtype, block size, number of
layers, block shape, tensor-parallel size, the block dimension's place in
the cache tensor and the weights' revision are all equal; anything else is
refused with :class:`tandem.common.errors.KVLayoutMismatchError` before a
single byte moves. The router pairs only workers of one fingerprint (the same
facts, :mod:`tandem.common.kv_fingerprint`); this check is the KV server's own,
so a wrong pairing (a router bug, a forged placement) still moves no byte of
another revision's KV. A revision left empty (an older worker) is not compared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.common.errors import KVLayoutMismatchError
from tandem.common.kv_fingerprint import kv_fingerprint
from tandem.v1 import common_pb2


@dataclass(frozen=True)
class KVLayout:
    model: str
    dtype: str
    block_size_tokens: int
    num_layers: int
    #: Shape of ``kv_layer[block_id]`` (one block of one layer).
    block_shape: tuple[int, ...]
    tp_size: int = 1
    #: Which dimension of a layer's cache tensor indexes blocks (the wire keeps the cache's
    #: dimension order, see :mod:`wire`, so both sides must agree on it).
    block_dim: int = 0
    #: The weights' revision (:func:`tandem.common.kv_fingerprint.model_revision`); "" when unknown.
    model_revision: str = ""

    @property
    def block_numel(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    def fingerprint(self, model_revision: str) -> str:
        """This layout's fingerprint with the weights' revision (what the worker registers)."""
        return kv_fingerprint(
            model=self.model,
            model_revision=model_revision,
            dtype=self.dtype,
            block_size_tokens=self.block_size_tokens,
            num_layers=self.num_layers,
            block_shape=self.block_shape,
            tp_size=self.tp_size,
            block_dim=self.block_dim,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "block_size_tokens": self.block_size_tokens,
            "num_layers": self.num_layers,
            "block_shape": list(self.block_shape),
            "tp_size": self.tp_size,
            "block_dim": self.block_dim,
            "model_revision": self.model_revision,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        return cls(
            model=str(data["model"]),
            dtype=str(data["dtype"]),
            block_size_tokens=int(data["block_size_tokens"]),
            num_layers=int(data["num_layers"]),
            block_shape=tuple(int(d) for d in data["block_shape"]),
            tp_size=int(data.get("tp_size", 1)),
            block_dim=int(data.get("block_dim", 0)),
            model_revision=str(data.get("model_revision", "")),
        )

    def to_proto(self) -> common_pb2.KVLayout:
        return common_pb2.KVLayout(
            model=self.model,
            dtype=self.dtype,
            block_size_tokens=self.block_size_tokens,
            num_layers=self.num_layers,
            block_shape=list(self.block_shape),
            tp_size=self.tp_size,
            block_dim=self.block_dim,
            model_revision=self.model_revision,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.KVLayout) -> KVLayout:
        return cls(
            model=msg.model,
            dtype=msg.dtype,
            block_size_tokens=msg.block_size_tokens,
            num_layers=msg.num_layers,
            block_shape=tuple(msg.block_shape),
            tp_size=msg.tp_size or 1,
            block_dim=msg.block_dim,
            model_revision=msg.model_revision,
        )

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`KVLayoutMismatchError` naming every field that differs."""
        diffs = [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in ("model", "dtype", "block_size_tokens", "num_layers", "block_shape", "tp_size", "block_dim")
            if getattr(self, name) != getattr(other, name)
        ]
        if self.model_revision and other.model_revision and self.model_revision != other.model_revision:
            diffs.append(f"model_revision: {self.model_revision!r} != {other.model_revision!r}")
        if diffs:
            raise KVLayoutMismatchError(
                "prefill and decode engines cannot exchange KV blocks (" + "; ".join(diffs) + ")"
            )
