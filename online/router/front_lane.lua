-- The router's fast lane in nginx (online/router/nginx_front.py renders the configuration that loads it).
--
-- One worker process: every table below is that worker's own, so the quotas and counts are global without a
-- lock. The router keeps the lane true through the control socket: POST /state sends a Lua table literal
-- (pins, replicas as it sees them, each pin's replica order with the active group's first, the active group,
-- whether answers may be retried), GET /counts reads back what the lane carries. Static settings (the tenants'
-- key digests and quotas, the retries, c, the largest body, how long a failed replica stays out, the stall time,
-- the request time-out, the router's socket) come from front_settings.lua, written at start.
--
-- A try is bounded (every one but the last the lane may make): it gets the stall time, or STALL_FACTOR times the
-- pin's usual answer time when that is longer, to answer; past it the replica is held out like one whose
-- connection failed and the request goes to the next replica. So a hung replica (stopped, or its loop blocked)
-- costs a request one bound, not its deadline. A pin not answered yet (its model may be loading) is not bounded.
--
-- With a quota store (settings.store: SHARDLINE_TENANCY_QUOTA_STORE) the tenants' rate and concurrency are held in
-- Redis for every router and its lane together, by the router's own scripts (online/quota_store.py's ADMIT and
-- RENEW, their text and SHA1 in the settings; EVALSHA, EVAL when Redis does not have them): the same local
-- allowance of rate tokens, a lease per request in flight (released from the log phase by a timer: no cosocket
-- there; renewed every third of its TTL while the request runs). On any Redis error (refused, reset, no answer
-- within STORE_TIMEOUTS) the lane holds 1/N of each quota in this worker (quota.share) for settings.store.retry
-- seconds, counts each request so admitted and tells the router in GET /counts ("store" line); no request fails
-- because of Redis.
local ffi = require "ffi"
local balancer = require "ngx.balancer"

local ngx = ngx
local var = ngx.var
local now = ngx.now
local ceil, max, min = math.ceil, math.max, math.min
local concat = table.concat

ffi.cdef [[unsigned char *SHA256(const unsigned char *d, size_t n, unsigned char *md);
int RAND_bytes(unsigned char *buf, int num);]]
local crypto
do
  local ok, lib = pcall(ffi.load, "libcrypto.so.3")
  crypto = ok and lib or ffi.C
end
local digest = ffi.new("unsigned char[32]")
local HEX = {}
for i = 0, 255 do HEX[i] = string.format("%02x", i) end

local settings = require "front_settings"
local store = settings.store
local redis = store and require "nginx.redis"  -- Debian's lua-nginx-redis (lua-resty-redis)
local S = {pins = {}, replicas = {}, order = {}, active = nil, retries_off = false, generation = 0}

