"""Prompt assembly for chat requests: the tenant's trusted system prompt, the
client's system text (if the tenant allows it), the stored conversation, then
the new messages, in that order, and trimmed to the context window.

Called by the chat handler; calls the :class:`~tandem.gateway.prompt.PromptTokenizer`
(the model's chat template and tokenizer, off the event loop). The order is
static → variable on purpose: the system block is the same on every request of
a tenant, so the engines' prefix cache serves it (the seed measured 10.7 s →
~2 s TTFT from ordering alone). Budget: the prompt must leave ``max_tokens``
(the client's, else the default) free; the oldest turns are dropped first, and
the last message is never dropped. When even that cannot fit: 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.common.errors import InvalidRequestError
from tandem.gateway.errors import PermissionDeniedError
from tandem.gateway.prompt import PromptTokenizer, chat_prompt_ids

Message = dict[str, str]
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class AssembledPrompt:
    prompt_ids: list[int]
    max_tokens: int
    #: The messages that went into the chat template, system block first.
    messages: list[Message]
    num_dropped_messages: int


@dataclass(frozen=True)
class PromptRules:
    """The tenant's part of the assembly."""

    system_prompt: str = ""
    allow_client_system_prompt: bool = True


def system_block(rules: PromptRules, client_messages: Sequence[Message]) -> Message | None:
    client_system = [m["content"] for m in client_messages if m["role"] in SYSTEM_ROLES and m["content"]]
    if client_system and not rules.allow_client_system_prompt:
        raise PermissionDeniedError(
            "This API key may not send system or developer messages.",
            code="system_message_not_allowed",
            param="messages",
        )
    parts = [p for p in (rules.system_prompt, *client_system) if p]
    return {"role": "system", "content": "\n\n".join(parts)} if parts else None


async def assemble_chat(
    tokenizer: PromptTokenizer,
    *,
    rules: PromptRules,
    history: Sequence[Message],
    client_messages: Sequence[Message],
    requested_max_tokens: int | None,
    default_max_tokens: int,
    context_tokens: int,
) -> AssembledPrompt:
    system = system_block(rules, client_messages)
    head = [system] if system is not None else []
    turns = [*history, *(m for m in client_messages if m["role"] not in SYSTEM_ROLES)]
    if not turns:
        raise InvalidRequestError("messages: at least one non-system message is needed.", param="messages")
    reserve = requested_max_tokens if requested_max_tokens is not None else default_max_tokens
    num_droppable = len(turns) - 1
    cache: dict[int, list[int]] = {}

    async def ids_without(num_dropped: int) -> list[int]:
        if num_dropped not in cache:
            cache[num_dropped] = await chat_prompt_ids(tokenizer, [*head, *turns[num_dropped:]])
        return cache[num_dropped]

    def fits(ids: list[int]) -> bool:
        return len(ids) + reserve <= context_tokens

    num_dropped = 0
    if not fits(await ids_without(0)):
        if not fits(await ids_without(num_droppable)):
            num_dropped = num_droppable
        else:
            low, high = 1, num_droppable  # the smallest number of dropped turns that fits lies in [low, high]
            while low < high:
                middle = (low + high) // 2
                if fits(await ids_without(middle)):
                    high = middle
                else:
                    low = middle + 1
            num_dropped = low
    ids = await ids_without(num_dropped)
    max_tokens = fit_max_tokens(
        len(ids),
        requested_max_tokens,
        default_max_tokens=default_max_tokens,
        context_tokens=context_tokens,
        param="messages",
        num_dropped_messages=num_dropped,
    )
    return AssembledPrompt(ids, max_tokens, [*head, *turns[num_dropped:]], num_dropped)


def fit_max_tokens(
    num_prompt_tokens: int,
    requested_max_tokens: int | None,
    *,
    default_max_tokens: int,
    context_tokens: int,
    param: str,
    num_dropped_messages: int = 0,
) -> int:
    """The completion's ``max_tokens`` once the prompt is in the context window: the client's when it fits,
    else the default capped by what is left. 400 ``context_length_exceeded`` when it cannot fit. The one
    context check of both endpoints (``param`` is ``messages`` for chat, ``prompt`` for completions)."""
    remaining = context_tokens - num_prompt_tokens
    if remaining >= 1 and (requested_max_tokens is None or requested_max_tokens <= remaining):
        return requested_max_tokens if requested_max_tokens is not None else min(default_max_tokens, remaining)
    asked = requested_max_tokens or 1
    dropped = f" after dropping {num_dropped_messages} earlier messages" if param == "messages" else ""
    raise InvalidRequestError(
        f"This model's maximum context length is {context_tokens} tokens. However, you requested "
        f"{num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the {param}, {asked} in the completion)"
        f"{dropped}. Please reduce the length of the {param} or completion.",
        param=param,
        code="context_length_exceeded",
    )
