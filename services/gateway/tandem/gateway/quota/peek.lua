#!lua flags=no-writes
-- A read-only look at one tenant's quota before any prompt is built: is a stream slot free, and can
-- the buckets pay for a prompt of at least ARGV[3] tokens and one output token? Nothing is charged
-- (RedisQuota.admit charges the exact figures once the prompt is tokenized).
--
-- KEYS[1] input bucket   KEYS[2] output bucket   KEYS[3] streams zset
-- ARGV[1] input capacity per minute (-1: unlimited)   ARGV[2] output capacity (-1: unlimited)
-- ARGV[3] fewest input tokens the prompt can have   ARGV[4] max concurrent streams (-1: unlimited)
-- Returns {ok 0/1, reason, wait_ms, input_left, output_left, streams_in_use}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local in_cap, out_cap, in_min, max_streams = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])

local function level(key, cap)
  if cap < 0 then return -1 end
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return cap end
  return math.min(cap, tokens + math.max(0, now - ts) * cap / 60000)
end

local in_use = 0
if max_streams >= 0 then in_use = redis.call('ZCOUNT', KEYS[3], now, '+inf') end
local in_left, out_left = level(KEYS[1], in_cap), level(KEYS[2], out_cap)
local function reply(ok, reason, wait_ms)
  return {ok, reason, math.floor(wait_ms), math.floor(in_left), math.floor(out_left), in_use}
end
if max_streams >= 0 and in_use >= max_streams then return reply(0, 'streams', 1000) end
if in_cap >= 0 and in_min > in_cap then return reply(0, 'input_too_large', 0) end
if in_cap >= 0 and in_left < in_min then return reply(0, 'input_tokens', (in_min - in_left) * 60000 / in_cap) end
if out_cap >= 0 and out_left < 1 then return reply(0, 'output_tokens', (1 - out_left) * 60000 / out_cap) end
return reply(1, '', 0)