local known, known_n = {}, 0    -- an Authorization header -> its tenant, or false (a key's digest is a pure function)
local busy = {}                 -- tenant -> its requests in flight (both lanes)
local buckets = {}              -- tenant -> {tokens, at}
local pin_busy, pin_taken = {}, {}
local replica_busy, replica_taken = {}, {}  -- replica url -> fast-lane requests in flight, tries sent
local group_taken, group_retried = {}, {}
local refused = {}              -- "tenant quota" -> requests refused over that quota (429), since nginx started
local failed_until = {}         -- replica url -> until when a failed connection keeps it out
local pin_ms = {}               -- pin -> its answers' moving average, ms (each answer weighs EWMA)
local STALL_FACTOR, EWMA = 8, 0.1
local STORE_TIMEOUTS = {50, 250, 250}  -- ms: connect, send, read (a pooled connection skips the connect)
local STORE_POOL, STORE_IDLE_MS = 64, 10000
local allowances = {}           -- tenant -> rate tokens taken from Redis and not yet spent (quota_store.allowance)
local refilling = {}            -- tenant -> true while a request refills its allowance (one at a time)
local leases = {}               -- tenant -> {lease -> true}: this worker's leases in Redis, renewed while held
local lease_prefix, lease_n = nil, 0
local store_down_until, store_down = 0, false
local store_fallbacks, store_outages = 0, 0

local _M = {}

local function tenant_of(auth)
  local found = known[auth]
  if found ~= nil then return found end
  found = false
  local key = auth:match("^[Bb][Ee][Aa][Rr][Ee][Rr] +(.+)$")
  if key then
    crypto.SHA256(key, #key, digest)
    local hex = {}
    for i = 0, 31 do hex[i + 1] = HEX[digest[i]] end
    found = settings.tenants[concat(hex)] or false
  end
  if known_n >= 10000 then known, known_n = {}, 0 end
  known[auth], known_n = found, known_n + 1
  return found
end

local function refuse(message, wait, tenant, quota)
  local counted = tenant .. " " .. quota
  refused[counted] = (refused[counted] or 0) + 1
  local body
  local uri = var.uri
  if uri:sub(1, 4) == "/v1/" and uri:sub(-8) ~= ":predict" then  -- OpenAI's form; KServe V1's predict takes V2's
    body = '{"error": {"message": "' .. message .. '", "type": "rate_limit_error", "param": null, '
        .. '"code": "rate_limit_exceeded"}}'
  else
    body = '{"error": "' .. message .. '"}'
  end
  ngx.status = 429
  local header = ngx.header
  header["Content-Type"] = "application/json"
  header["Retry-After"] = tostring(wait)
  local id = var.http_x_request_id
  if id and id ~= "" then header["X-Request-Id"] = id end
  ngx.print(body)
  return ngx.exit(ngx.HTTP_OK)
end

-- The tenant's quotas in this worker (TenantGate's order and messages: concurrency, then a token of the rate):
-- the whole quota, or with a quota store its share while Redis cannot be reached. Returns whether it admitted.
local function admit_here(tenant, quota, held)
  if quota.most > 0 and held >= quota.most then
    refuse("tenant '" .. tenant .. "' has " .. held .. " requests in flight, its max_concurrent; "
           .. "wait for one to finish or ask for a larger quota", 1, tenant, "concurrency")
    return false
  end
  local rate = quota.rate
  if rate > 0 then
    local t = now()
    local b = buckets[tenant]
    if b == nil then
      b = {tokens = quota.burst, at = t}
      buckets[tenant] = b
    elseif t > b.at then
      b.tokens = min(quota.burst, b.tokens + (t - b.at) * rate)
      b.at = t
    end
    if b.tokens < 1 then
      local wait = max(1, ceil((1 - b.tokens) / rate))
      refuse("tenant '" .. tenant .. "' is over its rate of " .. quota.shown .. " requests/s (burst "
             .. settings.quotas[tenant].burst .. "); retry after " .. wait .. " s", wait, tenant, "rate")
      return false
    end
    b.tokens = b.tokens - 1
  end
  return true
end

-- A connection to the quota store (pooled: set_keepalive once answered), or nil, err.
local function store_connect()
  local red, err = redis:new()
  if not red then return nil, err end
  red._sock:settimeouts(STORE_TIMEOUTS[1], STORE_TIMEOUTS[2], STORE_TIMEOUTS[3])
  local ok
  ok, err = red:connect(store.host, store.port, {pool_size = STORE_POOL})
  if not ok then return nil, err end
  if red:get_reused_times() == 0 then  -- a new connection: its credentials and database
    if store.password then
      if store.username then ok, err = red:auth(store.username, store.password)
      else ok, err = red:auth(store.password) end
      if not ok then red:close() return nil, err end
    end
    if store.db ~= 0 then
      ok, err = red:select(store.db)
      if not ok then red:close() return nil, err end
    end
  end
  return red
end

-- One of the router's scripts (store[name], store[name .. "_sha"]) on a connection: EVALSHA, EVAL when Redis does
-- not have it (started anew, or SCRIPT FLUSH). Returns its answer, or nil, err (the connection closed).
local function store_script(red, name, nkeys, ...)
  local res, err = red:evalsha(store[name .. "_sha"], nkeys, ...)
  if not res and err and err:sub(1, 8) == "NOSCRIPT" then res, err = red:eval(store[name], nkeys, ...) end
  if not res then
    red:close()
    return nil, err
  end
  red:set_keepalive(STORE_IDLE_MS, STORE_POOL)
  return res
end

local function new_lease()
  if not lease_prefix then
    local bytes = ffi.new("unsigned char[8]")
    if crypto.RAND_bytes(bytes, 8) ~= 1 then
      for i = 0, 7 do bytes[i] = math.random(0, 255) end
    end
    local hex = {}
    for i = 0, 7 do hex[i + 1] = HEX[bytes[i]] end
    lease_prefix = "nginx-" .. concat(hex) .. "-"
  end
  lease_n = lease_n + 1
  return lease_prefix .. lease_n
end

-- The tenant's rate and concurrency in Redis (QuotaStore.admit's steps and messages). Returns true (admitted),
-- false (refused: answered), or nil, err (Redis did not answer: the caller holds the share here). A token of the
-- local allowance is taken before the call (others run while it waits) and given back if the request is not
-- admitted by Redis; tokens Redis gives are added to what the allowance holds then. One request at a time refills
-- the allowance; the others meanwhile ask for their own token, so what the lane holds unspent stays under one.
local function admit_shared(tenant, quota)
  local want, refill = 0, false
  local have = allowances[tenant] or 0
  local mine = quota.rate > 0 and have > 0  -- a token of the allowance taken here
  if mine then
    allowances[tenant] = have - 1
  elseif quota.rate > 0 and refilling[tenant] then
    want = 1  -- another request refills the allowance: this one asks for its own token only
  elseif quota.rate > 0 then
    want, refill = quota.allowance, true
  end
  if want == 0 and quota.most == 0 then return true end
  local lease = quota.most > 0 and new_lease() or ""
  if refill then refilling[tenant] = true end
  local red, err = store_connect()
  local res
  if red then
    res, err = store_script(red, "admit", 2, quota.keys.rate, quota.keys.inflight, quota.rate, quota.burst, want,
                            quota.most, lease, store.lease_ttl_ms)
  end
  if refill then refilling[tenant] = nil end
  local status, value = res and tonumber(res[1]), res and tonumber(res[2])
  if not res or status == -1 then
    if mine then allowances[tenant] = (allowances[tenant] or 0) + 1 end
    if not res then return nil, err end
    refuse("tenant '" .. tenant .. "' has " .. value .. " requests in flight, its max_concurrent; "
           .. "wait for one to finish or ask for a larger quota", 1, tenant, "concurrency")
    return false
  elseif status == -2 then
    local wait = max(1, ceil(value))
    refuse("tenant '" .. tenant .. "' is over its rate of " .. quota.shown .. " requests/s (burst "
           .. quota.burst .. "); retry after " .. wait .. " s", wait, tenant, "rate")
    return false
  end
  if want > 0 then allowances[tenant] = (allowances[tenant] or 0) + status - 1 end
  if lease ~= "" then
    local held = leases[tenant]
    if not held then
      held = {}
      leases[tenant] = held
    end
    held[lease] = true
    var.sl_lease = lease
  end
  return true
