"""A hung replica under load: what a request waits when one of three replicas stops answering.

Three `shardline serve` replicas (defaults, the router's key digest, as behind any router) serve the
breast-cancer classifier (bench/online_latency.py's data). Each series sends 200 requests/s, open loop (each
request at its intended time; latency from that time), for 8 s, and 1 s in the replica that the series sends
most to is stopped with SIGSTOP for 5 s (its socket still takes connections; nothing answers), then continued:

- **router**: `shardline router --config router.yaml` over the three, on its defaults (nginx in front where its
  Lua module is installed: the fast lane bounds a try by the stall time; printed);
- **router alone**: the same with SHARDLINE_ROUTER_DATA_PLANE=python (the router's own lane: a stalled try's
  replica is probed and, hung, taken out, its requests moved);
- **router, stall off**: SHARDLINE_ROUTER_STALL_MS=0, what the router did before (a try waits for its deadline);
- **nginx, tuned**: what a user would put in front instead: Debian's nginx over the three with
  `proxy_read_timeout 1s` and `proxy_next_upstream error timeout non_idempotent` (the plain default, 60 s and
  no retry of a POST, would wait out the stop).

Printed per series: answers by status, p50, p99 and the slowest, and the slowest as a ratio of the tuned
nginx's. Target (issue 33): every answer 200 and none slower than 1 s through the router.

    .venv/bin/python bench/hung_replica.py      # about 2 minutes

Data and logs: bench/.data/hung/ (git-ignored).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import signal
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import online_latency as ol  # noqa: E402
from router_overhead import ROUTER_KEY, TENANT  # noqa: E402

from shardline.local_ports import reserve_port  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "hung"
RATE, SECONDS, STOP_AT, STOP_FOR = 200, 8.0, 1.0, 5.0


def tuned_nginx_config(port: int, replicas: list[int], folder: Path) -> Path:
    """nginx over the replicas as a user who expects a replica to hang would set it: a 1 s read time-out and
    retries of POSTs on a time-out."""
    upstream = "\n".join(f"        server 127.0.0.1:{p};" for p in replicas)
    path = folder / "nginx.conf"
    path.write_text(textwrap.dedent(f"""\
        worker_processes auto;
        pid {folder}/nginx.pid;
        error_log {folder}/nginx-error.log warn;
        daemon off;
        events {{ worker_connections 4096; }}
        http {{
            access_log off;
            client_body_temp_path {folder}/body;
            proxy_temp_path {folder}/proxy;
            upstream replicas {{
        {upstream}
                keepalive 64;
            }}
            server {{
                listen 127.0.0.1:{port};
                location / {{
                    proxy_pass http://replicas;
                    proxy_http_version 1.1;
                    proxy_set_header Connection "";
                    proxy_read_timeout 1s;
                    proxy_next_upstream error timeout non_idempotent;
                }}
            }}
        }}
    """))
    return path


async def open_loop(port: int, path: str, body: str, headers: dict[str, str], seconds: float,
                    during: Any = None) -> list[tuple[int | str, float]]:
    """RATE requests a second for ``seconds``, each at its intended time; (status or error, seconds) each."""
    results: list[tuple[int | str, float]] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60,
                                 limits=limits) as client:
        async def one(at: float) -> None:
            try:
                answer = await client.post(path, content=body)
                results.append((answer.status_code, time.monotonic() - at))
            except httpx.HTTPError as e:
                results.append((type(e).__name__, time.monotonic() - at))

        start, sent, tasks = time.monotonic(), 0, []
        while sent < RATE * seconds:
            at = start + sent / RATE
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(at)))
            sent += 1
            if during is not None:
                during(time.monotonic() - start)
        await asyncio.gather(*tasks)
    return results


def measure(port: int, path: str, body: str, headers: dict[str, str], victim: int) -> list[tuple[int | str, float]]:
    """Warm for 2 s at 50/s, then the series with the victim stopped from STOP_AT for STOP_FOR seconds."""
    asyncio.run(open_loop(port, path, body, headers, 2.0))
    state = {"stopped": False, "continued": False}

    def stop_and_go(elapsed: float) -> None:
        if elapsed >= STOP_AT and not state["stopped"]:
            os.kill(victim, signal.SIGSTOP)
            state["stopped"] = True
        elif elapsed >= STOP_AT + STOP_FOR and not state["continued"]:
            os.kill(victim, signal.SIGCONT)
            state["continued"] = True

    try:
        return asyncio.run(open_loop(port, path, body, headers, SECONDS, stop_and_go))
    finally:
        if state["stopped"] and not state["continued"]:
            os.kill(victim, signal.SIGCONT)
        time.sleep(3)  # the stopped replica is back in every series' rotation before the next


def busiest(before: dict[int, float], pids: list[int]) -> int:
    """The replica whose CPU grew most since ``before``: the one the series sends to first."""
    return max(pids, key=lambda pid: (_cpu(pid) or 0.0) - before.get(pid, 0.0))


def _cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        raise SystemExit("nginx is not installed: apt-get install nginx-light (or nginx), then run this again")
    shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True)
    ol.DATA.mkdir(parents=True, exist_ok=True)
    data = ol.prepare("gbt")
    ol.DATA = DATA
    digest = hashlib.sha256(ROUTER_KEY.encode()).hexdigest()
    env = ol.user_environment(data["home"])
    path, body = f"/v2/models/{ol.MODEL}/infer", data["v2"][0]
    ports = [reserve_port() for _ in range(3)]
    replicas = [ol.Server(f"replica-{i}", [sys.executable, "-m", "shardline.cli", "serve", "--port", str(p),
                                           "--tenants", data["tenants"], "--metrics-port", "off"],
                          dict(env, SHARDLINE_TENANCY_ROUTER_KEY_SHA256=digest), p, path, "/v2/health/ready")
                for i, p in enumerate(ports)]
    config = DATA / "router.yaml"
    config.write_text("groups:\n  - name: bench\n    replicas: ["
                      + ", ".join(f'"http://127.0.0.1:{p}"' for p in ports) + "]\n")
    tenant_key = {"Authorization": f"Bearer {ol.API_KEY}"}
    routed = {"Authorization": f"Bearer {ROUTER_KEY}", "X-Shardline-Tenant": TENANT}

    def router(name: str, **extra: str) -> ol.Server:
        port = reserve_port()
        return ol.Server(name, [sys.executable, "-m", "shardline.cli", "router", "--config", str(config), "--tenants",
                                data["tenants"], "--port", str(port), "--metrics-port", "off"],
                         dict(env, SHARDLINE_ROUTER_KEY=ROUTER_KEY, **extra), port, path, "/v2/health/ready")

    nginx_port = reserve_port()
    series = [("router", router("router"), tenant_key),
              ("router alone", router("router-alone", SHARDLINE_ROUTER_DATA_PLANE="python"), tenant_key),
              ("router, stall off", router("router-stall-off", SHARDLINE_ROUTER_STALL_MS="0"), tenant_key),
              ("nginx, tuned", ol.Server("nginx", [nginx, "-c", str(tuned_nginx_config(nginx_port, ports, DATA)), "-p",
                                                   str(DATA)], env, nginx_port, path, "/v2/health/ready"), routed)]
    print(f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.2f}); {RATE} req/s open loop for {SECONDS:g} s "
          f"per series, the replica it sends most to stopped (SIGSTOP) at {STOP_AT:g} s for {STOP_FOR:g} s; "
          "3 replicas of `shardline serve` on their defaults", flush=True)
    rows: dict[str, list[tuple[int | str, float]]] = {}
    try:
        for server in replicas:
            server.start("")
        pids = [s.proc.pid for s in replicas]  # type: ignore[union-attr]
        for name, server, headers in series:
            server.start("")
            if server.name == "router":
                front = re.search(r"\((\w+) in front;", server.log.read_text())
                print(f"  router's data plane: {front.group(1) + ' in front' if front else 'the router alone'}",
                      flush=True)
            before = {pid: _cpu(pid) or 0.0 for pid in pids}
            asyncio.run(open_loop(server.port, path, body, headers, 1.0))
            rows[name] = measure(server.port, path, body, headers, busiest(before, pids))
            server.stop()
    finally:
        for _, server, _ in series:
            server.stop()
        for server in replicas:
            server.stop()
    reference = max(seconds for _, seconds in rows["nginx, tuned"])
    print(f"{'series':<20} {'answers':<28} {'p50 ms':>8} {'p99 ms':>8} {'slowest ms':>11} {'x nginx':>8}")
    met = True
    for name, results in rows.items():
        statuses: dict[Any, int] = {}
        for status, _ in results:
            statuses[status] = statuses.get(status, 0) + 1
        times = sorted(seconds for _, seconds in results)
        slowest = times[-1]
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        shown = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str))
        print(f"{name:<20} {shown:<28} {statistics.median(times) * 1000:8.1f} {p99 * 1000:8.1f} "
              f"{slowest * 1000:11.0f} {slowest / reference:8.2f}")
        if name.startswith("router") and "off" not in name:
            met = met and set(statuses) == {200} and slowest < 1.0
    print(f"target (every answer 200, none slower than 1 s through the router): {'met' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
