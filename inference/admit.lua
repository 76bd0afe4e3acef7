-- Admission of one inference request against its tenant's and its key's limits, atomically.
--
-- KEYS (per level L = tenant, then key): rpm_L, tpm_L, inflight_L, month_L.
-- ARGV: [1] request id, [2] tokens to reserve (prompt + max_tokens), [3] lease ms (how long
--   an in-flight slot lives if it is never released), [4] unix ms when the month resets,
--   [5..8] tenant limits rpm, tpm, concurrent, monthly tokens, [9..12] the key's (0: none),
--   [13] 1 to only check (a pre-check before the prompt is tokenized: refuses what no
--   request could pass now, takes nothing).
-- Buckets are GCRA: a bucket stores its theoretical arrival time (TAT, unix ms); a limit of
--   N per minute spends 60000/N ms of TAT per unit and admits while TAT - now <= 60000.
-- Returns {admitted, reason, level, retry_ms, failed_limit,
--          req_limit, req_remaining, req_reset_ms, tok_limit, tok_remaining, tok_reset_ms}
--   reason: 0 ok, 1 concurrency, 2 requests/min, 3 tokens/min, 4 monthly tokens,
--   5 the request alone is larger than the tokens/min limit; level: 1 tenant, 2 key.

local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local request_id = ARGV[1]
local cost = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
local month_reset = tonumber(ARGV[4])

local levels = {}
for i = 0, 1 do
  local k, a = i * 4, 5 + i * 4
  levels[i + 1] = {
    rpm_key = KEYS[k + 1], tpm_key = KEYS[k + 2], inflight_key = KEYS[k + 3],
    month_key = KEYS[k + 4],
    rpm = tonumber(ARGV[a]), tpm = tonumber(ARGV[a + 1]),
    conc = tonumber(ARGV[a + 2]), cap = tonumber(ARGV[a + 3]),
  }
end

local function tat_of(key)
  local v = redis.call('GET', key)
  if v then
    local tat = tonumber(v)
    if tat > now then return tat end
  end
  return now
end

-- Remaining units and ms until the bucket is full again, for a bucket whose TAT is `tat`.
local function standing(limit, tat)
  local interval = WINDOW / limit
  return math.floor((WINDOW - (tat - now)) / interval), tat - now
end

local req = {limit = -1, remaining = -1, reset = 0}
local tok = {limit = -1, remaining = -1, reset = 0}
local function report(acc, limit, remaining, reset)
  if acc.limit < 0 or remaining < acc.remaining then
    acc.limit, acc.remaining, acc.reset = limit, math.max(remaining, 0), reset
  end
end

-- First pass: check everything, change nothing.
local failed = nil
for i, lv in ipairs(levels) do
  redis.call('ZREMRANGEBYSCORE', lv.inflight_key, '-inf', now)
  lv.rpm_tat = tat_of(lv.rpm_key)
  lv.tpm_tat = tat_of(lv.tpm_key)
  if not failed and lv.conc > 0 and redis.call('ZCARD', lv.inflight_key) >= lv.conc then
    failed = {1, i, 1000, lv.conc}
  end
  if not failed and lv.rpm > 0 then
    local next_tat = lv.rpm_tat + WINDOW / lv.rpm
    if next_tat - now > WINDOW then failed = {2, i, next_tat - now - WINDOW, lv.rpm} end
  end
  if not failed and lv.tpm > 0 then
    if cost > lv.tpm then
      failed = {5, i, -1, lv.tpm}
    else
      local next_tat = lv.tpm_tat + cost * WINDOW / lv.tpm
      if next_tat - now > WINDOW then failed = {3, i, next_tat - now - WINDOW, lv.tpm} end
    end
  end
  if not failed and lv.cap > 0 then
    local used = tonumber(redis.call('GET', lv.month_key) or '0')
    if used + cost > lv.cap then failed = {4, i, month_reset - now, lv.cap} end
  end
end

if failed then
  for _, lv in ipairs(levels) do
    if lv.rpm > 0 then report(req, lv.rpm, standing(lv.rpm, lv.rpm_tat)) end
    if lv.tpm > 0 then report(tok, lv.tpm, standing(lv.tpm, lv.tpm_tat)) end
  end
  return {0, failed[1], failed[2], math.ceil(failed[3]), failed[4],
          req.limit, req.remaining, math.ceil(req.reset),
          tok.limit, tok.remaining, math.ceil(tok.reset)}
end

if tonumber(ARGV[13]) == 1 then
  -- A probe takes nothing: it reports where the caller stands now.
  for _, lv in ipairs(levels) do
    if lv.rpm > 0 then report(req, lv.rpm, standing(lv.rpm, lv.rpm_tat)) end
    if lv.tpm > 0 then report(tok, lv.tpm, standing(lv.tpm, lv.tpm_tat)) end
  end
  return {1, 0, 0, 0, 0, req.limit, req.remaining, math.ceil(req.reset),
          tok.limit, tok.remaining, math.ceil(tok.reset)}
end

-- Second pass: take the request, the tokens, the slot and the month's share at every level.
for _, lv in ipairs(levels) do
  if lv.rpm > 0 then
    local tat = lv.rpm_tat + WINDOW / lv.rpm
    redis.call('SET', lv.rpm_key, tostring(tat), 'PX', math.ceil(tat - now) + 1)
    report(req, lv.rpm, standing(lv.rpm, tat))
  end
  if lv.tpm > 0 then
    local tat = lv.tpm_tat + cost * WINDOW / lv.tpm
    redis.call('SET', lv.tpm_key, tostring(tat), 'PX', math.ceil(tat - now) + 1)
    report(tok, lv.tpm, standing(lv.tpm, tat))
  end
  redis.call('ZADD', lv.inflight_key, now + lease, request_id)
  if redis.call('PTTL', lv.inflight_key) < lease then
    redis.call('PEXPIRE', lv.inflight_key, lease)
  end
  redis.call('INCRBY', lv.month_key, cost)
  -- Kept a week past the month's end, for whoever reads it late.
  redis.call('PEXPIREAT', lv.month_key, month_reset + 7 * 86400000)
end

return {1, 0, 0, 0, 0, req.limit, req.remaining, math.ceil(req.reset),
        tok.limit, tok.remaining, math.ceil(tok.reset)}
