"""What a request's ``model`` names: a base model this deployment serves, or a LoRA adapter of one.

Called by :func:`tandem.gateway.api.prepare.prepare` (each generation request), by the
``/v1/models`` routes and by the admin API (:mod:`tandem.gateway.api.admin_adapters`); reads the
adapter catalog (:class:`tandem.common.adapters.AdapterCatalog`, Redis) through a cache of at
most ``cache_s`` (1 s by default), so that an adapter unloaded by the admin gets 404 on every
gateway within that long, while a busy gateway reads the catalog once a second, not once a request.

vLLM's convention: a request names an adapter by its plain name in ``model``. A base model resolves
without reading the catalog (a base model's name can never be an adapter's: the admin refuses to load
one under a served model's name). An adapter resolves to its base model and its **engine name**
(``NAME@VERSION``) and path, which go into the Schedule, Prefill and Decode requests and the prompt's
block hashes. Anything else is ``None``: the caller answers 404 ``model_not_found``.

Failure of the peer: Redis unreachable or too slow (``BackendUnavailableError`` from the catalog) —
the last catalog read goes on serving (an unload is a write to that same Redis, so an outage cannot
hide one from a gateway that reads the Redis the admin writes), logged once per failed refresh; with
no read ever made, the request fails with 503 ``backend_unavailable``. Base-model requests are never
held up by the catalog. An entry that does not parse is skipped by the catalog (the name gets 404).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tandem.common.adapters import AdapterEntry

logger = logging.getLogger(__name__)


class CatalogReader(Protocol):
    """What resolution needs of :class:`tandem.common.adapters.AdapterCatalog`."""

    async def entries(self) -> dict[str, AdapterEntry]: ...


@dataclass(frozen=True)
class ResolvedModel:
    """A request's ``model``, resolved."""

    #: As the client named it (responses name the model so).
    requested: str
    #: The served base model that runs it (the router's and the workers' ``model``).
    base_model: str
    #: The adapter's engine name (``NAME@VERSION``), "" for the base model.
    adapter: str = ""
    #: The adapter's files as the engine loads them (part of every block hash), "" for the base model.
    adapter_path: str = ""

    @classmethod
    def of_entry(cls, entry: AdapterEntry) -> ResolvedModel:
        return cls(entry.name, entry.base_model, entry.engine_name, entry.path)


class ModelResolver:
    """Resolves names against the served base models and the catalog; one per process."""

    def __init__(
        self,
        served_models: tuple[str, ...],
        catalog: CatalogReader | None,
        *,
        cache_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not served_models:
            raise ValueError("a gateway serves at least one model")
        self.served_models = served_models
        self._catalog = catalog
        self._cache_s = cache_s
        self._clock = clock
        self._entries: dict[str, AdapterEntry] | None = None
        self._read_at_s = -float("inf")
        self._lock = asyncio.Lock()

    @property
    def default_model(self) -> str:
        """The model an adapter adapts when the admin names none: the first served model."""
        return self.served_models[0]

    async def adapters(self) -> Mapping[str, AdapterEntry]:
        """Every loaded adapter of a served model, by name, as read at most ``cache_s`` ago."""
        if self._catalog is None:
            return {}
        if self._clock() - self._read_at_s >= self._cache_s:
            async with self._lock:  # one read for every request that finds the cache old at once
                if self._clock() - self._read_at_s >= self._cache_s:
                    await self._refresh(self._catalog)
        return self._entries or {}

    async def _refresh(self, catalog: CatalogReader) -> None:
        try:
            entries = await catalog.entries()
        except Exception as exc:  # BackendUnavailableError, or the catalog's client failing otherwise
            if self._entries is None:
                raise
            logger.warning("adapter catalog unreadable, serving the last read: %s", exc)
            self._read_at_s = self._clock()  # ask again in cache_s, not on every request meanwhile
            return
        self._entries = {n: e for n, e in entries.items() if e.base_model in self.served_models}
        self._read_at_s = self._clock()

    async def resolve(self, model: str) -> ResolvedModel | None:
        """``model`` resolved, or None when it is neither a served model nor a loaded adapter."""
        if model in self.served_models:
            return ResolvedModel(model, model)
        entry = (await self.adapters()).get(model)
        return ResolvedModel.of_entry(entry) if entry is not None else None

    def forget(self) -> None:
        """Read the catalog again on the next request (after this process changed it)."""
        self._read_at_s = -float("inf")
