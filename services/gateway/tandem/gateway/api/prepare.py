"""From an HTTP request to a :class:`PreparedRequest`: everything a generation
needs, checked, tokenized and fitted into the context window, before any quota
is charged or any worker is asked.

Called by the generation handler of :mod:`tandem.gateway.api.routes` for both
endpoints; calls, in order: the drain check, authentication, the key's count
of refused requests (:mod:`tandem.gateway.tenancy.rejections`: what this
function refuses for the request's own fault counts against the key), the body reader and validation
(:mod:`validation`), the model and tenant checks (:func:`resolve_model`: a served model, or a
LoRA adapter through the catalog's cache, :mod:`tandem.gateway.adapters`), then the
prompt: for chat, the conversation's history and :func:`assemble_chat`
(tenant system prompt, trimming to the context), then the tenant's storage
quota for what the conversation would hold; for completions, the
tokenizer. The context is fitted in one place (:func:`fit_max_tokens`). Every
failure is a TandemError that the handler turns into an OpenAI error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from starlette.requests import Request

from tandem.common.errors import InvalidRequestError, PermanentError
from tandem.common.ids import new_request_id
from tandem.gateway.adapters import ModelResolver, ResolvedModel
from tandem.gateway.api.errors import ModelNotFoundError, RequestTooLargeError
from tandem.gateway.api.response_chains import ChainParser, ChainRequest, chain_to_store, history_of, read_chain
from tandem.gateway.api.responses_wire import stored_response_bytes
from tandem.gateway.api.services import GatewayServices, ModelLimits, ServedModelServices
from tandem.gateway.api.tools import AUTO_REFUSED, ToolSpec, arguments_text_size, tools_text_size
from tandem.gateway.api.validation import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    check_content_type,
    parse_body,
)
from tandem.gateway.assembly import Message, PromptRules, assemble_chat, fit_max_tokens
from tandem.gateway.conversations import Message as StoredTurn
from tandem.gateway.conversations import StoredConversation, check_conversation_id
from tandem.gateway.errors import PermissionDeniedError, ShuttingDownError
from tandem.gateway.prompt import PromptTokenizer, text_prompt_ids
from tandem.gateway.sampling import SamplingParams
from tandem.gateway.tenancy.auth import Principal, request_authorization
from tandem.gateway.tenancy.models import Tenant, allowed, may_know_missing
from tandem.gateway.tenancy.rejections import counts_against_key
from tandem.gateway.timings import StageClock

Endpoint = Literal["chat", "completions"]
_ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-"}
#: Turns another API's body (Anthropic Messages) into the chat request it means, with every check of
#: validation.parse_body; raises InvalidRequestError.
ChatBodyParser = Callable[[bytes], ChatCompletionRequest]


@dataclass(frozen=True)
class Dialect:
    """A chat API other than OpenAI's, translated into the same prepared chat request."""

    parse: ChatBodyParser
    #: Starts the request id (which is also the answer's id), e.g. ``msg_``.
    request_id_prefix: str
    #: The API stores its answers in chains (the Responses API): what the body asks of the store.
    chain: ChainParser | None = None
    #: The refusal of ``tool_choice`` auto for a model without a tool chat template, in this API's words.
    auto_refused: str = AUTO_REFUSED


