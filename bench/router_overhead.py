"""Router overhead: the same `shardline serve` replicas called directly, through `shardline router`, and
through nginx as a plain reverse proxy, open loop, on defaults.

Three replicas (`shardline serve` on its defaults, each given the router's key digest, as behind any
router) serve the breast-cancer classifier. Three series are measured with bench/loadgen.py (open
loop, latency from each request's intended send time):

- **direct**: one replica, the request carrying the router's key and the tenant (what the router sends);
- **router**: `shardline router --config router.yaml` over the three, on its defaults, with the tenant's
  own key (its default data plane: nginx with its Lua module in front where installed, else the router
  alone; printed);
- **nginx**: Debian's nginx as a plain reverse proxy over the three (`worker_processes auto`, upstream
  keep-alive, no access log), passing the same headers as direct.

With ``--quota-store``, a fourth series, **router+redis**: a second router over the same replicas holding the tenant's
quotas in a redis-server started here (Debian's package; SHARDLINE_TENANCY_QUOTA_STORE): the tenant's
``max_concurrent`` makes its lane run one EVALSHA (a lease) and one ZREM per request (docs/routing.md, "Quotas for
many routers").

The request layouts a client sends for this model are measured (``--layouts``, all by default), one after the
other: 30 inputs of shape [1] (one per feature column) and one input of shape [1, 30] (the model packaged from its
ONNX file alone, its data flat or a list a row), as JSON and as binary tensors (tritonclient's default; see
bench/online_latency.py), and KServe V1's ``{"instances": [[...]]}``. Printed, for each layout: each series' steps,
the p50 at the lightest rate, the highest rate held at p99 <= 10 ms, and
the ratios against the targets: the router adds at most 1.5x nginx's p50 (p50 through it less p50
direct, paired round by round: the median over 10 rounds, 20 in full mode; see ``light_rounds``), and holds
at least 0.8x nginx's rate.

    .venv/bin/python bench/router_overhead.py --quick    # 100, 800, 1600 req/s, short steps: ~7 min
    .venv/bin/python bench/router_overhead.py            # 100 .. 6400 req/s doubling, refined: ~32 min
    .venv/bin/python bench/router_overhead.py --layouts scalar,nk        # the JSON layouts only: half that
    .venv/bin/python bench/router_overhead.py --quick --quota-store   # and router+redis: ~8 min

nginx must be on PATH, and its Lua module for the router's default data plane (`make setup` installs
`nginx-light libnginx-mod-http-lua` as root). Data and logs: bench/.data/router/ (git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import online_latency as ol  # noqa: E402
from loadgen import NOISY  # noqa: E402

from shardline.local_ports import reserve_port  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data" / "router"
ROUTER_KEY = "shardline-bench-router-key"
TENANT = "bench"
ADDED_P50_TARGET = 1.5  # the router's added p50 <= 1.5 x nginx's
HELD_TARGET = 0.8  # the router's highest held rate >= 0.8 x nginx's


def nginx_config(port: int, replicas: list[int], folder: Path) -> Path:
    """A plain reverse proxy over the replicas, as its documentation shows one."""
    upstream = "\n".join(f"        server 127.0.0.1:{p};" for p in replicas)
    text = textwrap.dedent(f"""\
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
                }}
            }}
        }}
    """)
    path = folder / "nginx.conf"
    path.write_text(text)
    return path


def requests(target: str, port: int, path: str, bodies: list[str]) -> list[str]:
    """Raw HTTP requests: the tenant's key to the router, the router's key and the tenant to the rest."""
    auth = (f"Authorization: Bearer {ol.API_KEY}\r\n" if target.startswith("router")
            else f"Authorization: Bearer {ROUTER_KEY}\r\nX-Shardline-Tenant: {TENANT}\r\n")
    return [f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}{ol.content_headers(b)}"
            f"Content-Length: {len(b)}\r\n\r\n{b}" for b in bodies]


def run(targets: list[tuple[str, ol.Server]], replicas: list[int], path: str, bodies: list[str],
        args: argparse.Namespace) -> dict[str, Any]:
    """The load generator over the series; a proxy's ``replicas`` (pids) are its backends: their CPU is the
    series' work, not noise (direct's replica is one of them; router+redis's Redis is one of its own)."""
    redis = [args.redis.pid] if getattr(args, "redis", None) is not None else []
    return ol.generate_steps([{"name": name, "port": s.port, "pid": s.proc.pid,  # type: ignore[union-attr]
                               "backends": [] if name == "direct" else replicas + (redis if name == "router+redis"
                                                                                   else []),
                               "requests": requests(name, s.port, path, bodies)} for name, s in targets],
                             args, DATA / "generator.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rates, short steps: ~3 minutes")
    parser.add_argument("--rates", help="the ladder, req/s, comma-separated (default 100..6400 doubling)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--quota-store", action="store_true",
                        help="also router+redis: a router holding the quotas in a redis-server started here")
    parser.add_argument("--layouts", default=",".join(ol.LAYOUTS),
                        help=f"comma-separated request layouts (default: all, {', '.join(ol.LAYOUTS)})")
    args = parser.parse_args(argv)
    args.layouts = ol.parse_layouts(parser, args.layouts)
    args.ladder = [float(r) for r in args.rates.split(",")] if args.rates else (
        [100.0, 800.0, 1600.0] if args.quick else [100.0 * 2**k for k in range(7)])
    args.seconds, args.warmup = (2.0, 0.5) if args.quick else (5.0, 1.0)
    args.refine, args.retries, args.prewarm = (1, 1, 1.5) if args.quick else (2, 2, 3.0)
    args.rounds = 10 if args.quick else 20  # the light rate's rounds: the ladder's step, then short windows
    args.window = (0.5, 1.0) if args.quick else (1.0, 2.0)  # each short window's warm-up and measured seconds
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        raise SystemExit("nginx is not installed: apt-get install nginx-light (or nginx), then run this again")
    shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True)
    ol.DATA.mkdir(parents=True, exist_ok=True)
    data = ol.prepare("gbt")
    ol.DATA = DATA  # the servers' logs go here
    digest = hashlib.sha256(ROUTER_KEY.encode()).hexdigest()
    env = ol.user_environment(data["home"])
    path = f"/v2/models/{ol.MODEL}/infer"
    ports = [reserve_port() for _ in range(3)]
    servers = [ol.Server(f"replica-{i}", [sys.executable, "-m", "shardline.cli", "serve", "--port", str(p), "--tenants",
                                          data["tenants"], "--metrics-port", "off"],
                         dict(env, SHARDLINE_TENANCY_ROUTER_KEY_SHA256=digest), p, path, "/v2/health/ready")
               for i, p in enumerate(ports)]
    config = DATA / "router.yaml"
    config.write_text("groups:\n  - name: bench\n    replicas: [" + ", ".join(f'"http://127.0.0.1:{p}"' for p in ports) + "]\n")
    router_port, nginx_port = reserve_port(), reserve_port()
    router = ol.Server("router", [sys.executable, "-m", "shardline.cli", "router", "--config", str(config), "--tenants",
                                  data["tenants"], "--port", str(router_port)],
                       dict(env, SHARDLINE_ROUTER_KEY=ROUTER_KEY), router_port, path, "/v2/health/ready")
    proxy = ol.Server("nginx", [nginx, "-c", str(nginx_config(nginx_port, ports, DATA)), "-p", str(DATA)], env,
                      nginx_port, path, "/v2/health/ready")
    proxies = [("router", router), ("nginx", proxy)]
    args.redis = None
    if args.quota_store:
        redis_port, stored_port = reserve_port(), reserve_port()
        args.redis = start_redis(redis_port)
        proxies.insert(1, ("router+redis", ol.Server(
            "router+redis", [sys.executable, "-m", "shardline.cli", "router", "--config", str(config), "--tenants",
                             data["tenants"], "--port", str(stored_port)],
            dict(env, SHARDLINE_ROUTER_KEY=ROUTER_KEY, SHARDLINE_ROUTER_METRICS_PORT="off",
                 SHARDLINE_TENANCY_QUOTA_STORE=f"redis://127.0.0.1:{redis_port}/0"),
            stored_port, path, "/v2/health/ready")))
    print(f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.2f}); ladder "
          f"{', '.join(f'{r:,.0f}' for r in args.ladder)} req/s; one row per request, in each of --layouts "
          f"({'; '.join(ol.LAYOUTS[k] for k in args.layouts)}); "
          "3 replicas of `shardline serve` on their defaults", flush=True)
    print(f"  {subprocess.run([nginx, '-v'], capture_output=True, text=True).stderr.strip()}", flush=True)
    try:
        for server in servers:
            server.start(requests("direct", server.port, path, data["v2"][:1])[0])
        for _, server in proxies:
            server.start("")
        targets = [("direct", servers[0]), *proxies]
        ok = {name: ol.http(s.port, path, data["v2"][0], _headers(name)) for name, s in targets}
        for name, (status, answer) in ok.items():
            got = ol.answer_of(answer)
            if status != 200 or got is None or got[0] != data["expected"][0]:
                raise SystemExit(f"{name} answered {status} {str(answer)[:300]}")
        print("  every series answers as the model does", flush=True)
        front = re.search(r"\((\w+) in front;", (DATA / "logs" / "router.log").read_text())
        plane = f"{front.group(1)} in front" if front else "the router alone"
        print(f"  the router's data plane: {plane}", flush=True)
        if args.redis is not None:
            lane = "on" if "fast lane is on" in (DATA / "logs" / "router+redis.log").read_text() else "OFF"
            print(f"  router+redis: quotas in redis-server, nginx's lane {lane}", flush=True)
        layouts = {layout: (ol.infer_path(layout), data[ol.DATA_KEYS.get(layout, layout)]) for layout in args.layouts}
        replicas = [s.proc.pid for s in servers]  # type: ignore[union-attr]
        steps, rounds = {}, {}
        for layout, (layout_path, bodies) in layouts.items():
            steps[layout] = run(targets, replicas, layout_path, bodies, args)
            rounds[layout] = light_rounds(targets, replicas, layout_path, bodies, args, steps[layout])
    finally:
        for server in (*(s for _, s in proxies), *servers):
            server.stop()
        if args.redis is not None:
            args.redis.kill()
            args.redis.wait()
    met = [report(layout, series, rounds[layout], args) for layout, series in steps.items()]
    print(f"(rest: cores the rest of the machine used; a figure marked '!' was noisy, over {NOISY:g} core)")
    (DATA / "last-run.json").write_text(json.dumps({"steps": steps, "light_rounds": rounds}, indent=1))
    return 1 if args.strict and not all(met) else 0


