"""A stand-in for vLLM's OpenAI server, ``python -m vllm.entrypoints.openai.api_server`` with this folder's parent
on PYTHONPATH: what the ``vllm`` runtime's supervision of the server sees of it, no more. It binds ``--host``
``--port`` as vLLM does (``SO_REUSEADDR`` and ``SO_REUSEPORT``: vLLM's ``create_server_socket``), exits with an
error when another process holds the port, and answers ``GET /health`` with 200. The runtime's requests are
tested against a real vLLM (tests/integration/test_vllm_runtime.py, where one is installed)."""

from __future__ import annotations

import argparse
import http.server
import socket
import sys


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    args, _ = parser.parse_known_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"ERROR: [Errno {e.errno}] error while attempting to bind on address ({args.host!r}, {args.port}): "
              f"{e.strerror}", file=sys.stderr, flush=True)
        return 1
    sock.listen()
    server = http.server.HTTPServer((args.host, args.port), Health, bind_and_activate=False)
    server.socket = sock
    print(f"INFO: Started server process on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
