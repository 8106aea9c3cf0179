"""Which LoRA adapters this worker's engine holds: loaded on demand, evicted least recently used,
never while a request runs with them (issue 40).

A request names its adapter by **engine name** (``NAME@VERSION``, :mod:`tandem.common.adapters`).
:meth:`AdapterResidency.use` checks it against the adapter catalog (Redis; read at most
``catalog_max_age_s`` ago, refreshed in the background by :meth:`AdapterResidency.run`): the
name must be in the catalog, at that version, for this worker's model. Then it holds one of the
engine's ``max_adapters`` slots (vLLM's ``max_loras`` = ``max_cpu_loras``) for as long as the
request runs: an adapter already loaded is used at once (and becomes the most recently used); one
being loaded for another request is waited for (one load for all of them); otherwise it is loaded
(``add_lora``) into a free slot, or into the slot of the least recently used adapter that no running
request uses (``remove_lora`` first). Every slot in use by running requests: the request waits for
one to free, at most ``slot_wait_s``, then is refused with RESOURCE_EXHAUSTED (the gateway places
it again; the router sees the worker's adapters and free slots in its registry record). Waiting,
not refusing at once, because prefills end within a second or two and a refused request costs a
whole new placement; bounded, because a decode may hold its adapter for minutes.

Because every load and eviction goes through here, the engine's own LRU (vLLM evicts its oldest
adapter when its CPU cache is full) never runs: vLLM holds exactly the adapters :meth:`loaded` lists.

Refusals (:class:`AdapterRefused`, the gRPC status the worker answers with):

* LoRA off on this worker (``max_adapters`` 0): FAILED_PRECONDITION.
* Not in the catalog (unloaded, or an entry that does not parse or cannot be loaded: no path,
  version < 1), or superseded by a newer version: NOT_FOUND, naming the adapter only (the gateway
  answers 404). An adapter removed or superseded in the catalog is *retired*: it serves the
  requests running with it to their end, then is removed from the engine; new requests naming it
  are refused from the first catalog read that shows the change (≤ ``catalog_max_age_s``).
* Another model's adapter: FAILED_PRECONDITION.
* Its files do not load (missing, not a LoRA adapter of this model, a rank above
  ``max_adapter_rank``): FAILED_PRECONDITION "adapter … failed to load on this worker"; the cause
  is logged here, never sent (it names paths); the adapter is not marked loaded and frees its slot,
  and requests for it within ``load_failure_memory_s`` are refused without loading again.

Failure of the peers:

* The catalog (Redis) unreachable: the last catalog read serves, for at most ``catalog_stale_s``
  (adapters keep serving, nothing is retired: the worker cannot tell an unload from an outage); past
  that, every adapter request answers UNAVAILABLE ("adapter catalog unreachable") until Redis
  answers again. Base-model requests never read the catalog. A catalog entry that does not parse is
  skipped (NOT_FOUND for its name), never a crash.
* The engine fails a load: see above. The engine dies mid-load: the load fails like a bad file and
  the worker's liveness watch ends the worker.
* A request aborted (its caller gone, its gRPC call cancelled) while its adapter loads: the load
  goes on (shielded: a half-sent ``add_lora`` would leave the engine and this table disagreeing), the
  adapter ends up loaded and idle (the next request uses it, or it is evicted), and the aborted
  request's claim on the slot is dropped. Every claim is released in a ``finally``: no slot leaks,
  and no engine call is made from it (retired adapters are removed by a task of their own).
* A decode refused for its adapter (any refusal above, or a KV handle of another adapter) never
  reaches the engine: it holds no KV here, and the prefill worker's hold on the prompt's blocks is
  freed by the gateway's Abort of the failed request, else by its lease.
* KV pulled for a decode is checked twice against its adapter: the handle's (the decode worker
  service, like the layout) and the hold's on the prefill engine's KV server, which knows what its
  engine computed (a mismatch fails the load; the decode computes the prompt itself). KV prefetched
  while the prefill runs (PrefetchKV) the same way: the PrefetchKV names its adapter, the KV server
  refuses to stream a prompt its engine computes with another, and a load whose handle names another
  adapter than its prefetch pulls instead of using what was staged (tandem.worker.kv_connector.puller).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from tandem.common.adapters import ADAPTER_NAME, AdapterEntry, split_engine_name
from tandem.common.errors import BackendUnavailableError

logger = logging.getLogger(__name__)

#: Reads the catalog: every adapter by name (``AdapterCatalog.entries``); BackendUnavailableError when
#: Redis does not answer.
CatalogRead = Callable[[], Awaitable[Mapping[str, AdapterEntry]]]


class AdapterEngine(Protocol):
    """What residency needs from the engine (``AsyncLLM.add_lora`` / ``remove_lora``)."""

    async def add_adapter(self, entry: AdapterEntry) -> None:
        """Load ``entry``'s files under its engine name and version; raise if they do not load."""
        ...

    async def remove_adapter(self, entry: AdapterEntry) -> None: ...


