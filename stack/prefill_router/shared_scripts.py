"""The Lua scripts of the router replicas' shared state in Redis (the parts of
:mod:`stack.prefill_router.shared_state` run them; its docstring says what the keys hold).
Each runs atomically on the Redis server: a read of the view, a claim's compare-and-set, a
publication, a heartbeat with its garbage collection, a registry change, a refusal
remembered or used up."""

from __future__ import annotations

# READ(ns, me) -> {workers_ver, {wkey, tokens, seconds, running, fetched, ...}, {wkey, ver, ...},
#   {replica, head, ...}}: the other live replicas' figures summed per worker
_READ_FN = r"""
local function set_if_newer(acct, f, seq, value)
  local old = redis.call('HGET', acct, f)
  if old then
    local oseq = tonumber(string.match(old, '^(%S+)'))
    if oseq and oseq >= seq then return end
  end
  redis.call('HSET', acct, f, value)
end
local function is_live(ns, live, rid)
  local ok = live[rid]
  if ok == nil then
    ok = redis.call('EXISTS', ns .. ':hb:' .. rid) == 1
    live[rid] = ok
  end
  return ok
end
local function read_view(ns, me)
  local acct = redis.call('HGETALL', ns .. ':acct')
  local live, sums, order = {}, {}, {}
  for i = 1, #acct, 2 do
    local f = acct[i]
    local tab = string.find(f, '\t', 1, true)
    if tab then
      local rid = string.sub(f, 1, tab - 1)
      if rid ~= me and is_live(ns, live, rid) then
        local _, t, s, r, rest = string.match(acct[i + 1], '^(%S+) (%S+) (%S+) (%S+)(.*)$')
        if t then
          local wk = string.sub(f, tab + 1)
          local e = sums[wk]
          if e == nil then
            e = {0, 0, 0, 0}
            sums[wk] = e
            order[#order + 1] = wk
          end
          e[1] = e[1] + tonumber(t)
          e[2] = e[2] + tonumber(s)
          e[3] = e[3] + tonumber(r)
          e[4] = e[4] + (tonumber(string.match(rest, '%S+') or '') or 0)
        end
      end
    end
  end
  local flat = {}
  for _, wk in ipairs(order) do
    local e = sums[wk]
    flat[#flat + 1] = wk
    flat[#flat + 1] = tostring(e[1])
    flat[#flat + 1] = tostring(e[2])
    flat[#flat + 1] = tostring(e[3])
    flat[#flat + 1] = tostring(e[4])
  end
  local wver = redis.call('GET', ns .. ':workers_ver') or '0'
  local heads = {}
  local all = redis.call('HGETALL', ns .. ':heads')
  for i = 1, #all, 2 do
    local rid = all[i]
    if rid ~= me and is_live(ns, live, rid) then
      heads[#heads + 1] = rid
      heads[#heads + 1] = all[i + 1]
    end
  end
  return {wver, flat, redis.call('HGETALL', ns .. ':ver'), heads}
end
"""

READ = _READ_FN + "return read_view(ARGV[1], ARGV[2])"

# CLAIM(ns, me, wkey, expected_ver | -1 to force, seq, value) -> {1} or {0, view}
CLAIM = (
    _READ_FN
    + r"""
local ns, me, wk = ARGV[1], ARGV[2], ARGV[3]
local expected = tonumber(ARGV[4])
local cur = tonumber(redis.call('HGET', ns .. ':ver', wk) or '0')
if expected >= 0 and cur ~= expected then
  return {0, read_view(ns, me)}
end
redis.call('HINCRBY', ns .. ':ver', wk, 1)
set_if_newer(ns .. ':acct', me .. '\t' .. wk, tonumber(ARGV[5]), ARGV[6])
return {1}
"""
)

