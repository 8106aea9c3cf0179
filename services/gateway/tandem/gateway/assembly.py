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

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.common.errors import InvalidRequestError
from tandem.gateway.errors import PermissionDeniedError
from tandem.gateway.prompt import ChatPrompt, PromptTokenizer, chat_prompt

#: A chat turn as the chat template reads it: role and content (text), and for tool calling an assistant's
#: ``tool_calls`` or a tool turn's ``tool_call_id``.
Message = Mapping[str, Any]
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
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> AssembledPrompt:
    """``tools``: the request's tools in OpenAI's shape, for the template (their tokens count as the prompt's)."""
    system = system_block(rules, client_messages)
    head = [system] if system is not None else []
    turns = [*history, *(m for m in client_messages if m["role"] not in SYSTEM_ROLES)]
    if not turns:
        raise InvalidRequestError("messages: at least one non-system message is needed.", param="messages")
    reserve = requested_max_tokens if requested_max_tokens is not None else default_max_tokens
    renders: dict[int, ChatPrompt] = {}

    async def render_without(num_dropped: int) -> ChatPrompt:
        if num_dropped not in renders:
            renders[num_dropped] = await chat_prompt(tokenizer, [*head, *turns[num_dropped:]], tools)
        return renders[num_dropped]

    async def fits_without(num_dropped: int) -> bool:
        return len((await render_without(num_dropped)).ids) + reserve <= context_tokens

    num_dropped = 0
    if not await fits_without(0):
        num_dropped = await _fewest_turns_to_drop(
            renders[0], len(head), len(turns), reserve + len(renders[0].ids) - context_tokens, fits_without
        )
    ids = (await render_without(num_dropped)).ids
    max_tokens = fit_max_tokens(
        len(ids),
        requested_max_tokens,
        default_max_tokens=default_max_tokens,
        context_tokens=context_tokens,
        param="messages",
        num_dropped_messages=num_dropped,
    )
    return AssembledPrompt(ids, max_tokens, [*head, *turns[num_dropped:]], num_dropped)


async def _fewest_turns_to_drop(
    full: ChatPrompt,
    num_head_messages: int,
    num_turns: int,
    excess_tokens: int,
    fits_without: Callable[[int], Awaitable[bool]],
) -> int:
    """The fewest oldest turns whose dropping makes the prompt fit (at most all but the last; the
    caller refuses when even that does not fit), in time linear in the conversation.

    The full rendering says where each turn's content begins among its tokens, so dropping ``k``
    turns is priced by reading it, and the estimate is the first ``k`` that saves
    ``excess_tokens``. A template's framing may differ a token or two by role (dropping a user
    turn takes a user header away, while the estimate counted the next turn's), so the estimate is
    confirmed by rendering it and one turn fewer, and a miss is searched from the estimate
    outwards in doubling steps: with ChatML, 3 or 4 renderings for a conversation of any length,
    each linear in it. A template that transforms contents, so that none can be located, gets a
    bisection over all turns (O(log n) renderings)."""
    num_droppable = num_turns - 1
    starts = full.message_token_starts
    first = starts[num_head_messages] if starts is not None else None
    if starts is None or first is None:
        return await _bisect(fits_without, 1, num_droppable) if await fits_without(num_droppable) else num_droppable
    estimate = num_droppable
    for k in range(1, num_droppable + 1):
        start = starts[num_head_messages + k]
        # A turn with empty content has no start of its own: it is priced with the turn after it.
        if start is not None and start - first >= excess_tokens:
            estimate = k
            break
    if await fits_without(estimate):
        fitting, step = estimate, 1  # the answer is at most `fitting`; look below it
        while fitting > 1:
            below = max(1, fitting - step)
            if not await fits_without(below):
                return await _bisect(fits_without, below + 1, fitting)
            fitting, step = below, step * 2
        return fitting
    short, step = estimate, 1  # dropping `short` turns is not enough; look above it
    while short < num_droppable:
        above = min(num_droppable, short + step)
        if await fits_without(above):
            return await _bisect(fits_without, short + 1, above)
        short, step = above, step * 2
    return num_droppable


async def _bisect(fits_without: Callable[[int], Awaitable[bool]], low: int, high: int) -> int:
    """The smallest count in [low, high] that fits, where ``high`` fits and ``low - 1`` does not."""
    while low < high:
        middle = (low + high) // 2
        if await fits_without(middle):
            high = middle
        else:
            low = middle + 1
    return high


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