class AdapterRefused(Exception):
    """A request's adapter cannot be used here: ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Resident:
    entry: AdapterEntry
    #: Requests running with it now.
    in_use: int = 0
    #: No longer the catalog's current version of its name: removed once ``in_use`` is 0.
    retired: bool = False


@dataclass
class _Load:
    entry: AdapterEntry
    future: asyncio.Future[None]
    #: Requests that will run with it once loaded.
    claims: int = 0


@dataclass
class _Catalog:
    entries: dict[str, AdapterEntry] = field(default_factory=dict)
    #: ``clock()`` of the last successful read; None before the first.
    read_at_s: float | None = None


def usable(entry: AdapterEntry) -> bool:
    """An entry the engine can be asked to load (``LoRARequest`` wants an id >= 1 and a path)."""
    return bool(entry.path) and entry.version >= 1 and bool(ADAPTER_NAME.fullmatch(entry.name))


class AdapterResidency:
    """One per worker with LoRA on; all of it runs on the worker's event loop."""

    def __init__(
        self,
        engine: AdapterEngine,
        read_catalog: CatalogRead,
        *,
        model: str,
        max_adapters: int,
        catalog_max_age_s: float = 1.0,
        catalog_stale_s: float = 30.0,
        slot_wait_s: float = 2.0,
        load_failure_memory_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_adapters < 1:
            raise ValueError("max_adapters must be >= 1 (0 means LoRA off: no residency)")
        self._engine = engine
        self._read_catalog = read_catalog
        self._model = model
        self.max_adapters = max_adapters
        self._max_age_s = catalog_max_age_s
        self._stale_s = catalog_stale_s
        self._slot_wait_s = slot_wait_s
        self._failure_memory_s = load_failure_memory_s
        self._clock = clock
        self._catalog = _Catalog()
        self._refreshing: asyncio.Future[None] | None = None
        #: Loaded adapters by engine name, least recently used first.
        self._resident: OrderedDict[str, _Resident] = OrderedDict()
        self._loading: dict[str, _Load] = {}
        #: Engine names whose load failed lately: (until, message).
        self._failed: dict[str, tuple[float, str]] = {}
        #: add_lora and remove_lora one at a time, in the order decided here.
        self._engine_ops = asyncio.Lock()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Catalog entries found unusable and logged.
        self._warned: set[tuple[str, AdapterEntry]] = set()
        #: Loads, evictions (of an idle adapter for another's load) and failed loads so far (tandem.worker.metrics).
        self.num_loads = 0
        self.num_evictions = 0
        self.num_load_failures = 0

    # -- what the registry record shows ---------------------------------------------------------

    def loaded(self) -> tuple[str, ...]:
        """Engine names loaded now, least recently used first (retired ones included until removed)."""
        return tuple(self._resident)

    def in_use(self, engine_name: str) -> int:
        res = self._resident.get(engine_name)
        return res.in_use if res is not None else 0

    # -- the catalog -----------------------------------------------------------------------------

    async def run(self, interval_s: float | None = None) -> None:
        """Refresh the catalog every ``interval_s`` (half the max age by default) until cancelled."""
        interval = self._max_age_s / 2 if interval_s is None else interval_s
        while True:
            try:
                await self.refresh()
            except Exception:  # the loop must not die: a stale catalog is refused, not served forever
                logger.exception("adapter catalog refresh failed")
            await asyncio.sleep(interval)

    async def refresh(self) -> None:
        """Read the catalog now (one read shared by concurrent callers), then retire what it no longer
        holds. Redis unreachable: the last read stays (see the module docstring)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._read())
        await asyncio.shield(self._refreshing)

    async def _read(self) -> None:
        try:
            raw = await self._read_catalog()
        except BackendUnavailableError as exc:
            logger.warning("adapter catalog unreachable; using the last read: %s", exc)
            return
        entries = {}
        for name, entry in raw.items():
            if usable(entry) and entry.name == name:
                entries[name] = entry
            elif (name, entry) not in self._warned:  # once, not at every read
                self._warned.add((name, entry))
                logger.warning("adapter catalog entry %r is not loadable; ignored", name)
        self._catalog = _Catalog(entries, self._clock())
        self._retire_stale()

    def _retire_stale(self) -> None:
        for engine_name, res in list(self._resident.items()):
            current = self._catalog.entries.get(res.entry.name)
            if current is None or current.version != res.entry.version:
                res.retired = True
                if res.in_use == 0:
                    self._remove(engine_name)

    async def _entries(self) -> dict[str, AdapterEntry]:
        read_at = self._catalog.read_at_s
        if read_at is None or self._clock() - read_at > self._max_age_s:
            await self.refresh()
            read_at = self._catalog.read_at_s
        if read_at is None or self._clock() - read_at > self._stale_s:
            raise AdapterRefused(grpc.StatusCode.UNAVAILABLE, "adapter catalog unreachable")
        return self._catalog.entries

    async def lookup(self, engine_name: str) -> AdapterEntry:
        """The catalog's entry for ``engine_name`` if a request may run with it here, else AdapterRefused."""
        try:
            name, version = split_engine_name(engine_name)
        except ValueError:
            raise AdapterRefused(grpc.StatusCode.INVALID_ARGUMENT, "adapter must be NAME@VERSION") from None
        entry = (await self._entries()).get(name)
        if entry is None or entry.version < version:
            await self.refresh()  # the gateway read a newer catalog than this worker
            entry = (await self._entries()).get(name)
        if entry is None:
            raise AdapterRefused(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} is not loaded")
        if entry.version != version:
            raise AdapterRefused(
                grpc.StatusCode.NOT_FOUND,
                f"adapter {name!r} version {version} is not loaded (the current version is {entry.version})",
            )
        if entry.base_model != self._model:
            raise AdapterRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"adapter {name!r} adapts model {entry.base_model!r}; this worker serves {self._model!r}",
            )
        return entry

    # -- slots -----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, engine_name: str) -> AsyncIterator[AdapterEntry]:
        """Hold ``engine_name`` loaded for the block (AdapterRefused if it cannot be)."""
        entry = await self.lookup(engine_name)
        await self._acquire(entry)
        try:
            yield entry
        finally:
            self._release(entry.engine_name)

    async def _acquire(self, entry: AdapterEntry) -> None:
        name = entry.engine_name
        deadline = self._clock() + self._slot_wait_s
        while True:
            res = self._resident.get(name)
            if res is not None:
                if res.retired:
                    raise AdapterRefused(grpc.StatusCode.NOT_FOUND, f"adapter {entry.name!r} was unloaded")
                res.in_use += 1
                self._resident.move_to_end(name)
                return
            load = self._loading.get(name)
            if load is None:
                self._check_not_failed(entry)
                load = self._start_load(entry)
            if load is not None:
                await self._await_load(load)
                return
            # Every slot runs requests: wait for one to free.
            changed = self._changed
            left_s = deadline - self._clock()
            if left_s <= 0:
                raise AdapterRefused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"all {self.max_adapters} adapter slots of this worker are in use by running requests",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left_s)

    def _check_not_failed(self, entry: AdapterEntry) -> None:
        failed = self._failed.get(entry.engine_name)
        if failed is not None and self._clock() < failed[0]:
            raise AdapterRefused(grpc.StatusCode.FAILED_PRECONDITION, failed[1])

    def _start_load(self, entry: AdapterEntry) -> _Load | None:
        """A load of ``entry`` into a free slot or the LRU idle one's; None if every slot is busy."""
        victim: _Resident | None = None
        if len(self._resident) + len(self._loading) >= self.max_adapters:
            victim = next((r for r in self._resident.values() if r.in_use == 0), None)
            if victim is None:
                return None
            del self._resident[victim.entry.engine_name]
            self.num_evictions += 1
        load = _Load(entry, asyncio.get_running_loop().create_future())
        self._loading[entry.engine_name] = load
        self._spawn(self._load(load, victim.entry if victim is not None else None))
        return load

    async def _load(self, load: _Load, victim: AdapterEntry | None) -> None:
        entry = load.entry
        try:
            async with self._engine_ops:
                if victim is not None:
                    await self._remove_from_engine(victim)
                await self._engine.add_adapter(entry)
        except BaseException as exc:
            message = f"adapter {entry.name!r} failed to load on this worker"
            logger.error("%s: %s: %s", message, type(exc).__name__, exc, extra={"adapter": entry.engine_name})
            self._failed[entry.engine_name] = (self._clock() + self._failure_memory_s, message)
            self.num_load_failures += 1
            del self._loading[entry.engine_name]
            load.future.set_exception(AdapterRefused(grpc.StatusCode.FAILED_PRECONDITION, message))
            self._notify()
            if not isinstance(exc, Exception):
                raise
            return
        self.num_loads += 1
        del self._loading[entry.engine_name]
        current = self._catalog.entries.get(entry.name)
        res = _Resident(entry, in_use=load.claims, retired=current is None or current.version != entry.version)
        self._resident[entry.engine_name] = res
        load.future.set_result(None)
        if res.retired and res.in_use == 0:
            self._remove(entry.engine_name)
        self._notify()

    async def _await_load(self, load: _Load) -> None:
        """Wait for ``load`` with a claim on its slot (counted in once it loads)."""
        load.claims += 1
        try:
            await asyncio.shield(load.future)
        except asyncio.CancelledError:
            if load.future.done() and not load.future.cancelled() and load.future.exception() is None:
                self._release(load.entry.engine_name)  # loaded with our claim in it
            else:
                load.claims -= 1
            raise
        # A load that failed raised AdapterRefused above: its claims went with it.

    def _release(self, engine_name: str) -> None:
        res = self._resident.get(engine_name)
        if res is None:
            return
        res.in_use -= 1
        if res.in_use == 0 and res.retired:
            self._remove(engine_name)
        self._notify()

    def _remove(self, engine_name: str) -> None:
        """Take a retired, idle adapter out of the table now and out of the engine in a task."""
        res = self._resident.pop(engine_name)
        self._spawn(self._remove_task(res.entry))
        self._notify()

    async def _remove_task(self, entry: AdapterEntry) -> None:
        async with self._engine_ops:
            await self._remove_from_engine(entry)

    async def _remove_from_engine(self, entry: AdapterEntry) -> None:
        try:
            await self._engine.remove_adapter(entry)
        except Exception:  # the engine may keep it in its CPU cache: its own LRU evicts it on the next load
            logger.exception("removing adapter %s from the engine failed", entry.engine_name)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Wait for the engine calls in flight (the worker is stopping)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
