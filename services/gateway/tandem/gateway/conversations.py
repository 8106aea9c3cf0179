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
``<prefix>:gw:conv:<tenant>``, conversation id → last turn, ms of Redis's
clock — no conversation key can be that name, since theirs go on with
``:<id>``); and the tenant's stored bytes stay within its storage quota
(:mod:`tandem.gateway.storage_quota`, item ``conv:<id>`` of its account),
kept exactly by the scripts below, the only writers of these keys.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from tandem.common.errors import InvalidRequestError
from tandem.gateway.redis_client import redis_errors
from tandem.gateway.storage_quota import (
    ACCOUNT_LUA,
    DEFAULT_MAX_STORED_BYTES,
    ENTRY_OVERHEAD_BYTES,
    ITEM_OVERHEAD_BYTES,
    account_key,
)
from tandem.gateway.tenancy.store import tenant_record_key, tenant_salt_guard_lua

logger = logging.getLogger(__name__)

CONVERSATION_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
#: Starts the ids of stored responses, which are conversations too (not to be named by a chat request).
RESPONSE_ID_PREFIX = "resp_"
Message = dict[str, str]
#: The answer's share of a conversation, estimated before it is generated: bytes per token of its
#: ``max_tokens`` (~4 for English text with BPE tokenizers; an answer longer than that is still kept
#: within the tenant's limit by the append, which forgets the conversation's oldest turns instead).
ANSWER_BYTES_PER_TOKEN = 4


def check_conversation_id(conversation_id: str) -> None:
    if not CONVERSATION_ID_PATTERN.fullmatch(conversation_id):
        raise InvalidRequestError(
            "conversation_id: use 1-128 characters of A-Z a-z 0-9 _ . : -",
            param="conversation_id",
            code="invalid_value",
        )
    if conversation_id.startswith(RESPONSE_ID_PREFIX):
        # Stored responses are conversations under their response ids (tandem.gateway.api.response_chains):
        # a chat turn appended to one would make it unreadable as a response.
        raise InvalidRequestError(
            f"conversation_id: ids starting with {RESPONSE_ID_PREFIX!r} name stored responses; continue one "
            "with previous_response_id on /v1/responses.",
            param="conversation_id",
            code="invalid_value",
        )


