"""The agent's HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` (liveness), ``/readyz``.

Checks are callables returning ``(ok, detail)``; the server only maps them to 200/503. It runs in
one named thread; ``close()`` shuts it down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

__all__ = ["Check", "ProbeServer"]

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]


class ProbeServer:
    def __init__(self, *, host: str, port: int, liveness: Check, readiness: Check) -> None:
        checks = {"/healthz": liveness, "/readyz": readiness}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._answer(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                    return
                check = checks.get(path)
                if check is None:
                    self._answer(404, b"not found\n", "text/plain")
                    return
                ok, detail = check()
                self._answer(
                    200 if ok else 503, f"{'ok' if ok else 'failed'}: {detail}\n".encode(), "text/plain"
                )

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http request", extra={"request": format % args})

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="probe-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