end

-- The tenant's quotas: in Redis with a quota store (its share here while Redis cannot be reached), else this
-- worker's; an admitted request is counted in flight until its log phase. Returns whether it was admitted.
local function admit(tenant)
  local quota = settings.quotas[tenant]
  local held = busy[tenant] or 0
  if quota then
    local admitted, err
    if store and now() >= store_down_until then
      admitted, err = admit_shared(tenant, quota)
      if admitted == nil then
        if not store_down then
          store_down, store_outages = true, store_outages + 1
          ngx.log(ngx.WARN, "shardline: quota store ", store.host, ":", store.port, " unreachable (", err,
                  "): this lane holds 1/", store.routers, " of every quota until it answers")
        end
        store_down_until = now() + store.retry
      elseif store_down then
        store_down = false
        ngx.log(ngx.NOTICE, "shardline: quota store ", store.host, ":", store.port, " answers again")
      end
    end
    if admitted == nil then
      admitted = admit_here(tenant, store and quota.share or quota, held)
      if admitted and store then store_fallbacks = store_fallbacks + 1 end
    end
    if not admitted then return false end
  end
  busy[tenant] = held + 1
  var.sl_tenant = tenant
  return true
end

-- Every request but a fast-lane candidate's: the tenant's quotas when its key is known (the router answers an
-- unknown key: 401 in the protocol's form).
function _M.gate()
  local auth = var.http_authorization
  if auth then
    local tenant = tenant_of(auth)
    if tenant then admit(tenant) end
  end
end

local function usable(url, t)
  local r = S.replicas[url]
  return r and r.up and (failed_until[url] or 0) <= t
end

local function any_usable(order, t)
  if order then
    for i = 1, #order do
      if usable(order[i], t) then return true end
    end
  end
  return false
end

-- POST /v2/models/{name}/infer (and KServe V1's /v1/models/{name}:predict): the fast lane when the tenant's model
-- is pinned and nothing in the request is the router's to see; else on to the router (quotas held either way).
-- The pin (name/versions/V) goes between the path's head and tail.
local function fast(head, tail)
  local auth = var.http_authorization
  local tenant = auth and tenant_of(auth)
  if not tenant then return ngx.exec("@router") end
  if not admit(tenant) then return end
  local length = tonumber(var.http_content_length)
  if not length or length > settings.fast_body or ngx.req.get_method() ~= "POST" or var.http_transfer_encoding
      or var.http_x_shardline_timeout_ms or var.http_x_shardline_route_key then
    return ngx.exec("@router")
  end
  local pin = S.pins[tenant .. "/" .. var[1]]
  if not pin or not any_usable(S.order[pin], now()) then return ngx.exec("@router") end
  pin_busy[pin] = (pin_busy[pin] or 0) + 1
  pin_taken[pin] = (pin_taken[pin] or 0) + 1
  var.sl_pin = pin
  local args = var.args
  var.sl_uri = args and (head .. pin .. tail .. "?" .. args) or (head .. pin .. tail)
  if S.retries_off then return ngx.exec("@fast_conn") end
end

function _M.infer() return fast("/v2/models/", "/infer") end

function _M.predict() return fast("/v1/models/", ":predict") end

-- placement.choose: the first of the pin's order (the router's rendezvous order) not yet tried whose requests in
-- flight are under ceil(c * (total + 1) / n) over those eligible; with none eligible, a usable one tried already
-- (a replica that answered 502-504 is tried again); nil when none is usable.
local function pick(order, tried, t)
  local eligible, total = {}, 0
  for i = 1, #order do
    local url = order[i]
    if not tried[url] and usable(url, t) then
      eligible[#eligible + 1] = url
      total = total + (replica_busy[url] or 0)
    end
  end
  if #eligible == 0 then
    for i = 1, #order do
      if usable(order[i], t) then return order[i] end
    end
    return nil
  end
  local bound = max(1, ceil(settings.balance * (total + 1) / #eligible))
  for i = 1, #eligible do
    if (replica_busy[eligible[i]] or 0) < bound then return eligible[i] end
  end
  return eligible[1]
end

-- The time a try may take to answer: bounded for all but the last try (see the top).
local function read_timeout(pin, tries)
  local usual = pin_ms[pin]
  if tries > settings.retries or settings.stall <= 0 or usual == nil then return settings.request_timeout end
  return max(settings.stall, STALL_FACTOR * usual / 1000)
end

function _M.balance()
  local ctx = ngx.ctx
  local t = now()
  if ctx.tried == nil then
    ctx.tried, ctx.group, ctx.tries = {}, S.active or "none", 0
    balancer.set_more_tries(settings.retries)
    group_taken[ctx.group] = (group_taken[ctx.group] or 0) + 1
  else
    local last = ctx.replica  -- nil: the last try was the router's
    if last then
      replica_busy[last] = (replica_busy[last] or 1) - 1
      ctx.replica = nil
      if balancer.get_last_failure() == "failed" then failed_until[last] = t + settings.hold end
    end
    group_retried[ctx.group] = (group_retried[ctx.group] or 0) + 1
  end
  local pin = var.sl_pin
  local url = pick(S.order[pin] or {}, ctx.tried, t)
  local replica = url and S.replicas[url]
  ctx.tries = ctx.tries + 1
  balancer.set_timeouts(nil, nil, replica and read_timeout(pin, ctx.tries) or settings.request_timeout)
  if not replica then
    -- No replica is usable (all failed to connect, or the router has just taken them out): the router, as the
    -- request was rewritten (its key and the tenant), answers or fails over with its own view.
    local ok, err = balancer.set_current_peer(settings.router)
    if not ok then
      ngx.log(ngx.ERR, "shardline: cannot send to the router: ", err)
      return ngx.exit(ngx.ERROR)
    end
    return
  end
  ctx.tried[url], ctx.replica = true, url
  replica_busy[url] = (replica_busy[url] or 0) + 1
  replica_taken[url] = (replica_taken[url] or 0) + 1
  local ok, err = balancer.set_current_peer(replica.ip, replica.port)
  if not ok then
    ngx.log(ngx.ERR, "shardline: cannot send to ", url, ": ", err)
    return ngx.exit(ngx.ERROR)
  end
end

-- Leases given back to Redis by a timer (the log phase has no cosockets): those the requests that ended meanwhile
-- gave back, one ZREM per tenant; best effort, a lease Redis does not hear about expires by itself.
local releasing, release_due = {}, false  -- lease set key -> its leases to give back; whether a timer is due

local function release(premature)
  local due = releasing
  releasing, release_due = {}, false
  if now() < store_down_until then return end
  for key, ids in pairs(due) do
    for i = 1, #ids, 1000 do
      local red = store_connect()
      if not red then return end
      if red:zrem(key, unpack(ids, i, min(#ids, i + 999))) then red:set_keepalive(STORE_IDLE_MS, STORE_POOL)
      else red:close() end
    end
  end
end

-- Every third of the lease TTL: the leases of the requests this worker still holds, renewed (RENEW).
local function renew(premature)
  if premature then return end
  local due = {}  -- {lease set key, its leases}, listed before the first call yields (requests go on meanwhile)
  for tenant, held in pairs(leases) do
    local ids = {}
    for lease in pairs(held) do ids[#ids + 1] = lease end
    if #ids == 0 then leases[tenant] = nil else due[#due + 1] = {settings.quotas[tenant].keys.inflight, ids} end
  end
  for _, set in ipairs(due) do
    local key, ids = set[1], set[2]
    for i = 1, #ids, 1000 do  -- again next round when Redis does not answer; the requests go on regardless
      local red = store_connect()
      if not red or not store_script(red, "renew", 1, key, store.lease_ttl_ms, unpack(ids, i, min(#ids, i + 999)))
      then return end
    end
  end
end

-- The worker's start (init_worker_by_lua): with a quota store, the leases' renewal.
function _M.start()
  if store then ngx.timer.every(store.lease_ttl_ms / 3000, renew) end
end

function _M.done()
  local tenant = var.sl_tenant
  if tenant ~= "" then
    busy[tenant] = (busy[tenant] or 1) - 1
    local lease = var.sl_lease
    if lease ~= "" then
      local held = leases[tenant]
      if held then held[lease] = nil end
      local key = settings.quotas[tenant].keys.inflight
      local ids = releasing[key]
      if ids then ids[#ids + 1] = lease else releasing[key] = {lease} end
      if not release_due then release_due = ngx.timer.at(0, release) and true or false end
    end
  end
  local pin = var.sl_pin
  if pin ~= "" then
    pin_busy[pin] = (pin_busy[pin] or 1) - 1
    if ngx.status == 200 then  -- the last try's time: what the replicas take to answer the pin
      local took = tonumber((var.upstream_response_time or ""):match("([%d.]+)$"))
      if took then
        local usual = pin_ms[pin]
        pin_ms[pin] = usual and usual + EWMA * (took * 1000 - usual) or took * 1000
      end
    end
  end
  local url = ngx.ctx.replica
  if url then replica_busy[url] = (replica_busy[url] or 1) - 1 end
end

local function apply(new)
  S = new
end

-- The router's socket: POST /state (a Lua table literal, read as data: no globals), GET /counts.
function _M.control()
  local uri = var.uri
  if uri == "/state" then
    ngx.req.read_body()
    local chunk, err = loadstring(ngx.req.get_body_data() or "", "=state")
    if not chunk then
      ngx.status = 400
      return ngx.say(err)
    end
    setfenv(chunk, {})
    local ok, new = pcall(chunk)
    if not ok or type(new) ~= "table" then
      ngx.status = 400
      return ngx.say("not a state: ", tostring(new))
    end
    apply(new)
    return ngx.say("generation ", S.generation)
  elseif uri == "/counts" then
    local t = now()
    local lines = {"generation " .. S.generation}
    for pin, n in pairs(pin_taken) do lines[#lines + 1] = "pin " .. pin .. " " .. (pin_busy[pin] or 0) .. " " .. n end
    for url, r in pairs(S.replicas) do
      lines[#lines + 1] = "replica " .. url .. " " .. (replica_busy[url] or 0) .. " " .. (usable(url, t) and 1 or 0)
          .. " " .. (replica_taken[url] or 0)
    end
    for group, n in pairs(group_taken) do
      lines[#lines + 1] = "group " .. group .. " " .. n .. " " .. (group_retried[group] or 0)
    end
    for counted, n in pairs(refused) do lines[#lines + 1] = "refused " .. counted .. " " .. n end
    if store then  -- requests admitted on this lane's share while Redis was unreachable, outages, Redis up now
      lines[#lines + 1] = "store " .. store_fallbacks .. " " .. store_outages .. " " .. (store_down and 0 or 1)
    end
    return ngx.say(concat(lines, "\n"))
  end
  return ngx.exit(404)
end

return _M
