-- Admission of one inference request against its tenant's and its key's limits and every
-- budget that applies to it, atomically: all are taken, or none.
--
-- Inputs: by name, from inference/scripts.py's ADMIT (which says what each is); a table
--   for several: each level's (1 tenant, 2 key), each budget window's (1..6: (tenant, key,
--   end user) x (day, month), billing/budgets.py). All keys share the tenant's hash tag,
--   so one Redis Cluster slot.
-- Buckets are GCRA: a bucket stores its theoretical arrival time (TAT, unix ms); a limit of
--   N per minute spends 60000/N ms of TAT per unit and admits while TAT - now <= 60000.
-- Budgets reserve: a window holds spent (s, t) and reserved (rs, rt) spend and tokens, and
--   one field 'h:<request id>' per reservation ("micros tokens lapses_at_ms"); a request is
--   refused when spent + reserved + its reservation would pass a limit. Reservations whose
--   lease lapsed (a web process died) are released when a window would refuse.
-- Returns {admitted, reason, level, retry_ms, failed_limit,
--          req_limit, req_remaining, req_reset_ms, tok_limit, tok_remaining, tok_reset_ms,
--          then per window: budget id (0: none), spend limit, spend used (spent + reserved),
--          token limit, tokens used (limits -1: none)}
--   reason: 0 ok, 1 concurrency, 2 requests/min, 3 tokens/min, 4 monthly tokens,
--   5 the request alone is larger than the tokens/min limit, 6 a spend budget, 7 a token
--   budget; level: 1 tenant, 2 key (reasons 1-5), the window 1..6 (reasons 6-7).

local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cost = tonumber(tokens)
local lease = tonumber(lease_ms)
local month_reset = tonumber(month_reset_ms)

local levels = {}
for i = 1, 2 do
  levels[i] = {
    rpm_key = rpm_keys[i], tpm_key = tpm_keys[i], inflight_key = inflight_keys[i],
    month_key = month_keys[i],
    rpm = tonumber(rpm_limits[i]), tpm = tonumber(tpm_limits[i]),
    conc = tonumber(concurrency_limits[i]), cap = tonumber(month_caps[i]),
  }
end

-- The budget windows with a definition for this request.
local reserve_micros = tonumber(cost_micros)
local budgets = {}
local defs = redis.call('HMGET', budget_defs_key, window_fields[1], window_fields[2],
                        window_fields[3], window_fields[4], window_fields[5],
                        window_fields[6], end_user_fields[1], end_user_fields[2])
for i = 1, 6 do
  local def = defs[i]
  if not def and i >= 5 and window_fields[i] ~= '' then def = defs[i + 2] end
  if def then
    local id, spend, limit = string.match(def, '^(%S+) (%S+) (%S+)$')
    budgets[#budgets + 1] = {slot = i, key = window_keys[i], id = id, spend = tonumber(spend),
                             tokens = tonumber(limit), reset = tonumber(window_resets[i])}
  end
end

local function window_read(b)
  local v = redis.call('HMGET', b.key, 's', 't', 'rs', 'rt')
  b.s, b.t = tonumber(v[1] or '0'), tonumber(v[2] or '0')
  b.rs, b.rt = tonumber(v[3] or '0'), tonumber(v[4] or '0')
end

-- 0 when the reservation fits the window, 1 when it passes the spend limit, 2 the tokens.
local function over(b)
  if b.spend >= 0 and b.s + b.rs + reserve_micros > b.spend then return 1 end
  if b.tokens >= 0 and b.t + b.rt + cost > b.tokens then return 2 end
  return 0
end

-- Releases the window's reservations whose lease lapsed: their web process is gone.
local function sweep(b)
  local all = redis.call('HGETALL', b.key)
  for j = 1, #all, 2 do
    if string.sub(all[j], 1, 2) == 'h:' then
      local m, tk, lapses = string.match(all[j + 1], '^(%S+) (%S+) (%S+)$')
      if tonumber(lapses) <= now then
        redis.call('HDEL', b.key, all[j])
        redis.call('HINCRBY', b.key, 'rs', -tonumber(m))
        redis.call('HINCRBY', b.key, 'rt', -tonumber(tk))
      end
    end
  end
  window_read(b)
end

-- A refusal by a budget is its 100% alert, once per window (the worker sends it).
local function exhausted(b)
  if tonumber(redis.call('HGET', b.key, 'a') or '0') < 100 then
    redis.call('HSET', b.key, 'a', 100)
    redis.call('PEXPIREAT', b.key, b.reset + 7 * 86400000)
    redis.call('SADD', budget_alerts_key,
               table.concat({b.id, b.key, 100, b.s, b.t, now, end_user}, '|'))
  end
end

local function budget_report()
  local out = {}
  local by_slot = {}
  for _, b in ipairs(budgets) do by_slot[b.slot] = b end
  for i = 1, 6 do
    local b = by_slot[i]
    if b then
      for _, v in ipairs({tonumber(b.id), b.spend, b.s + b.rs, b.tokens, b.t + b.rt}) do
        out[#out + 1] = v
      end
    else
      for _, v in ipairs({0, -1, 0, -1, 0}) do out[#out + 1] = v end
    end
  end
  return out
end

local function reply(head)
  for _, v in ipairs(budget_report()) do head[#head + 1] = v end
  return head
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
for _, b in ipairs(budgets) do
  window_read(b)
  if not failed then
    if over(b) > 0 then sweep(b) end
    local o = over(b)
    if o > 0 then
      failed = {5 + o, b.slot, b.reset - now, o == 1 and b.spend or b.tokens}
      exhausted(b)
    end
  end
end

if failed then
  for _, lv in ipairs(levels) do
    if lv.rpm > 0 then report(req, lv.rpm, standing(lv.rpm, lv.rpm_tat)) end
    if lv.tpm > 0 then report(tok, lv.tpm, standing(lv.tpm, lv.tpm_tat)) end
  end
  return reply({0, failed[1], failed[2], math.ceil(failed[3]), failed[4],
                req.limit, req.remaining, math.ceil(req.reset),
                tok.limit, tok.remaining, math.ceil(tok.reset)})
end

if tonumber(probe) == 1 then
  -- A probe takes nothing: it reports where the caller stands now.
  for _, lv in ipairs(levels) do
    if lv.rpm > 0 then report(req, lv.rpm, standing(lv.rpm, lv.rpm_tat)) end
    if lv.tpm > 0 then report(tok, lv.tpm, standing(lv.tpm, lv.tpm_tat)) end
  end
  return reply({1, 0, 0, 0, 0, req.limit, req.remaining, math.ceil(req.reset),
                tok.limit, tok.remaining, math.ceil(tok.reset)})
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
for _, b in ipairs(budgets) do
  redis.call('HINCRBY', b.key, 'rs', reserve_micros)
  redis.call('HINCRBY', b.key, 'rt', cost)
  redis.call('HSET', b.key, 'h:' .. request_id,
             table.concat({reserve_micros, cost, now + lease}, ' '))
  redis.call('PEXPIREAT', b.key, b.reset + 7 * 86400000)
  b.rs, b.rt = b.rs + reserve_micros, b.rt + cost
end

return reply({1, 0, 0, 0, 0, req.limit, req.remaining, math.ceil(req.reset),
              tok.limit, tok.remaining, math.ceil(tok.reset)})
