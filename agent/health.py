"""HTTP endpoints of the agent: /metrics for Prometheus, /healthz (liveness), /readyz (readiness).

Liveness means the supervisor loop is running (a wedged agent gets restarted by kubelet);
readiness means every local rank answers on its socket, which is what the operator and the
node-readiness label need. One small threaded server keeps the pod to one HTTP port.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class _Handler(BaseHTTPRequestHandler):
    server: AgentHTTPServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/livez"):
            ok = self.server.alive()
            self._reply(200 if ok else 503, b"ok\n" if ok else b"supervisor stopped\n")
        elif path == "/readyz":
            ok = self.server.ready()
            self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
        else:
            self._reply(404, b"not found\n")

    def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # scrapes every few seconds
        return


class AgentHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], registry: CollectorRegistry,
                 alive: Callable[[], bool], ready: Callable[[], bool]) -> None:
        self.registry = registry
        self.alive = alive
        self.ready = ready
        super().__init__(addr, _Handler)


class AgentHTTPServer6(AgentHTTPServer):
    address_family = socket.AF_INET6


def serve_http(host: str, port: int, registry: CollectorRegistry,
               alive: Callable[[], bool], ready: Callable[[], bool]) -> AgentHTTPServer:
    """Bind and serve in a thread; raises OSError when the port is taken."""
    cls = AgentHTTPServer6 if ":" in host else AgentHTTPServer
    server = cls((host, port), registry, alive, ready)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
