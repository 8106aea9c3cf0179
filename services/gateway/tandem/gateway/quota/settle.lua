#!lua flags=allow-oom
-- Reconciliation of one admitted request: give back the part of the output reservation that was not
-- generated (and, for a request that failed before its first token, its input charge too), and free
-- its concurrency slot. Called by RedisQuota.settle (also after disconnects).
--
-- KEYS[1] output bucket   KEYS[2] streams zset   KEYS[3] the request's admission marker   KEYS[4] input bucket
-- ARGV[1] output capacity per minute (-1: unlimited)   ARGV[2] output tokens to refund   ARGV[3] request id
-- ARGV[4] input capacity per minute (-1: unlimited)    ARGV[5] input tokens to refund
-- Refunds once: a retried settle, or one after the marker's lease ran out, only frees the slot.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREM', KEYS[2], ARGV[3])
if redis.call('DEL', KEYS[3]) == 0 then return 0 end

local function refill(key, cap, refund)
  if cap < 0 or refund <= 0 then return end
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return end  -- expired: the bucket is full anyway
  tokens = math.min(cap, tokens + math.max(0, now - ts) * cap / 60000 + refund)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', now)
  redis.call('PEXPIRE', key, 120000)
end

refill(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
refill(KEYS[4], tonumber(ARGV[4]), tonumber(ARGV[5]))
return 1
