-- Reconciliation of one admitted request: give back the part of the output reservation that was not
-- generated, and free its concurrency slot. Called by RedisQuota.settle (also after disconnects).
--
-- KEYS[1] output bucket   KEYS[2] streams zset   KEYS[3] the request's admission marker
-- ARGV[1] output capacity per minute (-1: unlimited)   ARGV[2] tokens to refund   ARGV[3] request id
-- Refunds once: a retried settle, or one after the marker's lease ran out, only frees the slot.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap, refund = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[3])
if redis.call('DEL', KEYS[3]) == 0 then return 0 end
if cap < 0 or refund <= 0 then return 0 end
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(v[1]), tonumber(v[2])
if tokens == nil or ts == nil then return 0 end  -- expired: the bucket is full anyway
tokens = math.min(cap, tokens + math.max(0, now - ts) * cap / 60000 + refund)
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return math.floor(tokens)
