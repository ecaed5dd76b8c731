"""The allocation guard's HTTPS endpoint: ``POST /validate-allocation`` takes an AdmissionReview from
kube-apiserver and answers it (``review.py``).

TLS with the certificate and key the chart gives the controller (a Secret; the webhook
configuration carries its CA). The handshake runs on the connection's own thread, never on the
thread that accepts, so a client that stalls its handshake holds nobody else up. Connections are
kept alive (kube-apiserver reuses them) and closed after ``IDLE_SECONDS`` without a request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from driver.controller.guard.review import ReviewError
from driver.controller.model.decode import MAX_OBJECT_DEPTH, bounded, decode_json

__all__ = ["GUARD_PATH", "GuardServer"]

log = logging.getLogger(__name__)

GUARD_PATH = "/validate-allocation"
MAX_BODY_BYTES = 8 << 20  # an AdmissionReview holds two claims; kube-apiserver caps a claim at 3 MiB
IDLE_SECONDS = 60.0
HANDSHAKE_SECONDS = 10.0


class _TLSServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 context: ssl.SSLContext) -> None:  # fmt: skip
        self._context = context
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:  # on the connection's thread
        request.settimeout(HANDSHAKE_SECONDS)
        try:
            tls = self._context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as error:
            log.debug("TLS handshake failed", extra={"client": str(client_address), "error": bounded(error)})
            request.close()
            return
        try:
            tls.settimeout(IDLE_SECONDS)
            super().finish_request(tls, client_address)
        finally:
            with contextlib.suppress(OSError):
                tls.shutdown(socket.SHUT_RDWR)
            tls.close()


class GuardServer:
    """Serves ``review`` (AdmissionReview dict in, AdmissionReview dict out) over HTTPS."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        cert_file: str,
        key_file: str,
        review: Callable[[Any], dict[str, Any]],
        name: str = "allocation-guard",
    ) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(cert_file, key_file)
        context.set_alpn_protocols(["http/1.1"])

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: kube-apiserver sends many reviews on one connection

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or "")
                except ValueError:
                    self.close_connection = True  # the body's end is unknown: the connection cannot go on
                    self._answer(411, {"message": "Content-Length is required"})
                    return
                if not 0 < length <= MAX_BODY_BYTES:
                    self.close_connection = True
                    self._answer(413, {"message": f"a body of 1 to {MAX_BODY_BYTES} bytes is expected"})
                    return
                data = self.rfile.read(length)  # read in any case: the next request follows it
                if self.path.split("?", 1)[0] != GUARD_PATH:
                    self._answer(404, {"message": f"not found; the guard serves {GUARD_PATH}"})
                    return
                try:
                    decoded = decode_json(data, max_depth=MAX_OBJECT_DEPTH)
                    answer = review(decoded.value)
                except (ValueError, ReviewError) as error:  # bad JSON, or no AdmissionReview
                    self._answer(400, {"message": bounded(error)})
                    return
                self._answer(200, answer)

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                payload = json.dumps(body).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("guard request", extra={"request": bounded(format % args)})

        self._server = _TLSServer((host, port), Handler, context)
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()
        log.info("allocation guard serving", extra={"port": self.port, "path": GUARD_PATH})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