@dataclass(frozen=True)
class Conversation:
    """A chat request's server-kept conversation: the turns to append once the answer is complete."""

    id: str
    #: The client's new turns that made it into the prompt (older ones trimmed to fit are not kept).
    new_turns: tuple[StoredTurn, ...]
    #: Stored turns trimmed away to fit the context: the store forgets them too.
    num_dropped_history: int = 0


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready for admission and generation; nothing in it changes afterwards (the stage clock is
    the request's own and goes on marking)."""

    endpoint: Endpoint
    request_id: str
    body: ChatCompletionRequest | CompletionRequest
    principal: Principal
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    clock: StageClock
    #: What ``body.model`` names: the base model that runs it, and the LoRA adapter if it is one.
    model: ResolvedModel
    conversation: Conversation | None = None
    num_dropped_messages: int = 0
    #: A chat request's function tools (tandem.gateway.api.tools); the answer is a tool call when they constrain it.
    tools: ToolSpec | None = None
    #: A Responses request's store fields (tandem.gateway.api.response_chains).
    chain: ChainRequest | None = None
    #: With ``chain.store``: the turns the response keeps before its answer, under its own id.
    stored_chain: Conversation | None = None

    @property
    def tenant(self) -> Tenant:
        return self.principal.tenant


async def prepare(
    request: Request, services: GatewayServices, endpoint: Endpoint, dialect: Dialect | None = None
) -> PreparedRequest:
    """``dialect``: the body is another API's chat request (only with ``endpoint`` "chat")."""
    clock = StageClock()
    if services.drain.draining:
        raise ShuttingDownError("This gateway replica is shutting down; retry.")
    principal = await services.authenticator.authenticate(request_authorization(request.headers))
    clock.mark("authenticated")
    # A key that keeps sending what is refused is refused cheaply, before its body is read
    # (tandem.gateway.tenancy.rejections); what is refused below for the request's own fault counts against it.
    services.rejections.check(principal)
    try:
        return await _prepare(request, services, endpoint, principal, clock, dialect)
    except PermanentError as exc:
        if counts_against_key(exc):
            await services.rejections.count(principal)
        raise


async def _prepare(
    request: Request,
    services: GatewayServices,
    endpoint: Endpoint,
    principal: Principal,
    clock: StageClock,
    dialect: Dialect | None,
) -> PreparedRequest:
    tenant = principal.tenant
    limits = services.limits
    check_content_type(request.headers.get("content-type"))
    raw = await _read_body(request, limits.max_body_bytes)
    body: ChatCompletionRequest | CompletionRequest
    chain = None
    if dialect is not None:
        body = dialect.parse(raw)
        chain = dialect.chain(raw) if dialect.chain is not None else None
    else:
        body = parse_body(raw, ChatCompletionRequest) if endpoint == "chat" else parse_body(raw, CompletionRequest)
    model = await resolve_model(body.model, services.models, tenant)
    # The base model that runs the request: its limits, tokenizer and chat template from here on.
    served = services.for_model(model.base_model)
    limits, tokenizer = served.limits, served.tokenizer
    tools = body.tool_spec() if isinstance(body, ChatCompletionRequest) else None
    chat_tokenizer = _chat_tokenizer(served, tools, dialect)
    if tools is not None and tools.mode == "auto":
        # The answer is read in the format the model's tool chat template asks for.
        tools = replace(tools, call_format=served.tool_call_format)
    if endpoint == "completions" and not tenant.may_send_raw_prompts():
        raise PermissionDeniedError(
            "This API key's tenant has a prompt policy (a system prompt, or no client system messages) that "
            "a raw prompt would skip: use /v1/chat/completions.",
            code="raw_prompts_not_allowed",
            param="prompt",
        )
    # Cheap checks before the expensive ones (rendering the chat template, tokenizing, trimming): the
    # size of the text, then the tenant's stream slot and quota for the fewest tokens it can be.
    num_text_bytes, min_input_tokens = _text_size(body)
    if num_text_bytes > limits.max_prompt_bytes:
        raise InvalidRequestError(
            f"The request's text is {num_text_bytes} bytes; the limit is {limits.max_prompt_bytes} "
            f"(the context holds {limits.max_model_len} tokens).",
            param="messages" if endpoint == "chat" else "prompt",
            code="request_too_large",
        )
    await services.quota.precheck(tenant.id, tenant, min_input_tokens, model=body.model)
    context_tokens = _context_tokens(limits, tenant)
    conversation = stored_chain = None
    num_dropped = 0
    request_id = (dialect.request_id_prefix if dialect else _ID_PREFIX[endpoint]) + new_request_id()
    if isinstance(body, ChatCompletionRequest):
        stored = StoredConversation([], ())
        history: Sequence[Message] = stored.messages
        if body.conversation_id is not None:
            check_conversation_id(body.conversation_id)
            stored = await services.conversations.read(tenant.id, body.conversation_id)
            history = stored.messages
        elif chain is not None and chain.previous_id is not None:
            stored = await read_chain(services.conversations, tenant.id, chain.previous_id)
            history = history_of(stored)
        messages = [_template_message(m) for m in body.messages]
        assembled = await assemble_chat(
            chat_tokenizer,
            rules=PromptRules(tenant.system_prompt, tenant.allow_client_system_prompt),
            history=history,
            client_messages=messages,
            requested_max_tokens=body.requested_max_tokens(),
            default_max_tokens=_default_max_tokens(limits.default_max_tokens, tenant),
            context_tokens=context_tokens,
            tools=tools.template_tools() if tools is not None else None,
        )
        prompt_ids, max_tokens, num_dropped = assembled.prompt_ids, assembled.max_tokens, assembled.num_dropped_messages
        if body.conversation_id is not None:
            # validation refused conversation_id with tools, so these turns are role and text only
            new_turns = tuple({"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system")
            dropped_history = min(num_dropped, len(history))
            conversation = Conversation(
                body.conversation_id, new_turns[num_dropped - dropped_history :], dropped_history
            )
            # Before any token and any charge: a conversation that alone would be over the tenant's
            # storage quota is refused (its other conversations are forgotten to make room at the append).
            num_bytes = services.conversations.bytes_after(
                stored,
                num_dropped_history=dropped_history,
                new_turns=conversation.new_turns,
                max_tokens=max_tokens,
            )
            services.storage_quota.check(
                tenant, num_bytes, what=f"Conversation {body.conversation_id!r}", param="conversation_id"
            )
        if chain is not None and chain.store:
            turns = chain_to_store(history, messages, num_dropped)
            stored_chain = Conversation(request_id, turns)
            num_bytes = services.conversations.bytes_after(
                StoredConversation([], ()), num_dropped_history=0, new_turns=turns, max_tokens=max_tokens
            ) + stored_response_bytes(body, chain, max_tokens)
            services.storage_quota.check(tenant, num_bytes, what="The response's chain", param="store")
    else:
        prompt_ids = await _completion_prompt_ids(tokenizer, body)
        max_tokens = fit_max_tokens(
            len(prompt_ids),
            body.requested_max_tokens(),
            default_max_tokens=_default_max_tokens(limits.default_max_tokens, tenant),
            context_tokens=context_tokens,
            param="prompt",
        )
    _check_prompt_ids(body, prompt_ids, tokenizer.vocab_size)
    if body.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({body.min_tokens}) is more than the {max_tokens} tokens this answer may have.",
            param="min_tokens",
            code="invalid_value",
        )
    clock.mark("prompt_built")
    return PreparedRequest(
        endpoint=endpoint,
        request_id=request_id,
        body=body,
        principal=principal,
        prompt_token_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        sampling=body.sampling_params(),
        clock=clock,
        model=model,
        conversation=conversation,
        num_dropped_messages=num_dropped,
        tools=tools,
        chain=chain,
        stored_chain=stored_chain,
    )


def _chat_tokenizer(served: ServedModelServices, tools: ToolSpec | None, dialect: Dialect | None) -> PromptTokenizer:
    """The tokenizer whose chat template renders the request: the model's tool chat template when the request
    leaves the tool choice to the model (``auto``), which only it can present; the model's own otherwise."""
    if tools is None or tools.mode != "auto":
        return served.tokenizer
    if served.tool_tokenizer is None:
        message = dialect.auto_refused if dialect is not None else AUTO_REFUSED
        raise InvalidRequestError(message, param="tool_choice", code="unsupported_value")
    return served.tool_tokenizer


#: No token of any tokenizer Tandem serves is longer than this many bytes of text.
MAX_BYTES_PER_TOKEN = 64


def _text_size(body: ChatCompletionRequest | CompletionRequest) -> tuple[int, int]:
    """(bytes of text, the fewest prompt tokens that text can make), without tokenizing."""
    if isinstance(body, ChatCompletionRequest):
        num_bytes = sum(len(m.text().encode()) + arguments_text_size(m.tool_calls) for m in body.messages)
        num_bytes += tools_text_size(body.tool_spec())
        return num_bytes, num_bytes // MAX_BYTES_PER_TOKEN
    prompt = body.prompt
    if isinstance(prompt, str):
        num_bytes = len(prompt.encode())
        return num_bytes, num_bytes // MAX_BYTES_PER_TOKEN
    if prompt and isinstance(prompt[0], int):  # token ids: exactly as many tokens
        return len(prompt) * 4, len(prompt)
    num_bytes = sum(len(str(p).encode()) for p in prompt)
    return num_bytes, num_bytes // MAX_BYTES_PER_TOKEN


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A client message as the chat template reads it (vLLM's shape: content is text, never null)."""
    turn: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.tool_calls:
        turn["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _check_prompt_ids(body: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], vocab_size: int) -> None:
    """A raw prompt's token ids must name tokens of this model, as vLLM's own server checks (a worker
    refuses them too, after a round trip; stop_token_ids and logit_bias are left to the worker, which
    checks them against the model's logits)."""
    if isinstance(body, CompletionRequest) and max(prompt_ids) >= vocab_size:
        raise InvalidRequestError(
            f"prompt holds a token id beyond this model's vocabulary ({vocab_size} tokens).",
            param="prompt",
            code="invalid_value",
        )


def _default_max_tokens(default: int, tenant: Tenant) -> int:
    """The answer length reserved when the client sets none: never more than the tenant's output tokens
    per minute (a larger reservation could never be admitted, and the tenant would get 429 forever)."""
    cap = tenant.output_tokens_per_minute
    return default if cap is None else max(1, min(default, cap))


async def _completion_prompt_ids(tokenizer: PromptTokenizer, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, str):
        ids = await text_prompt_ids(tokenizer, prompt)
    elif prompt and isinstance(prompt[0], str):
        ids = await text_prompt_ids(tokenizer, str(prompt[0]))
    else:
        ids = [int(i) for i in prompt]
    if not ids:
        raise InvalidRequestError("The prompt is empty.", param="prompt", code="invalid_value")
    return ids


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    too_large = RequestTooLargeError(f"Request body is larger than {max_body_bytes} bytes.")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_body_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def resolve_model(model: str, models: ModelResolver, tenant: Tenant | None = None) -> ResolvedModel:
    """What ``model`` names (a served model or a loaded LoRA adapter); 404 ``model_not_found`` for
    anything else, 403 ``model_not_allowed`` for one the tenant may not use, and for a name that names
    nothing when a 404 would tell the tenant which adapter names others have (tenancy.models)."""
    not_allowed = PermissionDeniedError(
        f"This API key may not use the model `{model}`.", code="model_not_allowed", param="model"
    )
    resolved = await models.resolve(model)
    if resolved is None:
        if tenant is not None and not may_know_missing(tenant, model):
            raise not_allowed
        raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model", code="model_not_found")
    if tenant is not None and not may_use(tenant, resolved):
        raise not_allowed
    return resolved


def may_use(tenant: Tenant, model: ResolvedModel) -> bool:
    """Whether the tenant's allow-lists admit this model or adapter (tenancy.models.allowed)."""
    return allowed(tenant, model.requested, model.base_model)


def _context_tokens(limits: ModelLimits, tenant: Tenant) -> int:
    if tenant.max_context_tokens is None:
        return limits.max_model_len
    return min(limits.max_model_len, tenant.max_context_tokens)