#: Lua functions of the conversation scripts: ``now_ms()`` (Redis's clock: the index's times and the keys'
#: expiry must come from the same clock, or the account would miss or double a conversation that expired),
#: ``conversation_bytes(key)`` (what a conversation counts in the tenant's storage account), ``evict(id)``
#: (deletes a conversation, and a stored response's stream events with it (tandem.gateway.api.response_events),
#: and takes them out of the index and the account; returns the new total) and
#: ``forget_expired(cutoff_ms)`` (the conversations whose last turn is older: their keys expired by their
#: TTL, which runs no script, so the account learns it here, at the next write or read of the tenant's
#: account). They use the locals ``index``, ``account`` and ``conv_prefix`` (the tenant's conversation
#: key prefix), which the script sets first. A conversation's bytes are recounted from its list at each
#: write rather than kept as deltas: it holds at most ``max_messages`` turns that fit one prompt (a few
#: hundred KB at worst, copied in microseconds next to a generation's hundreds of ms), and a recount
#: also heals the figure of a key deleted behind the scripts' back.
_CONVERSATION_LUA = (
    ACCOUNT_LUA
    + f"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function conversation_bytes(key)
  local turns = redis.call('LRANGE', key, 0, -1)
  if #turns == 0 then
    return 0
  end
  local n = {ITEM_OVERHEAD_BYTES}
  for _, turn in ipairs(turns) do
    n = n + #turn + {ENTRY_OVERHEAD_BYTES}
  end
  return n
end
local function evict(id)
  redis.call('DEL', conv_prefix .. id, conv_prefix .. id .. ':events')
  redis.call('ZREM', index, id)
  stored_set(account, 'events:' .. id, 0)
  return stored_set(account, 'conv:' .. id, 0)
end
local function forget_expired(cutoff_ms)
  local expired = redis.call('ZRANGEBYSCORE', index, '-inf', '(' .. cutoff_ms)
  for _, id in ipairs(expired) do
    evict(id)
  end
  return #expired
end
"""
)

#: Appends a turn and applies every bound, atomically. KEYS: the conversation, the tenant's index, the
#: tenant's storage account. ARGV: stored turns to forget first, max messages, TTL (s), the tenant's
#: storage limit (bytes), conversation id, max conversations, the tenant's conversation key prefix, the
#: tenant's salt, the tenant's record ('' for no check; an ARGV, not a KEY: a script's KEYS need write
#: rights, and the gateway's Redis user may only read tenant records, see tandem.common.redis_acl), then
#: the messages. Deletes the evicted conversations' keys, which are built here (one Redis, not a
#: cluster: fine). A tenant deleted (or created again) since the request was admitted gets nothing.
#: Returns {conversations evicted, own oldest turns forgotten for the storage limit, total bytes}.
#:
#: Room is made in this order: expired conversations leave the account; over the count cap, and then
#: over the byte limit, the least recently used other conversations are deleted; if this conversation
#: alone is still over the limit (an answer longer than the preparation's estimate, or two requests on
#: one conversation at once), its own oldest turns go, whole exchanges (what is kept starts with a user
#: turn). The account never ends above the limit.
_APPEND_BODY = (
    """local key, index, account = KEYS[1], KEYS[2], KEYS[3]
local conv_prefix = ARGV[7]
"""
    + _CONVERSATION_LUA
    + """local ttl_s, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local id = ARGV[5]
local now = now_ms()
forget_expired(now - ttl_s * 1000)
if tonumber(ARGV[1]) > 0 then
  redis.call('LTRIM', key, ARGV[1], -1)
end
redis.call('RPUSH', key, unpack(ARGV, 10))
redis.call('LTRIM', key, -tonumber(ARGV[2]), -1)
redis.call('ZADD', index, now, id)
local num_evicted = 0
local over = redis.call('ZCARD', index) - tonumber(ARGV[6])
if over > 0 then
  -- one more than needed: this conversation may be among them (another's last turn in the same ms)
  for _, old in ipairs(redis.call('ZRANGE', index, 0, over)) do
    if over > 0 and old ~= id then
      evict(old)
      over = over - 1
      num_evicted = num_evicted + 1
    end
  end
end
local item = 'conv:' .. id
local total = stored_set(account, item, conversation_bytes(key))
while total > limit do
  local oldest = redis.call('ZRANGE', index, 0, 0)[1]
  if oldest == nil or oldest == id then
    break
  end
  total = evict(oldest)
  num_evicted = num_evicted + 1
end
local num_forgotten = 0
while total > limit and redis.call('LPOP', key) do
  num_forgotten = num_forgotten + 1
  total = stored_set(account, item, conversation_bytes(key))
end
-- whole exchanges: what is kept starts with a user turn (never an answer, a function call's output or an
-- assistant's call without its question)
while num_forgotten > 0 and redis.call('LLEN', key) > 0 and cjson.decode(redis.call('LINDEX', key, 0)).role ~= 'user' do
  redis.call('LPOP', key)
  num_forgotten = num_forgotten + 1
  total = stored_set(account, item, conversation_bytes(key))
end
if redis.call('EXISTS', key) == 0 then  -- nothing of it fits (only a limit below one turn does that)
  redis.call('ZREM', index, id)
end
redis.call('EXPIRE', key, ttl_s)
redis.call('EXPIRE', index, ttl_s)
stored_keep(account, ttl_s)
return {num_evicted, num_forgotten, total}
"""
)
_APPEND = "#!lua\n" + tenant_salt_guard_lua(key="ARGV[9]", salt="ARGV[8]", refused="-1") + _APPEND_BODY

#: The statuses of a background response still being generated (tandem.gateway.api.background_responses).
ACTIVE_STATUSES = ("queued", "in_progress")
#: The append, replacing the conversation's last turn, only while that turn is a stored response whose
#: status is one of :data:`ACTIVE_STATUSES` (else -2, nothing written): a background response's record is
#: moved on by whoever gets there first (its generating gateway: in progress, then its answer; a cancel on
#: any replica; a reader past the generating gateway's lease: failed), and never out of a final status.
_REPLACE_ACTIVE = (
    "#!lua\n"
    + tenant_salt_guard_lua(key="ARGV[9]", salt="ARGV[8]", refused="-1")
    + """local last = redis.call('LINDEX', KEYS[1], -1)
if not last then
  return -2
end
local record = cjson.decode(last)['response']
local status = type(record) == 'table' and record['status'] or nil
if status ~= '"""
    + ACTIVE_STATUSES[0]
    + """' and status ~= '"""
    + ACTIVE_STATUSES[1]
    + """' then
  return -2
end
redis.call('RPOP', KEYS[1])
"""
    + _APPEND_BODY
)

#: Forgets the tenant's expired conversations and reads its account. KEYS: the tenant's index, its
#: account. ARGV: TTL (s), the tenant's conversation key prefix. Returns {total bytes, conversations}.
#: ``allow-oom``: it only deletes, and an admin must be able to look at a full Redis.
_SETTLE = (
    "#!lua flags=allow-oom\n"
    + """local index, account = KEYS[1], KEYS[2]
local conv_prefix = ARGV[2]
"""
    + _CONVERSATION_LUA
    + """forget_expired(now_ms() - tonumber(ARGV[1]) * 1000)
return {stored_total(account), redis.call('ZCARD', index)}
"""
)

#: Deletes one conversation and takes it out of the index and the account. KEYS: the tenant's index, its
#: account. ARGV: the conversation id, the tenant's conversation key prefix. Returns 1 if it existed.
_DELETE = (
    "#!lua flags=allow-oom\n"
    + """local index, account = KEYS[1], KEYS[2]
local conv_prefix = ARGV[2]
"""
    + _CONVERSATION_LUA
    + """local existed = redis.call('EXISTS', conv_prefix .. ARGV[1])
evict(ARGV[1])
return existed
"""
)


@dataclass(frozen=True)
class StoredConversation:
    """A conversation as read before a request: its turns, and what each counts in the storage account."""

    messages: list[Message]
    turn_bytes: tuple[int, ...]


@dataclass(frozen=True)
class AppendResult:
    #: Other conversations deleted to stay within the count cap and the tenant's storage limit.
    num_evicted: int = 0
    #: This conversation's own oldest turns forgotten because it alone was over the storage limit.
    num_forgotten_turns: int = 0
    #: The tenant's stored bytes afterwards (its storage account).
    num_stored_bytes: int = 0


def turn_bytes(raw: str | bytes) -> int:
    """What one stored turn (its JSON) counts in the tenant's storage account."""
    return len(raw.encode() if isinstance(raw, str) else raw) + ENTRY_OVERHEAD_BYTES


def _dumps(message: Message | dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False)


class ConversationStore:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str,
        ttl_s: int,
        max_messages: int,
        max_conversations: int = 1000,
        default_max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES,
    ) -> None:
        self._redis = client
        self._gw = f"{key_prefix}:gw"
        self._p = f"{self._gw}:conv"
        self._ttl_s = ttl_s
        self._max_messages = max_messages
        self._max_conversations = max_conversations
        self._default_max_stored_bytes = default_max_stored_bytes
        self._append: Any = client.register_script(_APPEND)
        self._replace_active: Any = client.register_script(_REPLACE_ACTIVE)
        self._settle: Any = client.register_script(_SETTLE)
        self._delete: Any = client.register_script(_DELETE)
        self._key_prefix = key_prefix

    def _index_key(self, tenant_id: str) -> str:
        return f"{self._p}:{tenant_id}"

    def _key(self, tenant_id: str, conversation_id: str) -> str:
        return f"{self._p}:{tenant_id}:{conversation_id}"

    async def history(self, tenant_id: str, conversation_id: str) -> list[Message]:
        return (await self.read(tenant_id, conversation_id)).messages

    async def read(self, tenant_id: str, conversation_id: str) -> StoredConversation:
        """The conversation's turns and what each counts in the tenant's storage account."""
        with redis_errors("conversation read"):
            raws = await self._redis.lrange(self._key(tenant_id, conversation_id), 0, -1)
        return StoredConversation([json.loads(raw) for raw in raws], tuple(turn_bytes(raw) for raw in raws))

    def bytes_after(
        self, stored: StoredConversation, *, num_dropped_history: int, new_turns: Sequence[Message], max_tokens: int
    ) -> int:
        """About what the conversation will count in the storage account once this request's turns and
        its answer are appended (the answer estimated at :data:`ANSWER_BYTES_PER_TOKEN` per token of
        ``max_tokens``): the preparation refuses a request whose conversation alone would be over the
        tenant's limit, before any token. The append itself counts exactly and keeps the limit."""
        answer = _dumps({"role": "assistant", "content": ""})
        sizes = [
            *stored.turn_bytes[num_dropped_history:],
            *(turn_bytes(_dumps(m)) for m in new_turns),
            turn_bytes(answer) + ANSWER_BYTES_PER_TOKEN * max_tokens,
        ]
        return ITEM_OVERHEAD_BYTES + sum(sizes[-self._max_messages :])

    async def append(
        self,
        tenant_id: str,
        conversation_id: str,
        messages: Sequence[Message],
        *,
        num_dropped_history: int = 0,
        tenant_salt: str = "",
        max_stored_bytes: int | None = None,
    ) -> AppendResult:
        """Add ``messages`` (the turns that made it into the prompt, and the answer) and forget the
        ``num_dropped_history`` oldest stored turns, which no longer fit the context: the conversation
        keeps only what can go into a prompt. The tenant's stored bytes stay within ``max_stored_bytes``
        (default: the store's): its least recently used other conversations go first, then, if this
        one alone is over, its own oldest turns."""
        result = await self._write(
            tenant_id,
            conversation_id,
            messages,
            num_dropped_history=num_dropped_history,
            tenant_salt=tenant_salt,
            max_stored_bytes=max_stored_bytes,
            replace_active=False,
        )
        assert result is not None
        return result

    async def replace_active(
        self,
        tenant_id: str,
        conversation_id: str,
        turn: Message | dict[str, Any],
        *,
        tenant_salt: str = "",
        max_stored_bytes: int | None = None,
    ) -> AppendResult | None:
        """Replace the last turn with ``turn``, as :meth:`append` writes (the bounds, the account), only
        while that turn is a stored response whose status is in :data:`ACTIVE_STATUSES`; None (nothing
        written) when it is not, or when there is no such conversation."""
        return await self._write(
            tenant_id,
            conversation_id,
            [turn],
            tenant_salt=tenant_salt,
            max_stored_bytes=max_stored_bytes,
            replace_active=True,
        )

    async def _write(
        self,
        tenant_id: str,
        conversation_id: str,
        messages: Sequence[Message | dict[str, Any]],
        *,
        num_dropped_history: int = 0,
        tenant_salt: str = "",
        max_stored_bytes: int | None = None,
        replace_active: bool,
    ) -> AppendResult | None:
        if not messages:
            return AppendResult()
        limit = self._default_max_stored_bytes if max_stored_bytes is None else max_stored_bytes
        args: list[str | int] = [
            num_dropped_history,
            self._max_messages,
            self._ttl_s,
            limit,
            conversation_id,
            self._max_conversations,
            f"{self._p}:{tenant_id}:",
            tenant_salt,
            tenant_record_key(self._key_prefix, tenant_id) if tenant_salt else "",
            *[_dumps(m) for m in messages],
        ]
        keys = [
            self._key(tenant_id, conversation_id),
            self._index_key(tenant_id),
            account_key(self._key_prefix, tenant_id),
        ]
        with redis_errors("conversation write"):
            reply = await (self._replace_active if replace_active else self._append)(keys=keys, args=args)
        if reply == -1:  # the tenant was deleted (or created again) since the request was admitted
            return AppendResult()
        if reply == -2:  # replace_active: the last turn is no longer an active response's
            return None
        result = AppendResult(*(int(x) for x in reply))
        if result.num_forgotten_turns:
            logger.warning(
                "conversation over the tenant's storage quota: its oldest turns forgotten",
                extra={"tenant": tenant_id, "num_forgotten_turns": result.num_forgotten_turns, "limit_bytes": limit},
            )
        return result

    async def stored(self, tenant_id: str) -> tuple[int, int]:
        """(the tenant's stored bytes, its number of conversations), after forgetting the expired ones."""
        keys = [self._index_key(tenant_id), account_key(self._key_prefix, tenant_id)]
        with redis_errors("conversation account"):
            num_bytes, num_conversations = await self._settle(keys=keys, args=[self._ttl_s, f"{self._p}:{tenant_id}:"])
        return int(num_bytes), int(num_conversations)

    async def delete(self, tenant_id: str, conversation_id: str) -> bool:
        """Delete one conversation (its bytes leave the tenant's storage account); False if there was none."""
        keys = [self._index_key(tenant_id), account_key(self._key_prefix, tenant_id)]
        with redis_errors("conversation delete"):
            existed = await self._delete(keys=keys, args=[conversation_id, f"{self._p}:{tenant_id}:"])
        return bool(existed)
