"""The HTTP endpoint of the node agent and the controller: ``/metrics`` (Prometheus) and probes
(``/healthz``, ``/readyz``).

Checks are callables returning ``(ok, detail)``; the server only maps them to 200/503. It runs in
one named thread; ``close()`` shuts it down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

__all__ = ["Check", "ProbeServer"]

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]


class ProbeServer:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        checks: Mapping[str, Check],
        registry: CollectorRegistry = REGISTRY,
        name: str = "probe-http",
    ) -> None:
        checks = dict(checks)
        self._paths = ["/metrics", *checks]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                    return
                check = checks.get(path)
                if check is None:
                    self._answer(404, b"not found\n", "text/plain")
                    return
                ok, detail = check()
                word = "ok" if ok else "failed"
                text = f"{word}: {detail}\n" if detail else f"{word}\n"
                self._answer(200 if ok else 503, text.encode(), "text/plain")

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
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()
        log.info("http endpoint serving", extra={"port": self.port, "paths": self._paths})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
