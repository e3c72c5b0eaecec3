"""Lua scripts that make the Redis backend's limit checks, and its reads of several keys, atomic
across gateway processes.

Each script runs as one Redis command, so no other client sees or changes the state between the
check and the write. They mirror store.limits (take, budget_allows); numbers cross as strings in
"%.17g" form so floats round-trip exactly.

A script's `now` is '' unless a caller pins the time (tests): Redis's own clock then, one for every
gateway. NOTE: a gateway's clock ahead of another's would take the other's live holds for lapsed
(and drop them, letting calls past the monthly budgets) and its rate buckets for refilled.
"""

# The time `now` ('' for Redis's clock) names, in seconds; prepended to the scripts that use it.
_CLOCK = """
local function clock(now)
  if now ~= '' then return tonumber(now) end
  local time = redis.call('TIME')
  return tonumber(time[1]) + tonumber(time[2]) / 1000000
end
"""

# KEYS[1]: the tenant's bucket hash ("<kind>:level", "<kind>:ts" fields; missing = full bucket).
# ARGV: now (see clock), window_s, overdraw (1: pay every cost, a bucket that lacks it going below empty),
# then one (kind, limit, cost) triple per bucket to pay (a negative cost is a refund, never
# refused).
# Returns {allowed (0/1), retry_after, limited_by}.
RATE = _CLOCK + """
local now, window, overdraw = clock(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == '1'
local paid, retry_after, limited_by = {}, 0, ''
for i = 4, #ARGV, 3 do
  local kind, limit, cost = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local state = redis.call('HMGET', KEYS[1], kind .. ':level', kind .. ':ts')
  local level, ts = tonumber(state[1]) or limit, tonumber(state[2]) or now
  level = math.min(limit, level + math.max(0, now - ts) * limit / window)
  if level < cost and not overdraw then
    local wait = window
    if cost <= limit then wait = (cost - level) * window / limit end
    if wait > retry_after then retry_after, limited_by = wait, kind end
  end
  paid[#paid + 1] = {kind, math.min(limit, level - cost), math.max(ts, now), limit}
end
if limited_by ~= '' then
  return {0, string.format('%.17g', retry_after), limited_by}
end
-- A missing bucket means a full one: the hash lapses a window after every bucket is full again
-- (two windows at most, longer for one an overdraw left below empty), and never sooner for a
-- payment into its other buckets.
local ttl = 2 * window
for _, b in ipairs(paid) do
  redis.call('HSET', KEYS[1], b[1] .. ':level', string.format('%.17g', b[2]),
             b[1] .. ':ts', string.format('%.17g', b[3]))
  ttl = math.max(ttl, window + (b[4] - b[2]) * window / b[4])
end
if redis.call('TTL', KEYS[1]) < ttl then
  redis.call('EXPIRE', KEYS[1], math.ceil(ttl))
end
return {1, '0', ''}
"""

# KEYS[1]: the month's usage hash; KEYS[2]: its holds hash (id -> "tokens spend expires_at").
# ARGV: now (see clock), token_budget or '', spend_budget or '', tokens, spend_usd, hold id,
# hold_ttl_s, key_ttl_s, spend_tolerance (limits.SPEND_TOLERANCE_USD). Drops lapsed holds; returns
# 1 and stores the hold (lapsing hold_ttl_s from now) if the budgets cover it, else 0.
RESERVE = _CLOCK + """
local now = clock(ARGV[1])
local held_tokens, held_spend = 0, 0
local holds = redis.call('HGETALL', KEYS[2])
for i = 1, #holds, 2 do
  local tokens, spend, expires_at = string.match(holds[i + 1], '^(%S+) (%S+) (%S+)$')
  if tonumber(expires_at) <= now then
    redis.call('HDEL', KEYS[2], holds[i])
  else
    held_tokens, held_spend = held_tokens + tonumber(tokens), held_spend + tonumber(spend)
  end
end
local usage = redis.call('HMGET', KEYS[1], 'tokens_in', 'tokens_out', 'spend_usd')
local tokens, spend = tonumber(ARGV[4]), tonumber(ARGV[5])
if ARGV[2] ~= '' then
  local used = (tonumber(usage[1]) or 0) + (tonumber(usage[2]) or 0) + held_tokens
  if used + tokens > tonumber(ARGV[2]) then return 0 end
end
if ARGV[3] ~= '' then
  local spent, budget = (tonumber(usage[3]) or 0) + held_spend, tonumber(ARGV[3])
  local tolerance = tonumber(ARGV[9])
  if spent >= budget - tolerance or spent + spend > budget + tolerance then return 0 end
end
local expires_at = string.format('%.17g', now + tonumber(ARGV[7]))
redis.call('HSET', KEYS[2], ARGV[6], ARGV[4] .. ' ' .. ARGV[5] .. ' ' .. expires_at)
-- Holds a dead gateway never settled must not keep the hash alive forever.
if redis.call('TTL', KEYS[2]) < tonumber(ARGV[8]) then
  redis.call('EXPIRE', KEYS[2], ARGV[8])
end
return 1
"""

# KEYS[1]: a month's holds hash. ARGV: hold id, now (see clock), hold_ttl_s, key_ttl_s. Returns 1
# and has the hold lapse hold_ttl_s from now if it is still live, else 0 (a lapsed one is dropped,
# as RESERVE would).
EXTEND_HOLD = _CLOCK + """
local hold = redis.call('HGET', KEYS[1], ARGV[1])
if not hold then return 0 end
local tokens, spend, expires_at = string.match(hold, '^(%S+) (%S+) (%S+)$')
local now = clock(ARGV[2])
if tonumber(expires_at) <= now then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1],
           tokens .. ' ' .. spend .. ' ' .. string.format('%.17g', now + tonumber(ARGV[3])))
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
return 1
"""


# KEYS: the keys to read; ARGV[i]: the read command for KEYS[i] (HGETALL, HVALS). Returns one reply
# per key, all read at one instant, then Redis's clock at that instant (TIME's reply).
# NOTE: a script, not a MULTI transaction: Redis out of its maxmemory refuses every command queued
# in a transaction, reads too, but runs a script up to its first write, so these reads go on
# answering while Redis is full.
READ_TOGETHER = """
local replies = {}
for i, key in ipairs(KEYS) do replies[i] = redis.call(ARGV[i], key) end
replies[#KEYS + 1] = redis.call('TIME')
return replies
"""
