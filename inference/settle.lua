-- Settles one admitted request: frees its in-flight slot and gives back the tokens it
-- reserved but did not use, at the tenant and the key level. Idempotent: only the call
-- that removes the request from the tenant's in-flight set refunds anything.
--
-- KEYS (tenant, then key): tpm_L, inflight_L, month_L
-- ARGV: [1] request id, [2] tokens to give back, [3] tenant tpm limit, [4] key tpm limit (0: none)
-- Returns 1 when this call settled the request, 0 when it was settled (or expired) before.

local WINDOW = 60000
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local request_id = ARGV[1]
local refund = tonumber(ARGV[2])

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