# PUBLISH(ns, me, seq, wkey, value | '-', ...) -> number of fields written
PUBLISH = (
    _READ_FN
    + r"""
local ns, me, seq = ARGV[1], ARGV[2], tonumber(ARGV[3])
local acct = ns .. ':acct'
local n = 0
for i = 4, #ARGV, 2 do
  local f = me .. '\t' .. ARGV[i]
  if ARGV[i + 1] == '-' then
    redis.call('HDEL', acct, f)
  else
    set_if_newer(acct, f, seq, ARGV[i + 1])
  end
  n = n + 1
end
return n
"""
)

# HEADS(ns, me, seq, value | '-') -> view: set (or drop) this replica's head, then read the
# others' figures and heads (every read of the view returns the other live replicas' heads)
HEADS = (
    _READ_FN
    + r"""
local ns, me, seq, value = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
if value == '-' then
  redis.call('HDEL', ns .. ':heads', me)
else
  set_if_newer(ns .. ':heads', me, seq, value)
end
return read_view(ns, me)
"""
)

# HEARTBEAT(ns, me, ttl_ms, token) -> {1 if our heartbeat was still alive else 0, workers_ver,
# workers hash exists 0/1, 1 if another process beats under our replica id}; drops the
# figures of replicas whose heartbeat expired
HEARTBEAT = r"""
local ns, me, ttl, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local hb = ns .. ':hb:' .. me
local cur = redis.call('GET', hb)
local alive = cur ~= false
local dup = 0
if alive and cur ~= token then dup = 1 end
redis.call('SET', hb, token, 'PX', ttl)
redis.call('SADD', ns .. ':replicas', me)
local dead = {}
for _, rid in ipairs(redis.call('SMEMBERS', ns .. ':replicas')) do
  if redis.call('EXISTS', ns .. ':hb:' .. rid) == 0 then dead[rid .. '\t'] = true end
end
if next(dead) then
  local acct = ns .. ':acct'
  for _, f in ipairs(redis.call('HKEYS', acct)) do
    local tab = string.find(f, '\t', 1, true)
    if tab and dead[string.sub(f, 1, tab)] then redis.call('HDEL', acct, f) end
  end
  for rid in pairs(dead) do
    redis.call('SREM', ns .. ':replicas', string.sub(rid, 1, -2))
    redis.call('HDEL', ns .. ':heads', string.sub(rid, 1, -2))
  end
end
return {alive and 1 or 0, redis.call('GET', ns .. ':workers_ver') or '0',
        redis.call('EXISTS', ns .. ':workers'), dup}
"""

# REGISTRY(ns, op, wkey, spec) op: add | addnx | remove -> 1 if changed
REGISTRY = r"""
local ns, op, wk = ARGV[1], ARGV[2], ARGV[3]
local h = ns .. ':workers'
local changed = 0
if op == 'add' then
  redis.call('HSET', h, wk, ARGV[4]); changed = 1
elseif op == 'addnx' then
  changed = redis.call('HSETNX', h, wk, ARGV[4])
else
  changed = redis.call('HDEL', h, wk)
  redis.call('HDEL', ns .. ':ver', wk)  -- every READ returns the whole hash: keep it to live workers
end
if changed == 1 then redis.call('INCR', ns .. ':workers_ver') end
return changed
"""

# REFUSED(ns, fingerprint, ttl_ms): one more request with this fingerprint refused for its
# wait; remembered for ttl_ms from the latest refusal
REFUSED = r"""
local k = ARGV[1] .. ':refused:' .. ARGV[2]
redis.call('INCR', k)
redis.call('PEXPIRE', k, ARGV[3])
return 1
"""

# READMIT(ns, fingerprint) -> 1 if a refusal of this fingerprint was remembered (it is used up)
READMIT = r"""
local k = ARGV[1] .. ':refused:' .. ARGV[2]
local n = tonumber(redis.call('GET', k) or '0')
if n <= 0 then return 0 end
if n == 1 then redis.call('DEL', k) else redis.call('DECR', k) end
return 1
"""
