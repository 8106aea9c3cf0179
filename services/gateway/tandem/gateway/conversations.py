"""Conversations stored server-side, so a client may send only the new message.

Called by the chat handler: :meth:`ConversationStore.history` before the
prompt is assembled, :meth:`ConversationStore.append` after an answer finished
(an aborted answer is not stored; the next turn simply repeats the question).
Keys are per tenant (``<prefix>:gw:conv:<tenant>:<conversation id>``, a list
of JSON messages with a TTL), so one tenant can never read another's turns
even with the same conversation id.

Bounds (docs/tenancy.md, "Retention"): a conversation holds only turns that
still fit a prompt, at most ``max_messages`` of them, and lives ``ttl_s`` after
its last turn; a tenant keeps at most ``max_conversations`` conversations, the
ones least recently used are deleted first (index: the sorted set
``<prefix>:gw:conv:<tenant>``, conversation id → last turn, ms — no
conversation key can be that name, since theirs go on with ``:<id>``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from tandem.common.errors import InvalidRequestError
from tandem.gateway.redis_client import redis_errors
from tandem.gateway.tenancy.store import tenant_record_key, tenant_salt_guard_lua

CONVERSATION_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
Message = dict[str, str]


def check_conversation_id(conversation_id: str) -> None:
    if not CONVERSATION_ID_PATTERN.match(conversation_id):
        raise InvalidRequestError(
            "conversation_id: use 1-128 characters of A-Z a-z 0-9 _ . : -",
            param="conversation_id",
            code="invalid_value",
        )


#: Appends a turn and applies every bound, atomically. KEYS: the conversation, the tenant's index. ARGV:
#: stored turns to forget first, max messages, TTL (s), now (ms), conversation id, max conversations, the
#: tenant's conversation key prefix, the tenant's salt, the tenant's record ('' for no check; an ARGV, not
#: a KEY: a script's KEYS need write rights, and the gateway's Redis user may only read tenant records,
#: see tandem.common.redis_acl), then the messages. Deletes the evicted conversations' keys, which are
#: built here (one Redis, not a cluster: fine). A tenant deleted (or created again) since the request was
#: admitted gets nothing.
_APPEND = (
    "#!lua\n"
    + tenant_salt_guard_lua(key="ARGV[9]", salt="ARGV[8]", refused="-1")
    + """local key, index = KEYS[1], KEYS[2]
local ttl_s, now_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
if tonumber(ARGV[1]) > 0 then
  redis.call('LTRIM', key, ARGV[1], -1)
end
redis.call('RPUSH', key, unpack(ARGV, 10))
redis.call('LTRIM', key, -tonumber(ARGV[2]), -1)
redis.call('EXPIRE', key, ttl_s)
redis.call('ZADD', index, now_ms, ARGV[5])
redis.call('ZREMRANGEBYSCORE', index, '-inf', now_ms - ttl_s * 1000)
local over = redis.call('ZCARD', index) - tonumber(ARGV[6])
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', index, 0, over - 1)) do
    redis.call('DEL', ARGV[7] .. id)
  end
  redis.call('ZREMRANGEBYRANK', index, 0, over - 1)
end
redis.call('EXPIRE', index, ttl_s)
return over > 0 and over or 0
"""
)


class ConversationStore:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str,
        ttl_s: int,
        max_messages: int,
        max_conversations: int = 1000,
    ) -> None:
        self._redis = client
        self._gw = f"{key_prefix}:gw"
        self._p = f"{self._gw}:conv"
        self._ttl_s = ttl_s
        self._max_messages = max_messages
        self._max_conversations = max_conversations
        self._append: Any = client.register_script(_APPEND)
        self._key_prefix = key_prefix

    def _index_key(self, tenant_id: str) -> str:
        return f"{self._p}:{tenant_id}"

    def _key(self, tenant_id: str, conversation_id: str) -> str:
        return f"{self._p}:{tenant_id}:{conversation_id}"

    async def history(self, tenant_id: str, conversation_id: str) -> list[Message]:
        with redis_errors("conversation read"):
            raws = await self._redis.lrange(self._key(tenant_id, conversation_id), 0, -1)
        return [json.loads(raw) for raw in raws]

    async def append(
        self,
        tenant_id: str,
        conversation_id: str,
        messages: Sequence[Message],
        *,
        num_dropped_history: int = 0,
        tenant_salt: str = "",
    ) -> None:
        """Add ``messages`` (the turns that made it into the prompt, and the answer) and forget the
        ``num_dropped_history`` oldest stored turns, which no longer fit the context: the conversation
        keeps only what can go into a prompt."""
        if not messages:
            return
        args: list[str | int] = [
            num_dropped_history,
            self._max_messages,
            self._ttl_s,
            int(time.time() * 1000),
            conversation_id,
            self._max_conversations,
            f"{self._p}:{tenant_id}:",
            tenant_salt,
            tenant_record_key(self._key_prefix, tenant_id) if tenant_salt else "",
            *[json.dumps(m, ensure_ascii=False) for m in messages],
        ]
        keys = [self._key(tenant_id, conversation_id), self._index_key(tenant_id)]
        with redis_errors("conversation write"):
            await self._append(keys=keys, args=args)
