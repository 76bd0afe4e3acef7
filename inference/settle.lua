-- Settles one admitted request: frees its in-flight slot and gives back the tokens it
-- reserved but did not use, at the tenant and the key level; and in every budget window it
-- held, replaces its reservation with what it cost. Idempotent: only the call that removes
-- the request from the tenant's in-flight set refunds tokens, and only the call that
-- removes a window's hold counts the cost there.
--
-- KEYS (tenant, then key): [1..6] tpm_L, inflight_L, month_L; [7] the tenant's budget
--   definitions, [8] its budget alerts, [9..] the budget windows the request held.
-- ARGV: [1] request id, [2] tokens to give back, [3] tenant tpm limit, [4] key tpm limit
--   (0: none), [5] what the request cost (micro-units), [6] the tokens it used, [7] the
--   request's end user ('' : none; named in alerts), then per window held: its definition
--   field and the each-end-user field ('' : none).
-- A window whose spent spend or tokens reach 50, 80 or 100% of a limit for the first time
-- adds that threshold to the alerts set, which the worker sends (billing/budgets.py).
-- Returns 1 when this call settled the request's quota, 0 when it was settled before.

local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local request_id = ARGV[1]
local refund = tonumber(ARGV[2])
local cost_micros = tonumber(ARGV[5])
local used = tonumber(ARGV[6])
local end_user = ARGV[7]

local function budget_settle(key, field, fallback)
  local hold = redis.call('HGET', key, 'h:' .. request_id)
  if not hold then return end
  local m, tk = string.match(hold, '^(%S+) (%S+)')
  redis.call('HDEL', key, 'h:' .. request_id)
  redis.call('HINCRBY', key, 'rs', -tonumber(m))
  redis.call('HINCRBY', key, 'rt', -tonumber(tk))
  local s = redis.call('HINCRBY', key, 's', cost_micros)
  local tokens = redis.call('HINCRBY', key, 't', used)
  local def = redis.call('HGET', KEYS[7], field)
  if not def and fallback ~= '' then def = redis.call('HGET', KEYS[7], fallback) end
  if not def then return end
  local id, spend, token_limit = string.match(def, '^(%S+) (%S+) (%S+)$')
  spend, token_limit = tonumber(spend), tonumber(token_limit)
  local share = 0
  if spend > 0 then share = math.max(share, s * 100 / spend) end
  if token_limit > 0 then share = math.max(share, tokens * 100 / token_limit) end
  local reached = 0
  for _, threshold in ipairs({50, 80, 100}) do
    if share >= threshold then reached = threshold end
  end
  if reached > tonumber(redis.call('HGET', key, 'a') or '0') then
    redis.call('HSET', key, 'a', reached)
    redis.call('SADD', KEYS[8], table.concat({id, key, reached, s, tokens, now, end_user}, '|'))
  end
end

for i = 9, #KEYS do
  budget_settle(KEYS[i], ARGV[8 + (i - 9) * 2], ARGV[9 + (i - 9) * 2])
end

local settled = redis.call('ZREM', KEYS[2], request_id)
redis.call('ZREM', KEYS[5], request_id)
if settled == 0 or refund <= 0 then
  return settled
end

for i = 0, 1 do
  local tpm_key, month_key, limit = KEYS[i * 3 + 1], KEYS[i * 3 + 3], tonumber(ARGV[3 + i])
  if limit > 0 then
    local v = redis.call('GET', tpm_key)
    if v then
      local tat = tonumber(v) - refund * WINDOW / limit
      if tat <= now then
        redis.call('DEL', tpm_key)
      else
        redis.call('SET', tpm_key, tostring(tat), 'PX', math.ceil(tat - now) + 1)
      end
    end
  end
  if redis.call('EXISTS', month_key) == 1 then
    redis.call('DECRBY', month_key, refund)
  end
end
return 1
