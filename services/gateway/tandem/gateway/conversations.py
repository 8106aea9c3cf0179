"""Conversations stored server-side, so a client may send only the new message.

Called by the chat handler: :meth:`ConversationStore.history` before the
prompt is assembled, :meth:`ConversationStore.append` after an answer finished
(an aborted answer is not stored; the next turn simply repeats the question).
Keys are per tenant (``<prefix>:gw:conv:<tenant>:<conversation id>``, a list
of JSON messages with a TTL), so one tenant can never read another's turns
even with the same conversation id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import redis.asyncio as aioredis

from tandem.common.errors import InvalidRequestError
from tandem.gateway.redis_client import redis_errors

CONVERSATION_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
Message = dict[str, str]


def check_conversation_id(conversation_id: str) -> None:
    if not CONVERSATION_ID_PATTERN.match(conversation_id):
        raise InvalidRequestError(
            "conversation_id: use 1-128 characters of A-Z a-z 0-9 _ . : -",
            param="conversation_id",
            code="invalid_value",
        )


class ConversationStore:
    def __init__(self, client: aioredis.Redis, *, key_prefix: str, ttl_s: int, max_messages: int) -> None:
        self._redis = client
        self._p = f"{key_prefix}:gw:conv"
        self._ttl_s = ttl_s
        self._max_messages = max_messages

    def _key(self, tenant_id: str, conversation_id: str) -> str:
        return f"{self._p}:{tenant_id}:{conversation_id}"

    async def history(self, tenant_id: str, conversation_id: str) -> list[Message]:
        with redis_errors("conversation read"):
            raws = await self._redis.lrange(self._key(tenant_id, conversation_id), 0, -1)
        return [json.loads(raw) for raw in raws]

    async def append(
        self, tenant_id: str, conversation_id: str, messages: Sequence[Message], *, num_dropped_history: int = 0
    ) -> None:
        """Add ``messages`` (the turns that made it into the prompt, and the answer) and forget the
        ``num_dropped_history`` oldest stored turns, which no longer fit the context: the conversation
        keeps only what can go into a prompt."""
        if not messages:
            return
        key = self._key(tenant_id, conversation_id)
        with redis_errors("conversation write"):
            async with self._redis.pipeline(transaction=True) as pipe:
                if num_dropped_history > 0:
                    pipe.ltrim(key, num_dropped_history, -1)
                pipe.rpush(key, *[json.dumps(m, ensure_ascii=False) for m in messages])
                pipe.ltrim(key, -self._max_messages, -1)
                pipe.expire(key, self._ttl_s)
                await pipe.execute()
