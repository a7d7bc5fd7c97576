"""The proxy in front of the router (docs/routing.md, "The data plane"): what every front does (``Front``: start,
stop, sync), the requests its fast lane takes, the pins the router gives it, and its own errors.

nginx with its Lua module (``nginx_front``) is the one front, where it is installed; without it the router relays
every request itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from shardline.storage import rollouts

if TYPE_CHECKING:
    from shardline.online.router.router import Router

FAST_BODY_BYTES = 24 * 1024  # larger bodies go to the router, which streams them
SYNC_S = 0.5  # how often the router brings its front up to date and reads its counts
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # a model name the fast lane takes (others a path carries escaped)
# The front's own errors, in the V2 form: status -> (message, whether it says Retry-After: 1). nginx's own 494 (a
# request head past its buffers, which it would answer as a 400 HTML page) is answered as serve answers it: 431.
ERRORS = {
    400: ("the request is not valid HTTP/1.1; check the client", False),
    494: ("the request's head is too large (a header line over 64 KiB, or too many headers); send fewer or "
          "shorter headers", False),
    408: ("the request took too long to arrive; send it again", False),
    500: ("the router's data plane could not send the request on; retry after the Retry-After seconds", True),
    502: ("no replica gave a valid answer; retry after the Retry-After seconds", True),
    503: ("no replica can take the request now (none is up, or every one tried failed); retry after the "
          "Retry-After seconds", True),
    504: ("no replica answered within the deadline; retry, or send a longer x-shardline-timeout-ms", False),
}
ANSWERED_AS = {494: 431}  # an error above answered with another status


class Front(Protocol):
    """A proxy the router starts in front of itself on its listening socket: it takes the fast lane's requests and
    passes the rest to the router on ``router_socket``; the router keeps it true (``sync`` every ``SYNC_S``,
    ``sync_pins`` whenever the rollouts were read) and stops it when it stops."""

    @property
    def folder(self) -> Path:
        """Its private folder (configuration, sockets, log), removed once it has stopped."""

    @property
    def router_socket(self) -> Path:
        """The unix socket the router serves on behind it."""

    def start(self) -> None:
        """Start it on the router's listening socket.

        Raises:
            InvalidSetting: it refused its configuration or did not start.
        """

    def stop(self) -> None:
        """Stop it, letting it finish the requests it holds. Twice is harmless."""

    async def sync(self, router: Router) -> None:
        """Bring it up to date with the router and read its counts back (one that exited is started again)."""

    async def sync_pins(self, router: Router) -> None:
        """Push the pins and the replicas' state now, when they changed."""


def desired_pins(router: Router) -> dict[str, str]:
    """``tenant/model`` -> ``model/versions/V`` for each model a tenant calls whose version the router would
    pin the same for every caller now: none while the router hedges or has the activator (scaled to zero);
    for an alias, only once read and while no rollout runs on it; none for a model with a fallback variant;
    none for a tenant past its budget's soft limit (its requests go to the router, which refuses them at the hard
    limit and sends them to the model's cheaper group at the soft one: ``Router._check_budget``)."""
    if router.settings.hedge_after_ms > 0 or router.activator is not None:
        return {}
    book = router.rollouts
    fallbacks = {model for model, _ in router.fallbacks}
    degraded = {name for name, state in router.budgets.states.items() if state.state in ("soft", "hard")}
    pins = {}
    for tenant in router.tenants.tenants.values():
        if tenant.name in degraded:
            continue
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
