-- Settles one admitted request: frees its in-flight slot and gives back the tokens it
-- reserved but did not use, at the tenant and the key level; and in every budget window it
-- held, replaces its reservation with what it cost. Idempotent: only the call that removes
-- the request from the tenant's in-flight set refunds tokens, and only the call that
-- removes a window's hold counts the cost there.
--
-- Inputs: by name, from inference/scripts.py's SETTLE (which says what each is); a table
--   for several, in admit.lua's order: each level's (1 tenant, 2 key), each budget
--   window's (1..6: (tenant, key, end user) x (day, month)). A window the request did not
--   hold has no hold of it, and is left as it is.
-- A window whose spent spend or tokens reach 50, 80 or 100% of a limit for the first time
-- adds that threshold to the alerts set, which the worker sends (billing/budgets.py).
-- Returns 1 when this call settled the request's quota, 0 when it was settled before.

local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local give_back = tonumber(refund)
local cost = tonumber(cost_micros)
local used_tokens = tonumber(used)

local function budget_settle(key, def_field, fallback)
  local hold = redis.call('HGET', key, 'h:' .. request_id)
  if not hold then return end
  local m, tk = string.match(hold, '^(%S+) (%S+)')
  redis.call('HDEL', key, 'h:' .. request_id)
  redis.call('HINCRBY', key, 'rs', -tonumber(m))
  redis.call('HINCRBY', key, 'rt', -tonumber(tk))
  local s = redis.call('HINCRBY', key, 's', cost)
  local tokens = redis.call('HINCRBY', key, 't', used_tokens)
  local def = redis.call('HGET', budget_defs_key, def_field)
  if not def and fallback ~= '' then def = redis.call('HGET', budget_defs_key, fallback) end
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
    redis.call('SADD', budget_alerts_key,
               table.concat({id, key, reached, s, tokens, now, end_user}, '|'))
  end
end

for i = 1, 6 do
  local fallback = ''
  if i >= 5 and window_fields[i] ~= '' then fallback = end_user_fields[i - 4] end
  budget_settle(window_keys[i], window_fields[i], fallback)
end

local settled = redis.call('ZREM', inflight_keys[1], request_id)
redis.call('ZREM', inflight_keys[2], request_id)
if settled == 0 or give_back <= 0 then
  return settled
end

for i = 1, 2 do
  local limit = tonumber(tpm_limits[i])
  if limit > 0 then
    local v = redis.call('GET', tpm_keys[i])
    if v then
      local tat = tonumber(v) - give_back * WINDOW / limit
      if tat <= now then
        redis.call('DEL', tpm_keys[i])
      else
        redis.call('SET', tpm_keys[i], tostring(tat), 'PX', math.ceil(tat - now) + 1)
      end
    end
  end
  if redis.call('EXISTS', month_keys[i]) == 1 then
    redis.call('DECRBY', month_keys[i], give_back)
  end
end
return 1
