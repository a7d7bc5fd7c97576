"""A prototype, not the product: the router's fast lane written for nginx with LuaJIT instead of HAProxy,
measured beside the rest by ``bench/router_overhead.py --prototype`` (docs/routing.md, "Not built yet").

One ``access_by_lua`` handler does the fast lane's per-request work: the key's sha256 (OpenSSL through
LuaJIT's FFI, remembered per key: a pure function of it, so the digest is still looked up every time)
looked up among the tenants file's digests, the tenant's requests in flight against its
``max_concurrent`` and a token bucket at its rate, the model's version pinned, the model's requests in
flight counted; then ``hash ... consistent`` over the replicas, upstream keep-alive, retries on another
replica after a failed connection or a 502-504, and the router's key and the tenant passed on. One
worker process: the quotas are plain Lua tables, global without a lock (with two workers, shared
dictionaries and the digest computed every time, it cost 30-60 us more CPU a request at 100/s; one
worker relays far more than this machine's replicas answer). What it leaves out of the product's fast
lane: bounded loads, health checks, the control plane's updates and counts, the protocol's error bodies.

Needs Debian's ``nginx-light`` and ``libnginx-mod-http-lua`` (with ``lua-resty-core``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

MODULES = Path("/usr/lib/nginx/modules")


def available() -> bool:
    """Whether nginx's Lua module is installed."""
    return (MODULES / "ngx_http_lua_module.so").exists() and (MODULES / "ndk_http_module.so").exists()


def _lua_table(entries: dict[str, str]) -> str:
    return "{" + ", ".join(f'["{k}"] = {v}' for k, v in entries.items()) + "}"


def config(port: int, replicas: list[int], folder: Path, tenants_file: str, router_key: str) -> Path:
    """nginx's configuration for the prototype over the replicas; every model a tenant may call is pinned
    as its name (the replicas resolve it, as they do for direct calls)."""
    tenants = yaml.safe_load(Path(tenants_file).read_text())["tenants"]
    digests = {d: f'"{t["name"]}"' for t in tenants for d in t.get("api_keys_sha256", [])}
    quotas = {t["name"]: "{rate = %s, burst = %s, most = %s}" % (
        (t.get("rate") or {}).get("requests_per_second", 0), (t.get("rate") or {}).get("burst", 0),
        t.get("max_concurrent") or 0) for t in tenants}
    pins = {f'{t["name"]}/{m.split("@")[0]}': f'"{m.split("@")[0]}"' for t in tenants for m in t.get("models", [])}
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=1s;" for p in replicas)
    text = textwrap.dedent("""\
        load_module {modules}/ndk_http_module.so;
        load_module {modules}/ngx_http_lua_module.so;
        worker_processes 1;
        pid {folder}/nginx-lua.pid;
        error_log {folder}/nginx-lua-error.log warn;
        daemon off;
        events {{ worker_connections 4096; }}
        http {{
            access_log off;
            client_body_temp_path {folder}/body-lua;
            proxy_temp_path {folder}/proxy-lua;
            init_by_lua_block {{
                local ffi = require "ffi"
                ffi.cdef[[unsigned char *SHA256(const unsigned char *d, size_t n, unsigned char *md);]]
                crypto = ffi.load("libcrypto.so.3")
                digest = ffi.new("unsigned char[32]")
                hex = {{}}
                for i = 0, 255 do hex[i] = string.format("%02x", i) end
                known, known_n, inflight, buckets = {{}}, 0, {{}}, {{}}
                tenants = {digests}
                quotas = {quotas}
                pins = {pins}
            }}
            upstream plain {{
        {servers}
                keepalive 64;
            }}
            upstream pinned {{
                hash $pin consistent;
        {servers}
                keepalive 64;
            }}
            server {{
                listen 127.0.0.1:{port};
                location / {{
                    proxy_pass http://plain;
                    proxy_http_version 1.1;
                    proxy_set_header Connection "";
                }}
                location ~ ^/v2/models/([^/]+)/infer$ {{
                    set $pin "";
                    set $tenant "";
                    access_by_lua_block {{
                        local key = string.match(ngx.var.http_authorization or "", "^[Bb]earer +(.+)$")
                        if not key then return ngx.exit(401) end
                        local sha = known[key]
                        if not sha then
                            crypto.SHA256(key, #key, digest)
                            local parts = {{}}
                            for i = 0, 31 do parts[i + 1] = hex[digest[i]] end
                            sha = table.concat(parts)
                            if known_n >= 10000 then known, known_n = {{}}, 0 end
                            known[key], known_n = sha, known_n + 1
                        end
                        local tenant = tenants[sha]
                        if not tenant then return ngx.exit(401) end
                        local quota = quotas[tenant]
                        local n = (inflight[tenant] or 0) + 1
                        inflight[tenant] = n
                        ngx.ctx.tenant = tenant
                        if quota.most > 0 and n > quota.most then return ngx.exit(429) end
                        if quota.rate > 0 then
                            local now = ngx.now()
                            local b = buckets[tenant]
                            if not b then
                                b = {{tokens = quota.burst, at = now}}
                                buckets[tenant] = b
                            end
                            b.tokens = math.min(quota.burst, b.tokens + (now - b.at) * quota.rate)
                            b.at = now
                            if b.tokens < 1 then return ngx.exit(429) end
                            b.tokens = b.tokens - 1
                        end
                        local pin = pins[tenant .. "/" .. ngx.var[1]]
                        if not pin then return ngx.exit(404) end
                        inflight[pin] = (inflight[pin] or 0) + 1
                        ngx.ctx.pin = pin
                        ngx.var.pin = pin
                        ngx.var.tenant = tenant
                    }}
                    log_by_lua_block {{
                        local ctx = ngx.ctx
                        if ctx.tenant then inflight[ctx.tenant] = inflight[ctx.tenant] - 1 end
                        if ctx.pin then inflight[ctx.pin] = inflight[ctx.pin] - 1 end
                    }}
                    proxy_set_header Authorization "Bearer {router_key}";
                    proxy_set_header X-Shardline-Tenant $tenant;
                    proxy_set_header Connection "";
                    proxy_http_version 1.1;
                    proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;
                    proxy_pass http://pinned/v2/models/$pin/infer;
                }}
            }}
        }}
    """).format(modules=MODULES, folder=folder, digests=_lua_table(digests), quotas=_lua_table(quotas),
                pins=_lua_table(pins), servers=servers, port=port, router_key=router_key)
    path = folder / "nginx-lua.conf"
    path.write_text(text)
    return path
