"""What both roles do with a request before and around the engine: refuse
what cannot run, build the engine's prompt and ``SamplingParams``, count."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.common.adapters import AdapterEntry
from tandem.v1 import common_pb2
from tandem.worker.adapters import AdapterRefused, AdapterResidency
from tandem.worker.engine_api import WorkerEngine
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.sampling import sampling_kwargs, structured_output_spec

Ctx = grpc.aio.ServicerContext[Any, Any]


def engine_refusals() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses (4xx in its own server): the client's fault."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, VLLMClientError)


def engine_deaths() -> tuple[type[Exception], ...]:
    """What vLLM raises into every request in flight when its engine died (the engine-core process exited,
    a step raised, or tandem.worker.liveness shut a stuck engine down)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return (EngineDeadError,)


def engine_failures() -> tuple[type[Exception], ...]:
    """What vLLM raises for one request that failed inside the engine without killing it."""
    from vllm.v1.engine.exceptions import EngineGenerateError

    return (EngineGenerateError,)


#: What a caller is told when the engine died under its request: retry elsewhere (UNAVAILABLE).
ENGINE_DEAD_MESSAGE = "the worker's engine died; place the request on another worker"


@contextlib.asynccontextmanager
async def engine_errors(context: Ctx) -> AsyncIterator[None]:
    """Around a request's run in the engine: what the engine raises, as the caller's gRPC status. A dead
    engine is UNAVAILABLE (the caller places the request on another worker); one request failed inside
    the engine is INTERNAL (vLLM logged its cause; the engine lives on); parameters the engine refuses
    (e.g. a bad grammar) are INVALID_ARGUMENT."""
    try:
        yield
    except engine_deaths():
        await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD_MESSAGE)
    except engine_failures():
        await context.abort(grpc.StatusCode.INTERNAL, "the engine failed the request")
    except engine_refusals() as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"engine refused the request: {exc}")


#: How a decode continued the prefill's first token: ``appended`` (as the last prompt token),
#: ``replayed`` (tandem.worker.first_token), ``local`` (a local prefill: the whole request here),
#: ``resumed`` (a migrated stream: the prompt computed here, the tokens so far replayed).
CONTINUATION_MODES = ("appended", "replayed", "local", "resumed")


@dataclass
class WorkerCounters:
    num_running: int = 0
    num_prompt_tokens_in_flight: int = 0
    num_kv_tokens_in_flight: int = 0
    prompt_tokens_computed: int = 0
    #: Decodes by how they continued (one of CONTINUATION_MODES).
    decodes_by_continuation: Counter[str] = field(default_factory=Counter)
    #: PrefetchKV calls by outcome: ``started`` or ``refused``.
    prefetches_by_outcome: Counter[str] = field(default_factory=Counter)


@dataclass
class Admission:
    """Who may run here: checks every request against the worker's state (its role, a drain, a dead
    engine). What the request holds is checked by tandem.worker.validation, after this."""

    worker_id: str
    role: str
    draining: bool = False
    #: Set once the engine died (tandem.worker.liveness): every call answers UNAVAILABLE from then on.
    engine_dead: bool = False

    async def check_serving(self, context: Ctx) -> None:
        if self.engine_dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD_MESSAGE)

    async def check(self, context: Ctx, role: str) -> None:
        await self.check_serving(context)
        if self.role != role:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"worker {self.worker_id} is a {self.role} worker, not {role}"
            )
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining")


class Role:
    """What a role's handler works with: the engine, the admission rules, the worker's counters, the
    engine's KV layout and the model's sampling defaults."""

    def __init__(
        self,
        engine: WorkerEngine,
        admission: Admission,
        counters: WorkerCounters,
        layout: KVLayout,
        model_defaults: dict[str, Any],
        adapters: AdapterResidency | None = None,
    ) -> None:
        self._engine = engine
        self._admission = admission
        self._counters = counters
        self._layout = layout
        self._model_defaults = model_defaults
        #: LoRA adapters in the engine (None: LoRA off on this worker).
        self._adapters = adapters

    @contextlib.asynccontextmanager
    async def adapter(self, context: Ctx, engine_name: str) -> AsyncIterator[AdapterEntry | None]:
        """The request's adapter, loaded and held for the block (None: the base model); a refusal aborts
        the call with its status (tandem.worker.adapters)."""
        if not engine_name:
            yield None
            return
        if self._adapters is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {self._admission.worker_id} serves no LoRA adapters (adapter {engine_name!r})",
            )
        assert self._adapters is not None
        async with contextlib.AsyncExitStack() as stack:
            try:
                entry = await stack.enter_async_context(self._adapters.use(engine_name))
            except AdapterRefused as exc:
                await context.abort(exc.code, exc.message)
                raise  # unreachable: abort raises
            yield entry


def engine_prompt(token_ids: list[int], cache_salt: str) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if cache_salt:
        prompt["cache_salt"] = cache_salt
    return prompt


async def sampling_params(
    context: Ctx,
    options: common_pb2.SamplingOptions,
    *,
    max_tokens: int,
    model_defaults: dict[str, Any],
    **extra: Any,
) -> Any:
    """vLLM ``SamplingParams`` for ``options``; parameters vLLM refuses abort the call (INVALID_ARGUMENT)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    try:
        structured = structured_output_spec(options)
        return SamplingParams(
            **sampling_kwargs(options, max_tokens=max_tokens, model_defaults=model_defaults),
            structured_outputs=StructuredOutputsParams(**structured) if structured else None,
            **extra,
        )
    except engine_refusals() as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling parameters: {exc}")
        raise  # unreachable: abort raises
