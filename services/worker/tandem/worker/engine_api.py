"""What the worker's roles need from an engine, as a protocol.

:mod:`prefill` and :mod:`decode` handle their role over :class:`WorkerEngine`;
:class:`tandem.worker.engine.VLLMEngine` implements it over vLLM's
``AsyncLLM`` and the engine's KV server (reached through the engine, see
:mod:`tandem.worker.kv_connector.extension`); unit tests implement it with a
scripted fake."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.common.adapters import AdapterEntry
from tandem.v1 import kv_transfer_pb2
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.kv_connector.params import PrefetchOrder
from tandem.worker.validation import ModelLimits


@dataclass(frozen=True)
class EngineLoad:
    """What the engine itself says of its load (vLLM's own gauges)."""

    num_waiting_requests: int = 0
    #: Fraction of KV blocks in use, 0..1.
    kv_usage: float = 0.0
    num_kv_blocks: int = 0


class WorkerEngine(Protocol):
    def generate(
        self, prompt: dict[str, Any], params: Any, request_id: str, adapter: AdapterEntry | None = None
    ) -> AsyncIterator[Any]:
        """vLLM ``RequestOutput``s for one request (``AsyncLLM.generate``), with ``adapter``'s LoRA (loaded by
        tandem.worker.adapters) or the base model."""
        ...

    async def add_adapter(self, entry: AdapterEntry) -> None:
        """Load a LoRA adapter (``AsyncLLM.add_lora``); raise if its files do not load."""
        ...

    async def remove_adapter(self, entry: AdapterEntry) -> None:
        """Unload it (``AsyncLLM.remove_lora``)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def sampling_defaults(self) -> dict[str, Any]:
        """The model's own sampling defaults (generation_config.json)."""
        ...

    async def kv_layout(self) -> KVLayout:
        """The block layout of this engine's KV cache (the same on every rank)."""
        ...

    async def kv_abort(self, request_id: str) -> bool:
        """``request_id`` was aborted: on every rank, release the hold on its KV blocks (prefill) and drop
        its prefetch's staging (decode); True if there was either."""
        ...

    async def kv_prefetch(self, order: PrefetchOrder) -> str:
        """Start prefetching a running prefill's KV as ``order`` says (read with its capability, computed with
        its adapter) on every rank; "" if started, else why not."""
        ...

    async def kv_stats(self) -> kv_transfer_pb2.KVStats:
        """The KV server's counters, summed over ranks."""
        ...

    def load(self) -> EngineLoad:
        """Requests waiting in the engine's scheduler and KV usage, as the engine last reported them."""
        ...

    def decode_tokens(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        """The text of ``token_ids`` as the engine's tokenizer decodes them alone."""
        ...

    def limits(self) -> ModelLimits:
        """What a request must stay within (the model's vocabulary, its context, vLLM's limits)."""
        ...

    def is_dead(self) -> bool:
        """True once the engine can serve nothing again (tandem.worker.liveness)."""
        ...

    async def probe(self) -> None:
        """Return once the engine core answered a round trip it serves between steps (liveness)."""
        ...
