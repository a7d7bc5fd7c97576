"""The router's data plane (docs/routing.md, "The data plane"): whether nginx runs in front, the requests its
fast lane takes, the pins the router gives it, and its own errors.

nginx with its Lua module (``nginx_edge``) runs in front where it is installed; without it the router relays
every request itself.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.errors import InvalidSetting
from shardline.storage import rollouts

if TYPE_CHECKING:
    from shardline.online.router.router import Router

log = logging.getLogger(__name__)

FAST_BODY_BYTES = 24 * 1024  # larger bodies go to the router, which streams them
SYNC_S = 0.5  # how often the router brings its data plane up to date and reads its counts
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # a model name the fast lane takes (others a path carries escaped)
MODULES = Path("/usr/lib/nginx/modules")
LUA_MODULES = ("ndk_http_module.so", "ngx_http_lua_module.so")
RESTY_CORE = Path("/usr/share/lua/5.1/resty/core.lua")  # lua-resty-core, which the Lua module needs
# The data plane's own errors, in the V2 form: status -> (message, whether it says Retry-After: 1).
ERRORS = {
    400: ("the request is not valid HTTP/1.1; check the client", False),
    408: ("the request took too long to arrive; send it again", False),
    500: ("the router's data plane could not send the request on; retry after the Retry-After seconds", True),
    502: ("no replica gave a valid answer; retry after the Retry-After seconds", True),
    503: ("no replica can take the request now (none is up, or every one tried failed); retry after the "
          "Retry-After seconds", True),
    504: ("no replica answered within the deadline; retry, or send a longer x-shardline-timeout-ms", False),
}


def find_nginx() -> str | None:
    """The nginx executable, when it and its Lua module (with lua-resty-core) are installed; else None."""
    found = shutil.which("nginx")
    if found is None and os.access("/usr/sbin/nginx", os.X_OK):
        found = "/usr/sbin/nginx"
    if found is None or not all((MODULES / m).exists() for m in LUA_MODULES) or not RESTY_CORE.exists():
        return None
    return found


def choose_data_plane(setting: str) -> str | None:
    """The nginx executable the router puts in front of itself (with its Lua module); None for the router alone.

    Raises:
        InvalidSetting: ``nginx`` asked for and not installed.
    """
    if setting == "python":
        return None
    nginx = find_nginx()
    if nginx is not None:
        return nginx
    if setting == "nginx":
        raise InvalidSetting("SHARDLINE_ROUTER_DATA_PLANE=nginx but nginx or its Lua module is not installed: "
                             "apt-get install nginx-light libnginx-mod-http-lua (Debian's packages), or set it "
                             "to auto or python")
    log.warning("nginx with its Lua module is not installed: the router relays every request itself (slower: "
                "docs/routing.md); apt-get install nginx-light libnginx-mod-http-lua to put nginx in front")
    return None


def desired_pins(router: Router) -> dict[str, str]:
    """``tenant/model`` -> ``model/versions/V`` for each model a tenant calls whose version the router would
    pin the same for every caller now: none while the router hedges or has the activator (scaled to zero);
    for an alias, only once read and while no rollout runs on it; none for a model with a fallback variant."""
    if router.settings.hedge_after_ms > 0 or router.activator is not None:
        return {}
    book = router.rollouts
    fallbacks = {model for model, _ in router.fallbacks}
    pins = {}
    for tenant in router.tenants.tenants.values():
        for name, ref in tenant.models.items():
            if name in fallbacks or not PLAIN_NAME.match(name):
                continue  # a name a path would carry escaped: the router's
            version = ref.version
            if version is None:
                move = book.moves.get((name, ref.alias or "prod")) if book is not None else None
                if move is None or rollouts.active(move) is not None:
                    continue
                version = move.version
            pins[f"{tenant.name}/{name}"] = f"{name}/versions/{version}"
    return pins