def light_rounds(targets: list[tuple[str, ol.Server]], replicas: list[int], path: str, bodies: list[str],
                 args: argparse.Namespace, ladder: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each series' steps at the lightest rate in ``args.rounds`` rounds: the ladder's step, then short windows
    at that rate alone, the series in a new random order each round. A window's p50 at a light rate moves by a
    few hundred microseconds with the machine's state, as much as the difference measured: many short windows,
    each round's windows close together, let the rounds' median cancel that drift (``report`` pairs them)."""
    light = min(args.ladder)
    found = {name: [s for s in series if s["rate"] == light] for name, series in ladder.items()}
    window = argparse.Namespace(**{**vars(args), "ladder": [light], "refine": 0, "prewarm": 0.0,
                                   "warmup": args.window[0], "seconds": args.window[1]})
    order = random.Random(0)  # a fixed seed: every run shuffles its rounds alike
    for _ in range(args.rounds - 1):
        shuffled = order.sample(targets, len(targets))
        for name, series in run(shuffled, replicas, path, bodies, window).items():
            found[name] += series
    return found


def report(layout: str, steps: dict[str, Any], light_steps: dict[str, list[dict[str, Any]]],
           args: argparse.Namespace) -> bool:
    """Print one request layout's series, summary and ratios against the targets; whether both were met.
    The p50 at the lightest rate is each series' median over the rounds (``light_rounds``); the p50 a proxy adds
    is the median over the rounds of its p50 less direct's in the same round. Beside it, each proxy's own CPU
    per request at that rate (median over the rounds): steadier than a p50 that moves with the machine."""
    light = min(args.ladder)
    print(f"\n=== layout {layout}: {ol.LAYOUTS[layout]} ===")
    for name, series in steps.items():
        ol.report_steps(name, series)
    summary = {name: ol.summarize(series, light) for name, series in steps.items()}
    rounds = {name: [s["p50_ms"] for s in series] for name, series in light_steps.items()}
    print(f"\np50 at {light:,.0f}/s, round by round (ms):")
    for name, p50s in rounds.items():
        summary[name]["p50"] = statistics.median(p50s)
        print(f"  {name:<10}{'  '.join(f'{p:.2f}' for p in p50s)}   median {summary[name]['p50']:.2f}")
    print(f"\n{'series':<10}{'p50 ms @ ' + format(light, ',.0f') + '/s':>16}{'held at p99<10ms':>18}  limited by")
    for name, s in summary.items():
        print(f"{name:<10}{ol._fmt(s['p50'], '.2f'):>16}{s['held']:>16,.0f}/s  {s['limit']}")
    proxies = [n for n in rounds if n != "direct"]
    by_round = {n: [p - d for p, d in zip(rounds[n], rounds["direct"])] for n in proxies}
    print(f"\np50 added at {light:,.0f}/s, round by round (us):")
    for name, values in by_round.items():
        print(f"  {name:<10}{'  '.join(f'{v * 1000:4.0f}' for v in values)}   median {statistics.median(values) * 1000:.0f}")
    added = {n: statistics.median(values) for n, values in by_round.items()}
    cpu = {n: statistics.median(s["server_cpu"] / s["achieved"] * 1e6 for s in light_steps[n] if s["achieved"])
           for n in proxies}
    print(f"CPU per request at {light:,.0f}/s, the proxy's own (median over the rounds): "
          + ", ".join(f"{n} {cpu[n]:.0f} us" for n in proxies))
    p50_ratio = added["router"] / added["nginx"] if added["nginx"] > 0 else math.inf
    held_ratio = summary["router"]["held"] / summary["nginx"]["held"] if summary["nginx"]["held"] else math.inf
    p50_met, held_met = p50_ratio <= ADDED_P50_TARGET, held_ratio >= HELD_TARGET
    print(f"\n[{layout}] added p50 at {light:,.0f}/s: router {added['router'] * 1000:.0f} us, nginx "
          f"{added['nginx'] * 1000:.0f} us: {p50_ratio:.2f}x (target <= {ADDED_P50_TARGET}: "
          f"{'met' if p50_met else 'MISSED'})")
    print(f"[{layout}] highest rate held: router {summary['router']['held']:,.0f}/s, nginx "
          f"{summary['nginx']['held']:,.0f}/s: {held_ratio:.2f}x (target >= {HELD_TARGET}: "
          f"{'met' if held_met else 'MISSED'})")
    return p50_met and held_met


def start_redis(port: int) -> subprocess.Popen[bytes]:
    """Debian's redis-server on loopback, nothing saved; once it answers PING."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        raise SystemExit("redis-server is not installed: apt-get install redis-server, then run this again")
    DATA.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                                "--dir", str(DATA)], stdout=(DATA / "redis.log").open("ab"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit(f"redis-server did not answer on port {port}")


def _headers(name: str) -> dict[str, str]:
    if name.startswith("router"):
        return {"Authorization": f"Bearer {ol.API_KEY}"}
    return {"Authorization": f"Bearer {ROUTER_KEY}", "X-Shardline-Tenant": TENANT}


if __name__ == "__main__":
    sys.exit(main())
