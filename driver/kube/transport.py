"""The controller's hot writes over one keep-alive connection per writer thread (stdlib http.client).

A write through the client's REST layer costs about 500 µs of CPU in the calling thread here
(urllib3's pool, retry and response objects, the client's content-type checks); the same request on
a plain ``http.client`` connection costs about 220 µs (bench/bench_controller.py). The controller
makes three writes per pod it places, all in one Python process, so this is most of what it can
place per second. Everything else still comes from the official client: the URL and headers
(``ApiClient.param_serialize``, which also refreshes tokens), and the TLS settings of its
``Configuration`` (CA file or data, client certificate, ``verify_ssl``, ``assert_hostname``,
``tls_server_name``). A configuration this module does not reproduce (a proxy, custom socket
options) is sent through the client's REST layer as before.

Each write takes a token of the process's rate limiter first when the ``Configuration`` has one
(``driver.kube.ratelimit``), on either path: the same bucket as every other request of the process.

One ``JsonSender`` per thread: it owns its connection.
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
import weakref
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client

from driver.errors import TransientError
from driver.kube.client import REQUEST_TIMEOUT_SECONDS
from driver.kube.errors import api_errors, check_response_status
from driver.kube.ratelimit import RateLimitedApiClient, rate_limiter_of

__all__ = ["JsonSender"]

MAX_ERROR_CHARS = 300
CONNECT_ATTEMPTS = 3
CONNECT_BACKOFF_SECONDS = 0.05
# The server closed a kept-alive connection before reading our request: sending again is safe.
_STALE = (
    http.client.RemoteDisconnected,
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
)


def _tls_context(configuration: client.Configuration) -> ssl.SSLContext:
    if not configuration.verify_ssl:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context = ssl.create_default_context(
            cafile=configuration.ssl_ca_cert, cadata=configuration.ca_cert_data or None
        )
        if configuration.assert_hostname is False:
            context.check_hostname = False
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context


def _close_all(connections: list[http.client.HTTPConnection]) -> None:
    for connection in connections:
        connection.close()


class JsonSender:
    """Sends JSON bodies to the API server and returns the raw answers (see the module docstring)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._api_client = api_client
        configuration = api_client.configuration
        target = urlsplit(configuration.host)
        self._lean = (
            target.scheme in ("http", "https")
            and not configuration.proxy
            and configuration.socket_options is None
        )
        self._https = target.scheme == "https"
        self._netloc = target.netloc
        self._context = _tls_context(configuration) if self._lean and self._https else None
        server_name = configuration.tls_server_name or (
            configuration.assert_hostname if isinstance(configuration.assert_hostname, str) else None
        )
        self._server_name = server_name
        # The lean path sends itself, so it takes the token here; the client's REST layer takes its
        # own when new_api_client made the client (RateLimitedApiClient), and not otherwise.
        limited_by_client = not self._lean and isinstance(api_client, RateLimitedApiClient)
        self._limiter = None if limited_by_client else rate_limiter_of(configuration)
        # The connection, when one is open (at most one); closed at GC too, if nobody called close().
        self._open: list[http.client.HTTPConnection] = []
        weakref.finalize(self, _close_all, self._open)
        self._used = False  # the connection has answered before: a failure to send may mean it went stale

    def send_json(
        self,
        method: str,
        path: str,
        path_params: dict[str, Any],
        body: dict[str, Any],
        *,
        what: str,
        content_type: str = "application/json",
        query: Sequence[tuple[str, str]] = (),
    ) -> bytes:
        """``body`` to ``path`` (a template filled from ``path_params``, quoted; ``query`` its
        parameters); the raw answer. Errors raise as ``api_errors`` turns them (ConflictError on
        409, TransientError, ...)."""
        params = {key: str(value) for key, value in path_params.items() if "{" + key + "}" in path}
        method, url, headers, _body, _post = self._api_client.param_serialize(
            method,
            path,
            path_params=params,
            query_params=list(query),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            auth_settings=["BearerToken"],
        )
        if self._limiter is not None:
            self._limiter.wait()
        if not self._lean:
            with api_errors(what):
                response = self._api_client.call_api(
                    method, url, header_params=headers, body=body, _request_timeout=REQUEST_TIMEOUT_SECONDS
                )
                response.read()  # type: ignore[no-untyped-call]
            data: bytes = response.data or b""
            check_response_status(response.status, data, what)
            return data
        target = urlsplit(url)
        request_path = target.path + (f"?{target.query}" if target.query else "")
        payload = json.dumps(body).encode("utf-8")
        status, data = self._exchange(method, request_path, payload, headers, what)
        check_response_status(status, data, what)
        return data

    def close(self) -> None:
        _close_all(self._open)
        self._open.clear()
        self._used = False

    def _connect(self) -> http.client.HTTPConnection:
        if not self._open:
            if self._https:
                connection: http.client.HTTPConnection = _HTTPSConnection(
                    self._netloc, timeout=REQUEST_TIMEOUT_SECONDS, context=self._context,
                    server_name=self._server_name,
                )  # fmt: skip
            else:
                connection = http.client.HTTPConnection(self._netloc, timeout=REQUEST_TIMEOUT_SECONDS)
            self._used = False
            self._open.append(connection)
        return self._open[0]

    def _exchange(
        self, method: str, path: str, payload: bytes, headers: dict[str, str], what: str
    ) -> tuple[int, bytes]:
        stale_retried = False
        for _attempt in range(2):
            connection = self._open_connection(what)
            reused = self._used
            try:
                connection.request(method, path, body=payload, headers=headers)
                response = connection.getresponse()
                data = response.read()
            except _STALE as error:
                self.close()
                if reused and not stale_retried:
                    stale_retried = True
                    continue  # the server had closed the idle connection: once more on a new one
                raise TransientError(f"{what}: {str(error)[:MAX_ERROR_CHARS]}") from error
            except (OSError, http.client.HTTPException) as error:
                self.close()
                raise TransientError(f"{what}: {str(error)[:MAX_ERROR_CHARS]}") from error
            self._used = True
            if response.will_close:
                self.close()
            return response.status, data
        raise TransientError(f"{what}: the connection was closed twice")  # pragma: no cover

    def _open_connection(self, what: str) -> http.client.HTTPConnection:
        """The kept connection, or a new one; connecting is tried CONNECT_ATTEMPTS times (nothing
        was sent yet, so trying again is always safe), as urllib3's default retries do."""
        connection = self._connect()
        if connection.sock is not None:
            return connection
        for attempt in range(CONNECT_ATTEMPTS):
            try:
                connection.connect()
                return connection
            except OSError as error:
                self.close()
                if attempt == CONNECT_ATTEMPTS - 1 or isinstance(error, ssl.SSLCertVerificationError):
                    raise TransientError(f"{what}: connect: {str(error)[:MAX_ERROR_CHARS]}") from error
                time.sleep(CONNECT_BACKOFF_SECONDS * (attempt + 1))
                connection = self._connect()
        raise AssertionError("unreachable")  # pragma: no cover


class _HTTPSConnection(http.client.HTTPSConnection):
    """``HTTPSConnection`` that may check the certificate against another name (``tls_server_name``)."""

    def __init__(
        self, netloc: str, *, timeout: float, context: ssl.SSLContext | None, server_name: str | None
    ):
        super().__init__(netloc, timeout=timeout, context=context)
        self._server_name = server_name

    def connect(self) -> None:
        if self._server_name is None:
            super().connect()
            return
        http.client.HTTPConnection.connect(self)
        assert self._context is not None  # type: ignore[attr-defined]
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)  # type: ignore[attr-defined]
