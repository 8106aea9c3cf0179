"""Stored responses of the Responses API (``store: true``) and their chains (``previous_response_id``),
kept in the conversation store (:mod:`tandem.gateway.conversations`): a stored response is a conversation
whose id is the response's id, holding the chain's chat turns up to and including its answer.

Called by :func:`~tandem.gateway.api.prepare.prepare` (:func:`read_response`, :func:`history_of`,
:func:`chain_to_store`), by the ``/v1/responses`` route once an answer is complete and before its last
bytes go out (:func:`answer_turn`, so the response can be read as soon as the client has it), and by the
``GET`` / ``DELETE`` / ``cancel`` routes (:func:`read_response`). Calls the conversation store only.

So a stored response lives where conversations live and under their bounds: in the tenant's namespace
(another tenant's id is 404), counted in the tenant's storage byte budget
(:mod:`tandem.gateway.storage_quota`), with the conversations' TTL after it was written
(``tenancy.conversation_ttl_s``), among the tenant's ``max_conversations_per_tenant`` (least recently
used deleted first), read through any gateway replica and across a gateway restart.

Each response holds its whole chain (the previous response's turns, without the response objects, then
the new input and the answer), so reading a chain is one read and deleting one response leaves the
others whole; the price is bytes: a chain of N turns stores about N²/2 turns in all. ``instructions``
(and system or developer input items, which the prompt merges into its head) are not carried to the
next turn (as OpenAI's API: a client sends them again each turn); the answer's
chat turn is the one the chat template renders in the next prompt, so each turn's prompt is the previous
turn's prompt and answer as a byte-identical prefix, and the router places it where that KV is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.common.errors import InvalidRequestError
from tandem.gateway.conversations import RESPONSE_ID_PREFIX, ConversationStore, StoredConversation

#: The key of an answer turn that holds its response object (read by GET; never shown to the template).
RESPONSE_KEY = "response"
_RESPONSE_ID = re.compile(rf"^{RESPONSE_ID_PREFIX}[A-Za-z0-9]{{1,100}}$")


@dataclass(frozen=True)
class ChainRequest:
    """What a Responses request asks of the store."""

    #: The response whose chain this request continues.
    previous_id: str | None
    #: Keep this response (and its chain) for GET and for the next turn.
    store: bool
    #: The request's ``instructions``, which the response repeats (the chat request holds them only as its first
    #: system message, which a system or developer input item would be too).
    instructions: str | None = None
    #: Answer at once and generate on (tandem.gateway.api.background_responses).
    background: bool = False


#: A dialect's reading of the store fields of its body (the body is already checked by its parser).
ChainParser = Callable[[bytes], ChainRequest]


def not_found(response_id: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(
        f"Response with id {response_id[:120]!r} not found.", param=param, code="response_not_found"
    )


async def read_response(
    store: ConversationStore, tenant_id: str, response_id: str, param: str | None = None
) -> StoredConversation:
    """The stored conversation of a response; 404 ``response_not_found`` when there is none for this tenant
    (``param``: the request field that named it)."""
    if not _RESPONSE_ID.fullmatch(response_id):
        raise not_found(response_id, param)
    stored = await store.read(tenant_id, response_id)
    if not stored.messages or RESPONSE_KEY not in stored.messages[-1]:
        raise not_found(response_id, param)
    return stored


#: The statuses of a stored response that a chain can continue (a background one still generating, cancelled
#: or failed has no answer to continue from).
CONTINUABLE_STATUSES = ("completed", "incomplete")


async def read_chain(store: ConversationStore, tenant_id: str, response_id: str) -> StoredConversation:
    """The stored response ``previous_response_id`` names, which must hold an answer (400 otherwise)."""
    stored = await read_response(store, tenant_id, response_id, "previous_response_id")
    status = response_of(stored).get("status")
    if status not in CONTINUABLE_STATUSES:
        raise InvalidRequestError(
            f"previous_response_id: response {response_id[:120]!r} is {status}; only a completed or incomplete "
            "response can be continued.",
            param="previous_response_id",
            code="invalid_value",
        )
    return stored


def response_of(stored: StoredConversation) -> dict[str, Any]:
    """The response object a stored response's last turn holds."""
    response: dict[str, Any] = stored.messages[-1][RESPONSE_KEY]  # type: ignore[assignment]
    return response


def history_of(stored: StoredConversation) -> list[dict[str, Any]]:
    """The chain's chat turns as the template reads them (without the response objects)."""
    return [{k: v for k, v in turn.items() if k != RESPONSE_KEY} for turn in stored.messages]


def chain_to_store(
    history: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]], num_dropped: int
) -> tuple[dict[str, Any], ...]:
    """The turns the new response keeps before its answer: the history and the new messages that made it
    into the prompt (``num_dropped`` oldest turns were trimmed to fit the context), less the system ones
    (``instructions``, system and developer items), which the prompt puts in its head, not in its turns."""
    new = [dict(m) for m in messages if m["role"] != "system"]
    dropped_history = min(num_dropped, len(history))
    return (*(dict(m) for m in history[dropped_history:]), *new[num_dropped - dropped_history :])


def answer_turn(response: dict[str, Any]) -> dict[str, Any]:
    """The answer's chat turn (as a client would send it back: text, or the function calls) and the
    response object itself."""
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    # An answer to tool_choice "auto" may hold text beside its calls (tandem.gateway.api.responses_auto).
    parts = [p["text"] for item in response["output"] if item["type"] == "message" for p in item["content"]]
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
    if calls:
        turn["tool_calls"] = [
            {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
    turn[RESPONSE_KEY] = response
    return turn
