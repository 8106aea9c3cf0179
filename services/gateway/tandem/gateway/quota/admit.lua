#!lua
-- Admission of one request: two token buckets (input, output tokens per minute) and a
-- concurrency set, checked and charged atomically. Called by RedisQuota.admit.
--
-- KEYS[1] input bucket (hash: tokens, ts_ms)   KEYS[2] output bucket   KEYS[3] streams (zset: id -> lease end ms)
-- KEYS[4] this request's admission marker (set while it is admitted and not yet settled)
-- ARGV[1] input capacity per minute (-1: unlimited)    ARGV[2] output capacity (-1: unlimited)
-- ARGV[3] input cost   ARGV[4] output cost (the max_tokens reservation)
-- ARGV[5] max concurrent streams (-1: unlimited)   ARGV[6] request id   ARGV[7] lease ms
-- Returns {admitted 0/1, reason, wait_ms, input_left, output_left, streams_in_use}
-- reason: "" | "streams" | "input_tokens" | "output_tokens" | "input_too_large" | "output_too_large"

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local in_cap, out_cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local in_cost, out_cost = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_streams, lease_ms = tonumber(ARGV[5]), tonumber(ARGV[7])

local function level(key, cap)
  if cap < 0 then return -1 end
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return cap end
  return math.min(cap, tokens + math.max(0, now - ts) * cap / 60000)
end

local in_left, out_left = level(KEYS[1], in_cap), level(KEYS[2], out_cap)
local in_use = 0
if max_streams >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  in_use = redis.call('ZCARD', KEYS[3])
end
local function reply(ok, reason, wait_ms)
  return {ok, reason, math.ceil(wait_ms), math.floor(in_left), math.floor(out_left), in_use}
end

-- The same request admitted again (a retry whose first reply was lost): admitted, charged once.
if redis.call('EXISTS', KEYS[4]) == 1 then return reply(1, '', 0) end

if in_cap >= 0 and in_cost > in_cap then return reply(0, 'input_too_large', 0) end
if out_cap >= 0 and out_cost > out_cap then return reply(0, 'output_too_large', 0) end
if max_streams >= 0 and in_use >= max_streams then
  -- A slot frees as soon as any of the tenant's streams ends (not when a lease runs out): retry soon.
  return reply(0, 'streams', 1000)
end
if in_cap >= 0 and in_left < in_cost then
  return reply(0, 'input_tokens', (in_cost - in_left) * 60000 / in_cap)
end
if out_cap >= 0 and out_left < out_cost then
  return reply(0, 'output_tokens', (out_cost - out_left) * 60000 / out_cap)
end

-- A bucket refills completely within a minute: keys idle longer than that carry no information.
if in_cap >= 0 then
  in_left = in_left - in_cost
  redis.call('HSET', KEYS[1], 'tokens', tostring(in_left), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], 120000)
end
if out_cap >= 0 then
  out_left = out_left - out_cost
  redis.call('HSET', KEYS[2], 'tokens', tostring(out_left), 'ts', now)
  redis.call('PEXPIRE', KEYS[2], 120000)
end
if max_streams >= 0 then
  redis.call('ZADD', KEYS[3], now + lease_ms, ARGV[6])
  redis.call('PEXPIRE', KEYS[3], lease_ms + 60000)
  in_use = in_use + 1
end
redis.call('SET', KEYS[4], '1', 'PX', lease_ms + 60000)
return reply(1, '', 0)
