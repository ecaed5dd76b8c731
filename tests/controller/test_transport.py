"""driver/kube/transport.py: the writers' lean connection honours the client's Configuration (TLS,
token, host path), reports errors as the client path does, and survives a server that closes idle
connections. A real HTTPS server with a certificate made by openssl for 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.errors import ConflictError, TransientError
from driver.kube.transport import JsonSender

PATH = "/api/v1/namespaces/{namespace}/pods/{name}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]] = []
    close_after_answer = False

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.seen.append({"path": self.path, "auth": self.headers.get("Authorization"),
                              "type": self.headers.get("Content-Type"), "body": body})  # fmt: skip
        status = 409 if self.path.endswith("/taken") else 200
        answer = json.dumps({"kind": "Status", "message": "taken"} if status == 409 else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
        if _Handler.close_after_answer:  # as an API server closing an idle keep-alive connection
            self.close_connection = True

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "server.crt", folder / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=apiserver",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:apiserver.test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def server(certificate: tuple[Path, Path]) -> Iterator[int]:
    cert, key = certificate
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Handler.seen.clear()
    _Handler.close_after_answer = False
    yield int(httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


@contextlib.contextmanager
def _sender(port: int, **settings: Any) -> Iterator[JsonSender]:
    """A sender for the test server, with ``settings`` on its Configuration; closed afterwards."""
    configuration = client.Configuration()
    configuration.host = f"https://127.0.0.1:{port}/prefix"
    configuration.api_key = {"BearerToken": "Bearer s3cret"}
    for name, value in settings.items():
        setattr(configuration, name, value)
    api_client = client.ApiClient(configuration)
    sender = JsonSender(api_client)
    try:
        yield sender
    finally:
        sender.close()
        api_client.close()


def test_a_write_goes_out_with_the_clients_token_path_and_ca(
    server: int, certificate: tuple[Path, Path]
) -> None:
    with _sender(server, ssl_ca_cert=str(certificate[0])) as sender:
        answer = sender.send_json(
            "PATCH", PATH, {"namespace": "ns", "name": "a b"}, {"spec": {"x": 1}}, what="patch pod",
            content_type="application/merge-patch+json",
        )  # fmt: skip
        assert json.loads(answer) == {"spec": {"x": 1}}
        (seen,) = _Handler.seen
        assert seen == {"path": "/prefix/api/v1/namespaces/ns/pods/a%20b", "auth": "Bearer s3cret",
                        "type": "application/merge-patch+json", "body": {"spec": {"x": 1}}}  # fmt: skip


def test_the_certificate_is_checked(server: int, certificate: tuple[Path, Path]) -> None:
    unknown = r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"  # the system's CAs lack our certificate
    with _sender(server) as sender, pytest.raises(TransientError, match=unknown):
        sender.send_json("PATCH", PATH, {"namespace": "ns", "name": "a"}, {}, what="patch pod")
    elsewhere = _sender(server, ssl_ca_cert=str(certificate[0]), tls_server_name="elsewhere.test")
    with elsewhere as sender, pytest.raises(TransientError, match=r"elsewhere\.test|match"):
        sender.send_json("PATCH", PATH, {"namespace": "ns", "name": "a"}, {}, what="patch pod")
    with _sender(server, ssl_ca_cert=str(certificate[0]), tls_server_name="apiserver.test") as sender:
        sender.send_json("PATCH", PATH, {"namespace": "ns", "name": "a"}, {}, what="patch pod")
    with _sender(server, verify_ssl=False) as sender:
        sender.send_json("PATCH", PATH, {"namespace": "ns", "name": "a"}, {}, what="patch pod")


def test_answers_and_closed_connections(server: int, certificate: tuple[Path, Path]) -> None:
    with _sender(server, ssl_ca_cert=str(certificate[0])) as sender:
        with pytest.raises(ConflictError, match="patch pod ns/taken: HTTP 409: taken"):
            sender.send_json(
                "PATCH", PATH, {"namespace": "ns", "name": "taken"}, {}, what="patch pod ns/taken"
            )
        _Handler.close_after_answer = True  # each answer closes the connection behind it
        for index in range(3):  # the kept connection is found closed, and the write sent on a new one
            sender.send_json("PATCH", PATH, {"namespace": "ns", "name": f"p{index}"}, {}, what="patch pod")
        assert [s["path"].rsplit("/", 1)[1] for s in _Handler.seen] == ["taken", "p0", "p1", "p2"]


def test_connecting_is_tried_again(
    server: int, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused connection (an API server restarting, a full listen queue) is tried again, as
    urllib3's default retries would; nothing was sent, so it is safe. Three refusals in a row fail."""
    from driver.kube import transport

    refusals = [2]
    connect = transport._HTTPSConnection.connect

    def flaky(self: Any) -> None:
        if refusals[0] > 0:
            refusals[0] -= 1
            raise ConnectionRefusedError("refused")
        connect(self)

    monkeypatch.setattr(transport._HTTPSConnection, "connect", flaky)
    with _sender(server, ssl_ca_cert=str(certificate[0])) as sender:
        sender.send_json("PATCH", PATH, {"namespace": "ns", "name": "a"}, {}, what="patch pod")
        assert len(_Handler.seen) == 1
        sender.close()
        refusals[0] = 3
        with pytest.raises(TransientError, match="patch pod: connect: refused"):
            sender.send_json("PATCH", PATH, {"namespace": "ns", "name": "b"}, {}, what="patch pod")


@pytest.mark.parametrize("call", ["get_json", "send_json"])
def test_an_api_that_refuses_connections_is_a_transient_error_on_every_path(call: str) -> None:
    """kube-apiserver restarting refuses connections: every raw call (the writers' and get_json,
    which the allocation guard's endpoint check uses) raises TransientError, never urllib3's own
    errors, which ended the leading controller's process once (seen on a real apiserver restart)."""
    from driver.kube.client import get_json

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    configuration = client.Configuration(host=f"http://127.0.0.1:{port}")
    configuration.retries = 0
    with client.ApiClient(configuration) as api_client:
        if call == "get_json":
            with pytest.raises(TransientError, match="read EndpointSlice"):
                get_json(api_client, "/apis/discovery.k8s.io/v1/endpointslices", what="read EndpointSlice")
        else:
            sender = JsonSender(api_client)
            with pytest.raises(TransientError, match="patch pod"):
                sender.send_json("PATCH", PATH, {"namespace": "ns", "name": "a"}, {}, what="patch pod")
