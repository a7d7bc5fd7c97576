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
local ffi = require "ffi"
local balancer = require "ngx.balancer"

local ngx = ngx
local var = ngx.var
local now = ngx.now
local ceil, max, min = math.ceil, math.max, math.min
local concat = table.concat

ffi.cdef [[unsigned char *SHA256(const unsigned char *d, size_t n, unsigned char *md);]]
local crypto
do
  local ok, lib = pcall(ffi.load, "libcrypto.so.3")
  crypto = ok and lib or ffi.C
end
local digest = ffi.new("unsigned char[32]")
local HEX = {}
for i = 0, 255 do HEX[i] = string.format("%02x", i) end

local settings = require "front_settings"
local S = {pins = {}, replicas = {}, order = {}, active = nil, retries_off = false, generation = 0}

local known, known_n = {}, 0    -- an Authorization header -> its tenant, or false (a key's digest is a pure function)
local busy = {}                 -- tenant -> its requests in flight (both lanes)
local buckets = {}              -- tenant -> {tokens, at}
local pin_busy, pin_taken = {}, {}
local replica_busy, replica_taken = {}, {}  -- replica url -> fast-lane requests in flight, tries sent
local group_taken, group_retried = {}, {}
local failed_until = {}         -- replica url -> until when a failed connection keeps it out
local pin_ms = {}               -- pin -> its answers' moving average, ms (each answer weighs EWMA)
local STALL_FACTOR, EWMA = 8, 0.1

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

local function refuse(message, wait)
  local body
  if var.uri:sub(1, 4) == "/v1/" then
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

-- The tenant's quotas (TenantGate's order and messages: concurrency, then a token of the rate); an admitted
-- request is counted in flight until its log phase. Returns whether it was admitted.
local function admit(tenant)
  local quota = settings.quotas[tenant]
  local held = busy[tenant] or 0
  if quota then
    if quota.most > 0 and held >= quota.most then
      refuse("tenant '" .. tenant .. "' has " .. held .. " requests in flight, its max_concurrent; "
             .. "wait for one to finish or ask for a larger quota", 1)
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
               .. quota.burst .. "); retry after " .. wait .. " s", wait)
        return false
      end
      b.tokens = b.tokens - 1
    end
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

-- POST /v2/models/{name}/infer: the fast lane when the tenant's model is pinned and nothing in the request is
-- the router's to see; else on to the router (quotas held either way).
function _M.infer()
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
  var.sl_uri = args and ("/v2/models/" .. pin .. "/infer?" .. args) or ("/v2/models/" .. pin .. "/infer")
  if S.retries_off then return ngx.exec("@fast_conn") end
end

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

function _M.done()
  local tenant = var.sl_tenant
  if tenant ~= "" then busy[tenant] = (busy[tenant] or 1) - 1 end
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
    return ngx.say(concat(lines, "\n"))
  end
  return ngx.exit(404)
end

return _M
