"""Validating admission webhooks: the apiserver calls a real HTTPS webhook server on 127.0.0.1
(its CA and certificate made by openssl in a temporary directory) for the writes a
ValidatingWebhookConfiguration selects, sends the AdmissionReview kube-apiserver sends, and answers
a refusal or a failed call as kube-apiserver does.

The tests marked ``shared`` reach the cluster only through its API, so they run against the real
kube-apiserver too (``pytest --cluster=real``). There a configuration takes effect a moment after
it is written: each configuration carries a marker webhook that refuses labelled ConfigMaps, and
a test proceeds once a dry-run marker is refused (at once on the emulator). Every webhook is
scoped to the test's own namespace(s), so a configuration left behind for a moment touches no
other test.
"""

from __future__ import annotations

import base64
import json
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.cluster.conftest import claim_body, pod_body

Obj = dict[str, Any]
Answer = Callable[[Obj], Obj]
MARKER_LABEL = "webhooks.fractional.dev/marker"
ACTIVE_WITHIN_SECONDS = 30.0  # the real apiserver's informer sees a new configuration well within this
KUBECTL = Path(sys.prefix) / "bin" / "kubectl"
CONFIGURATIONS_API = "admissionregistration.k8s.io/v1"


# certificates and the webhook server ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Certificates:
    ca_pem: bytes
    cert: Path
    key: Path

    @property
    def ca_bundle(self) -> str:
        return base64.b64encode(self.ca_pem).decode()


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"openssl {args[0]}: {result.stderr.strip()[-500:]}"


def _make_certificates(directory: Path, name: str) -> Certificates:
    """A CA and a serving certificate for 127.0.0.1 and localhost, signed by it (EC P-256)."""
    for key in ("ca.key", f"{name}.key"):
        _openssl(
            "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key, cwd=directory
        )
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", f"/CN={name}-ca", "-days", "2", "-sha256",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-out", "ca.crt", cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
        encoding="utf-8",
    )
    _openssl(
        "req", "-new", "-key", f"{name}.key", "-subj", f"/CN={name}", "-out", f"{name}.csr", cwd=directory
    )
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=directory,
    )  # fmt: skip
    return Certificates(
        (directory / "ca.crt").read_bytes(), directory / f"{name}.crt", directory / f"{name}.key"
    )


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return _make_certificates(tmp_path_factory.mktemp("webhook-pki"), "webhook")


@pytest.fixture(scope="module")
def other_certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """A second CA, which did not sign the webhook server's certificate."""
    return _make_certificates(tmp_path_factory.mktemp("other-pki"), "other")


@dataclass(frozen=True, slots=True)
class Received:
    """One call the webhook server got."""

    path: str
    query: str
    headers: dict[str, str]
    review: Obj

    @property
    def request(self) -> Obj:
        return dict(self.review["request"])


def allow(_request: Obj) -> Obj:
    return {"allowed": True}


def deny(status: Obj | None = None, **extra: Any) -> Answer:
    def answer(_request: Obj) -> Obj:
        return {"allowed": False, **({"status": status} if status is not None else {}), **extra}

    return answer


def _root_ca_publisher(request: Obj) -> bool:
    return (
        request.get("name") == "kube-root-ca.crt"
        and (request.get("resource") or {}).get("resource") == "configmaps"
    )


class WebhookServer:
    """An HTTPS admission webhook: each path answers as told (allowing by default) and keeps what
    it received. Answers that wait (``hold``) are let go when the test ends."""

    def __init__(self, certificates: Certificates) -> None:
        self._answers: dict[str, Answer] = {"/marker": deny({"message": "marker", "code": 418})}
        self._received: list[Received] = []
        self._lock = threading.Lock()
        self.released = threading.Event()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(certificates.cert), str(certificates.key))
        self._httpd = _QuietServer(("127.0.0.1", 0), _WebhookHandler)
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self._httpd.webhooks = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="webhook-server",
            daemon=True,
        )
        self._thread.start()
        self.ca_bundle = certificates.ca_bundle

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self._httpd.server_address[1]}{path}"

    def answer(self, path: str, answer: Answer) -> None:
        with self._lock:
            self._answers[path] = answer

    def hold(self, path: str) -> None:
        """``path`` answers only when the test ends (a webhook that times out)."""

        def wait(_request: Obj) -> Obj:
            self.released.wait(60)
            return {"allowed": True}

        self.answer(path, wait)

    def received(self, path: str) -> list[Received]:
        """The calls on ``path``, leaving out kube-controller-manager's own writes of the
        ``kube-root-ca.crt`` ConfigMap it keeps in every namespace (on a real cluster it writes it
        into a test's new namespace whenever it gets to it, which may be after the test's webhook is
        in force)."""
        with self._lock:
            return [
                call for call in self._received
                if call.path == path and not _root_ca_publisher(call.request)
            ]  # fmt: skip

    def requests(self, path: str) -> list[Obj]:
        return [call.request for call in self.received(path)]

    def handle(self, path: str, query: str, headers: dict[str, str], review: Obj) -> Obj:
        with self._lock:
            self._received.append(Received(path, query, headers, review))
            answer = self._answers.get(path, allow)
        return answer(review["request"])

    def stop(self) -> None:
        self.released.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A held answer written after the apiserver gave up fails: expected, not reported."""


class _WebhookHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        url = urllib.parse.urlsplit(self.path)
        webhooks: WebhookServer = self.server.webhooks  # type: ignore[attr-defined]
        answer = webhooks.handle(url.path, url.query, dict(self.headers.items()), review)
        if "raw" in answer:  # a malformed answer, sent as it is
            body = json.dumps(answer["raw"]).encode()
        else:
            response = {"uid": review["request"]["uid"], **answer}
            body = json.dumps(
                {"apiVersion": review["apiVersion"], "kind": "AdmissionReview", "response": response}
            )
            body = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests read what was received."""


@pytest.fixture
def webhook_server(certificates: Certificates) -> Iterator[WebhookServer]:
    server = WebhookServer(certificates)
    try:
        yield server
    finally:
        server.stop()


# configurations -----------------------------------------------------------------------------


def _unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(core: client.CoreV1Api) -> str:
    """A namespace of this test's own: every webhook here selects only it."""
    name = _unique("webhooks")
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def in_namespaces(*names: str, **labels: str) -> Obj:
    """A namespaceSelector for the test's namespaces (and ``labels``, if given)."""
    selector: Obj = {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(names)}]
    }
    if labels:
        selector["matchLabels"] = labels
    return selector


def rule(
    *resources: str, operations: tuple[str, ...] = ("*",), group: str = "", version: str = "v1", **extra: Any
) -> Obj:
    return {"operations": list(operations), "apiGroups": [group], "apiVersions": [version],
            "resources": list(resources), **extra}  # fmt: skip


NOT_A_MARKER = {"matchExpressions": [{"key": MARKER_LABEL, "operator": "DoesNotExist"}]}


def hook(server: WebhookServer, name: str, path: str, namespace: str, *rules: Obj, **extra: Any) -> Obj:
    """A webhook on ``server``'s ``path``, selecting ``namespace`` only (and no marker), five
    seconds to answer."""
    spec: Obj = {
        "name": f"{name}.webhooks.fractional.dev",
        "clientConfig": {"url": server.url(path), "caBundle": server.ca_bundle},
        "rules": list(rules) or [rule("configmaps")],
        "namespaceSelector": in_namespaces(namespace),
        "objectSelector": NOT_A_MARKER,
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 5,
    }
    spec.update(extra)
    return spec


def _marker(server: WebhookServer, configuration: str) -> Obj:
    return {
        "name": "marker.webhooks.fractional.dev",
        "clientConfig": {"url": server.url("/marker"), "caBundle": server.ca_bundle},
        "rules": [rule("configmaps", operations=("CREATE",))],
        "objectSelector": {"matchLabels": {MARKER_LABEL: configuration}},
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 5,
    }


class Configurations:
    """Writes ValidatingWebhookConfigurations, waits until each is in force, deletes them at the end."""

    def __init__(self, api_client: client.ApiClient, server: WebhookServer) -> None:
        self.api = client.AdmissionregistrationV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._server = server
        self._names: list[str] = []

    def create(self, namespace: str, *webhooks: Obj) -> str:
        name = _unique("webhooks-test")
        body = {
            "apiVersion": CONFIGURATIONS_API, "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name}, "webhooks": [*webhooks, _marker(self._server, name)],
        }  # fmt: skip
        self.api.create_validating_webhook_configuration(body)
        self._names.append(name)
        self._wait_in_force(name, namespace)
        return name

    def _wait_in_force(self, name: str, namespace: str) -> None:
        marker = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"generateName": "marker-", "labels": {MARKER_LABEL: name}}}  # fmt: skip
        deadline = time.monotonic() + ACTIVE_WITHIN_SECONDS
        while time.monotonic() < deadline:
            try:
                self._core.create_namespaced_config_map(namespace, marker, dry_run="All")
            except client.ApiException as error:
                if error.status == 418:
                    return
                raise
        raise AssertionError(f"ValidatingWebhookConfiguration {name} not in force")

    def delete_all(self) -> None:
        for name in self._names:
            try:
                self.api.delete_validating_webhook_configuration(name)
            except client.ApiException as error:
                if error.status != 404:
                    raise


@pytest.fixture
def configurations(api_client: client.ApiClient, webhook_server: WebhookServer) -> Iterator[Configurations]:
    made = Configurations(api_client, webhook_server)
    try:
        yield made
    finally:
        made.delete_all()


def config_map(name: str, **labels: str) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels},
            "data": {"key": "value"}}  # fmt: skip


def _status(error: client.ApiException) -> Obj:
    return dict(json.loads(error.body))


def _refused(call: Callable[[], Any]) -> client.ApiException:
    with pytest.raises(client.ApiException) as caught:
        call()
    return caught.value


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _writer(api_client: client.ApiClient) -> Obj:
    """Who the apiserver says the test's client is (a SelfSubjectReview)."""
    review = client.AuthenticationV1Api(api_client).create_self_subject_review(
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    )
    user = review.status.user_info
    return {"username": user.username, "groups": user.groups or []}


# what reaches a webhook ---------------------------------------------------------------------


@pytest.mark.shared
def test_an_allowed_create_sends_the_admission_review_and_is_stored(
    api_client: client.ApiClient,
    core: client.CoreV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
) -> None:
    configurations.create(namespace, hook(webhook_server, "allow", "/allow", namespace))
    created = core.create_namespaced_config_map(
        namespace, config_map("seen", team="a"), field_manager="tester"
    )
    assert core.read_namespaced_config_map("seen", namespace).metadata.uid == created.metadata.uid
    [call] = webhook_server.received("/allow")
    assert call.query == "timeout=5s"
    assert call.review["apiVersion"] == "admission.k8s.io/v1" and call.review["kind"] == "AdmissionReview"
    request = call.request
    assert request["uid"]
    assert request["kind"] == request["requestKind"] == {"group": "", "version": "v1", "kind": "ConfigMap"}
    assert request["resource"] == request["requestResource"] == {
        "group": "", "version": "v1", "resource": "configmaps"
    }  # fmt: skip
    assert "subResource" not in request and "requestSubResource" not in request
    assert (request["name"], request["namespace"], request["operation"]) == ("seen", namespace, "CREATE")
    writer = _writer(api_client)
    assert request["userInfo"]["username"] == writer["username"]
    assert set(writer["groups"]) <= set(request["userInfo"]["groups"])
    assert request["object"]["metadata"]["name"] == "seen"
    assert request["object"]["metadata"]["labels"] == {"team": "a"}
    assert request["object"]["data"] == {"key": "value"}
    assert "resourceVersion" not in request["object"]["metadata"]  # not stored yet
    assert request["oldObject"] is None
    assert request["dryRun"] is False
    assert request["options"] == {
        "kind": "CreateOptions",
        "apiVersion": "meta.k8s.io/v1",
        "fieldManager": "tester",
    }


@pytest.mark.shared
def test_a_dry_run_reaches_a_webhook_without_side_effects_and_stores_nothing(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    configurations.create(
        namespace, hook(webhook_server, "dry", "/dry", namespace, sideEffects="NoneOnDryRun")
    )
    core.create_namespaced_config_map(namespace, config_map("dry"), dry_run="All")
    [request] = webhook_server.requests("/dry")
    assert request["dryRun"] is True and request["options"]["dryRun"] == ["All"]
    assert _refused(lambda: core.read_namespaced_config_map("dry", namespace)).status == 404


@pytest.mark.shared
def test_a_delete_sends_the_old_object_and_a_refusal_keeps_it(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    stored = core.create_namespaced_config_map(namespace, config_map("kept"))
    webhook_server.answer("/delete", deny({"message": "keep it"}))
    configurations.create(
        namespace,
        hook(webhook_server, "delete", "/delete", namespace, rule("configmaps", operations=("DELETE",))),
    )
    error = _refused(lambda: core.delete_namespaced_config_map("kept", namespace))
    assert error.status == 400
    assert (
        _status(error)["message"]
        == 'admission webhook "delete.webhooks.fractional.dev" denied the request: keep it'
    )
    [request] = webhook_server.requests("/delete")
    assert request["operation"] == "DELETE" and request["name"] == "kept"
    assert request["object"] is None
    assert request["oldObject"]["metadata"]["uid"] == stored.metadata.uid
    assert request["options"]["kind"] == "DeleteOptions"
    assert core.read_namespaced_config_map("kept", namespace).metadata.uid == stored.metadata.uid


@pytest.mark.shared
def test_a_claim_status_update_sends_old_and_new_status_and_the_writer(
    api_client: client.ApiClient,
    resource: client.ResourceV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
) -> None:
    """The product's case: a webhook on ``resourceclaims/status`` UPDATE sees the status change."""
    claim = resource.create_namespaced_resource_claim(namespace, claim_body("claim", namespace))
    status_rule = rule("resourceclaims/status", operations=("UPDATE",), group="resource.k8s.io")
    configurations.create(namespace, hook(webhook_server, "status", "/status", namespace, status_rule))
    allocation = {"devices": {"results": [
        {"request": "gpu", "driver": "fractional.dev", "pool": "node1", "device": "gpu-0"}
    ]}}  # fmt: skip
    updated = resource.patch_namespaced_resource_claim_status(
        "claim",
        namespace,
        {"status": {"allocation": allocation}},
        _content_type="application/merge-patch+json",
    )
    assert updated.status.allocation.devices.results[0].device == "gpu-0"
    [request] = webhook_server.requests("/status")
    assert request["operation"] == "UPDATE"
    assert request["subResource"] == request["requestSubResource"] == "status"
    assert request["kind"] == {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"}
    assert request["resource"] == {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"}
    assert (request["name"], request["namespace"]) == ("claim", namespace)
    assert "allocation" not in (request["oldObject"].get("status") or {})
    assert request["oldObject"]["metadata"]["resourceVersion"] == claim.metadata.resource_version
    assert request["object"]["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    assert request["object"]["spec"] == request["oldObject"]["spec"]
    assert request["userInfo"]["username"] == _writer(api_client)["username"]
    assert request["options"]["kind"] == "UpdateOptions"


@pytest.mark.shared
def test_a_refused_claim_status_update_is_not_stored(
    resource: client.ResourceV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
) -> None:
    resource.create_namespaced_resource_claim(namespace, claim_body("claim", namespace))
    webhook_server.answer("/guard", deny({"message": "not yours", "reason": "Forbidden", "code": 403}))
    status_rule = rule("resourceclaims/status", operations=("UPDATE",), group="resource.k8s.io")
    configurations.create(namespace, hook(webhook_server, "guard", "/guard", namespace, status_rule))
    allocation = {"devices": {"results": [
        {"request": "gpu", "driver": "fractional.dev", "pool": "node1", "device": "gpu-0"}
    ]}}  # fmt: skip
    error = _refused(
        lambda: resource.patch_namespaced_resource_claim_status(
            "claim",
            namespace,
            {"status": {"allocation": allocation}},
            _content_type="application/merge-patch+json",
        )
    )
    assert (error.status, _status(error)["reason"]) == (403, "Forbidden")
    assert resource.read_namespaced_resource_claim("claim", namespace).status.allocation is None


# refusals -----------------------------------------------------------------------------------


@pytest.mark.shared
@pytest.mark.parametrize(
    ("status", "code", "reason", "message"),
    [
        ({"code": 403, "reason": "Forbidden", "message": "no"}, 403, "Forbidden", "denied the request: no"),
        ({"message": "no code"}, 400, None, "denied the request: no code"),
        ({"code": 200, "message": "too low"}, 400, None, "denied the request: too low"),
        ({"code": 422, "reason": "Invalid"}, 422, "Invalid", "denied the request: Invalid"),
        (None, 400, None, "denied the request without explanation"),
    ],
    ids=["forbidden", "no-code", "code-below-400", "reason-only", "no-status"],
)
def test_a_refusal_answers_the_webhooks_status(
    core: client.CoreV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
    status: Obj | None,
    code: int,
    reason: str | None,
    message: str,
) -> None:
    webhook_server.answer("/deny", deny(status))
    configurations.create(namespace, hook(webhook_server, "deny", "/deny", namespace))
    error = _refused(lambda: core.create_namespaced_config_map(namespace, config_map("refused")))
    body = _status(error)
    assert error.status == code and body["code"] == code
    assert body["status"] == "Failure"
    assert body.get("reason") == reason
    assert body["message"] == f'admission webhook "deny.webhooks.fractional.dev" {message}'
    assert _refused(lambda: core.read_namespaced_config_map("refused", namespace)).status == 404


@pytest.mark.shared
def test_warnings_of_the_answers_reach_the_client(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    webhook_server.answer("/warn", lambda _request: {"allowed": True, "warnings": ["mind the gap"]})
    webhook_server.answer("/deny", deny({"message": "no"}, warnings=["refused with care"]))
    deny_rule = rule("configmaps", operations=("UPDATE",))
    configurations.create(
        namespace,
        hook(webhook_server, "warn", "/warn", namespace, rule("configmaps", operations=("CREATE",))),
        hook(webhook_server, "deny", "/deny", namespace, deny_rule),
    )
    answer = core.create_namespaced_config_map(namespace, config_map("warned"), _preload_content=False)
    answer.drain_conn()  # unread, the answer would keep its connection open after the client closes
    assert "mind the gap" in " ".join(answer.headers.getlist("Warning"))
    error = _refused(
        lambda: core.replace_namespaced_config_map("warned", namespace, config_map("warned", x="y"))
    )
    assert "refused with care" in str((error.headers or {}).get("Warning"))


@pytest.mark.shared
def test_every_selecting_webhook_is_called_and_one_refusal_refuses(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    webhook_server.answer("/second", deny({"message": "second says no"}))
    configurations.create(namespace, hook(webhook_server, "first", "/first", namespace))
    configurations.create(namespace, hook(webhook_server, "second", "/second", namespace))
    error = _refused(lambda: core.create_namespaced_config_map(namespace, config_map("both")))
    assert "second says no" in _status(error)["message"]
    assert len(webhook_server.received("/first")) == len(webhook_server.received("/second")) == 1


# which requests are selected ----------------------------------------------------------------


@pytest.mark.shared
@pytest.mark.parametrize(
    "not_matching",
    [
        rule("secrets"),
        rule("configmaps", operations=("DELETE",)),
        rule("configmaps/status"),
        rule("configmaps", group="apps"),
        rule("configmaps", version="v2"),
        rule("configmaps", scope="Cluster"),
    ],
    ids=["resource", "operation", "subresource", "group", "version", "scope"],
)
def test_a_rule_that_does_not_match_calls_nothing(
    core: client.CoreV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
    not_matching: Obj,
) -> None:
    webhook_server.answer("/never", deny({"message": "should not be called"}))
    configurations.create(namespace, hook(webhook_server, "never", "/never", namespace, not_matching))
    core.create_namespaced_config_map(namespace, config_map("free"))
    assert webhook_server.received("/never") == []


@pytest.mark.shared
@pytest.mark.parametrize(
    ("resources", "status_called", "main_called"),
    [
        (["resourceclaims"], False, True),
        (["resourceclaims/status"], True, False),
        (["resourceclaims/*"], True, True),
        (["*/status"], True, False),
        (["*"], False, True),
        (["*/*"], True, True),
    ],
)
def test_subresources_match_as_the_rules_name_them(
    resource: client.ResourceV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
    resources: list[str],
    status_called: bool,
    main_called: bool,
) -> None:
    claim_rule = rule(*resources, operations=("CREATE", "UPDATE"), group="resource.k8s.io")
    configurations.create(namespace, hook(webhook_server, "claims", "/claims", namespace, claim_rule))
    resource.create_namespaced_resource_claim(namespace, claim_body("claim", namespace))
    resource.patch_namespaced_resource_claim_status(
        "claim", namespace, {"status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "fractional.dev", "pool": "node1", "device": "gpu-0"}]}}}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    seen = [(r["operation"], r.get("subResource", "")) for r in webhook_server.requests("/claims")]
    assert (("UPDATE", "status") in seen) is status_called
    assert (("CREATE", "") in seen) is main_called


@pytest.mark.shared
@pytest.mark.parametrize(
    ("expression", "called"),
    [
        ('object.metadata.name == "chosen"', True),
        ('object.metadata.name == "other"', False),
        ('request.operation == "CREATE" && oldObject == null', True),
        ('request.userInfo.username == ""', False),
        ('has(object.metadata.labels) && object.metadata.labels["team"] == "a"', True),
    ],
)
def test_match_conditions_choose_the_requests(
    core: client.CoreV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
    expression: str,
    called: bool,
) -> None:
    conditions = [{"name": "always", "expression": "true"}, {"name": "chosen", "expression": expression}]
    configurations.create(
        namespace, hook(webhook_server, "cond", "/cond", namespace, matchConditions=conditions)
    )
    core.create_namespaced_config_map(namespace, config_map("chosen", team="a"))
    assert len(webhook_server.received("/cond")) == (1 if called else 0)


@pytest.mark.shared
@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
def test_a_match_condition_that_errs_follows_the_failure_policy(
    core: client.CoreV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
    policy: str,
) -> None:
    expression = 'object.metadata.labels["missing"] == "x"'
    conditions = [{"name": "errs", "expression": expression}]
    configurations.create(
        namespace,
        hook(webhook_server, "cond", "/cond", namespace, matchConditions=conditions, failurePolicy=policy),
    )
    if policy == "Ignore":
        core.create_namespaced_config_map(namespace, config_map("skipped", team="a"))
    else:
        error = _refused(
            lambda: core.create_namespaced_config_map(namespace, config_map("blocked", team="a"))
        )
        body = _status(error)
        assert (error.status, body["reason"]) == (403, "Forbidden")
        assert body["message"] == (
            f"configmaps \"blocked\" is forbidden: expression '{expression}' resulted in error: "
            "no such key: missing"
        )
    assert webhook_server.received("/cond") == []


def test_match_conditions_cannot_use_the_authorizer(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    """The emulator authorizes nothing: ``authorizer`` fails to evaluate, and failurePolicy decides."""
    conditions = [
        {"name": "authz", "expression": 'authorizer.group("").resource("pods").check("get").allowed()'}
    ]
    configurations.create(
        namespace, hook(webhook_server, "authz", "/authz", namespace, matchConditions=conditions)
    )
    error = _refused(lambda: core.create_namespaced_config_map(namespace, config_map("authz")))
    assert error.status == 403
    assert "authorizer is not supported by the API emulator" in _status(error)["message"]


@pytest.mark.shared
def test_the_namespace_selector_reads_the_namespaces_labels(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    other = _unique("webhooks-other")
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    core.patch_namespace(namespace, {"metadata": {"labels": {"team": "a"}}})
    selected = hook(
        webhook_server, "ns", "/ns", namespace, namespaceSelector=in_namespaces(namespace, other, team="a")
    )
    configurations.create(namespace, selected)
    core.create_namespaced_config_map(namespace, config_map("in-a"))
    core.create_namespaced_config_map(other, config_map("elsewhere"))
    assert [(r["namespace"], r["name"]) for r in webhook_server.requests("/ns")] == [(namespace, "in-a")]


@pytest.mark.shared
def test_the_object_selector_matches_the_old_or_the_new_object(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    configurations.create(
        namespace,
        hook(webhook_server, "obj", "/obj", namespace, objectSelector={"matchLabels": {"team": "a"}}),
    )
    core.create_namespaced_config_map(namespace, config_map("labelled", team="a"))
    core.create_namespaced_config_map(namespace, config_map("plain"))
    core.replace_namespaced_config_map("labelled", namespace, config_map("labelled"))  # label removed
    core.replace_namespaced_config_map("plain", namespace, config_map("plain", other="b"))
    seen = [(r["operation"], r["name"]) for r in webhook_server.requests("/obj")]
    assert seen == [("CREATE", "labelled"), ("UPDATE", "labelled")]


@pytest.mark.shared
def test_webhook_configurations_are_never_sent_to_webhooks(
    api_client: client.ApiClient,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
) -> None:
    everything = rule("*", group="*", version="*")
    name = configurations.create(
        namespace, hook(webhook_server, "all", "/all", namespace, everything, namespaceSelector={},
                        objectSelector={"matchLabels": {"webhooks-test": namespace}})
    )  # fmt: skip
    configurations.api.patch_validating_webhook_configuration(
        name, {"metadata": {"labels": {"webhooks-test": namespace}}}
    )
    assert webhook_server.received("/all") == []


# failed calls -------------------------------------------------------------------------------


@pytest.mark.shared
@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
def test_an_unreachable_webhook_follows_the_failure_policy(
    core: client.CoreV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
    policy: str,
) -> None:
    port = _closed_port()
    unreachable = hook(webhook_server, "down", "/down", namespace, failurePolicy=policy)
    unreachable["clientConfig"]["url"] = f"https://127.0.0.1:{port}/down"
    configurations.create(namespace, unreachable)
    if policy == "Ignore":
        core.create_namespaced_config_map(namespace, config_map("through"))
        return
    error = _refused(lambda: core.create_namespaced_config_map(namespace, config_map("blocked")))
    body = _status(error)
    reason = (
        'failed calling webhook "down.webhooks.fractional.dev": failed to call webhook: Post '
        f'"https://127.0.0.1:{port}/down?timeout=5s": dial tcp 127.0.0.1:{port}: connect: connection refused'
    )
    assert (error.status, body["reason"]) == (500, "InternalError")
    assert body["message"] == f"Internal error occurred: {reason}"
    assert body["details"]["causes"] == [{"message": reason}]


@pytest.mark.shared
@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
def test_a_webhook_that_does_not_answer_in_time_follows_the_failure_policy(
    core: client.CoreV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
    policy: str,
) -> None:
    webhook_server.hold("/slow")
    configurations.create(
        namespace, hook(webhook_server, "slow", "/slow", namespace, failurePolicy=policy, timeoutSeconds=1)
    )
    started = time.monotonic()
    if policy == "Ignore":
        core.create_namespaced_config_map(namespace, config_map("through"))
    else:
        error = _refused(lambda: core.create_namespaced_config_map(namespace, config_map("blocked")))
        assert error.status == 500
        assert _status(error)["message"] == (
            'Internal error occurred: failed calling webhook "slow.webhooks.fractional.dev": failed to call '
            f'webhook: Post "{webhook_server.url("/slow")}?timeout=1s": context deadline exceeded'
        )
    assert time.monotonic() - started < 5


@pytest.mark.shared
def test_a_service_reference_that_resolves_to_nothing_fails_the_call(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    """The emulator serves no Services; the real server here has no such Service: both fail alike."""
    missing = hook(webhook_server, "svc", "/svc", namespace)
    missing["clientConfig"] = {"service": {"name": "nowhere", "namespace": namespace, "path": "/validate"},
                               "caBundle": webhook_server.ca_bundle}  # fmt: skip
    configurations.create(namespace, missing)
    error = _refused(lambda: core.create_namespaced_config_map(namespace, config_map("blocked")))
    assert error.status == 500
    assert _status(error)["message"] == (
        'Internal error occurred: failed calling webhook "svc.webhooks.fractional.dev": '
        f'failed to call webhook: Post "https://nowhere.{namespace}.svc:443/validate?timeout=5s": '
        'service "nowhere" not found'
    )


@pytest.mark.shared
def test_a_server_certificate_from_another_authority_fails_the_call(
    core: client.CoreV1Api,
    webhook_server: WebhookServer,
    configurations: Configurations,
    namespace: str,
    other_certificates: Certificates,
) -> None:
    untrusted = hook(webhook_server, "tls", "/tls", namespace)
    untrusted["clientConfig"]["caBundle"] = other_certificates.ca_bundle
    configurations.create(namespace, untrusted)
    error = _refused(lambda: core.create_namespaced_config_map(namespace, config_map("blocked")))
    assert error.status == 500
    assert _status(error)["message"].endswith(
        "tls: failed to verify certificate: x509: certificate signed by unknown authority"
    )
    assert webhook_server.received("/tls") == []


@pytest.mark.shared
def test_an_answer_for_another_request_fails_the_call(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    webhook_server.answer("/wrong", lambda _request: {"uid": "not-the-request", "allowed": True})
    configurations.create(namespace, hook(webhook_server, "wrong", "/wrong", namespace))
    error = _refused(lambda: core.create_namespaced_config_map(namespace, config_map("blocked")))
    [request] = webhook_server.requests("/wrong")
    assert _status(error)["message"] == (
        'Internal error occurred: failed calling webhook "wrong.webhooks.fractional.dev": '
        f'received invalid webhook response: expected response.uid="{request["uid"]}", got "not-the-request"'
    )


# the configuration kind ---------------------------------------------------------------------

MANIFEST = """\
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: {name}
  labels:
    app: fractional-dra
webhooks:
  - name: claims.webhooks.fractional.dev
    clientConfig:
      url: https://127.0.0.1:9443/validate
      caBundle: {ca_bundle}
    rules:
      - operations: ["UPDATE"]
        apiGroups: ["resource.k8s.io"]
        apiVersions: ["v1"]
        resources: ["resourceclaims/status"]
    namespaceSelector:
      matchLabels:
        kubernetes.io/metadata.name: {name}
    sideEffects: None
    admissionReviewVersions: ["v1"]
"""


@pytest.mark.shared
def test_a_configuration_written_from_yaml_round_trips_with_its_defaults(
    api_client: client.ApiClient, certificates: Certificates
) -> None:
    name = _unique("roundtrip")
    body = yaml.safe_load(MANIFEST.format(name=name, ca_bundle=certificates.ca_bundle))
    api = client.AdmissionregistrationV1Api(api_client)
    try:
        api.create_validating_webhook_configuration(body)
        stored = json.loads(api.read_validating_webhook_configuration(name, _preload_content=False).data)
        listed = json.loads(api.list_validating_webhook_configuration(_preload_content=False).data)
    finally:
        api.delete_validating_webhook_configuration(name)
    assert stored["metadata"]["generation"] == 1 and stored["metadata"]["labels"] == {"app": "fractional-dra"}
    [webhook] = stored["webhooks"]
    assert webhook == {
        **body["webhooks"][0],
        "rules": [{**body["webhooks"][0]["rules"][0], "scope": "*"}],
        "failurePolicy": "Fail",
        "matchPolicy": "Equivalent",
        "objectSelector": {},
        "timeoutSeconds": 10,
    }
    assert listed["kind"] == "ValidatingWebhookConfigurationList"
    [item] = [item for item in listed["items"] if item["metadata"]["name"] == name]
    assert item["webhooks"] == stored["webhooks"]


@pytest.mark.shared
def test_kubectl_applies_lists_and_discovers_webhook_configurations(
    kubeconfig_file: Path, certificates: Certificates, tmp_path: Path
) -> None:
    name = _unique("kubectl")
    env = {"KUBECONFIG": str(kubeconfig_file), "HOME": str(tmp_path)}

    def kubectl(*args: str, stdin: str | None = None) -> str:
        result = subprocess.run(
            [str(KUBECTL), "--cache-dir", str(tmp_path / "cache"), *args],
            input=stdin, capture_output=True, text=True, env=env, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    kubectl("apply", "-f", "-", stdin=MANIFEST.format(name=name, ca_bundle=certificates.ca_bundle))
    try:
        assert kubectl("get", "validatingwebhookconfigurations", name, "-o", "name").strip() == (
            f"validatingwebhookconfiguration.admissionregistration.k8s.io/{name}"
        )
        table = kubectl("get", "validatingwebhookconfigurations", name).splitlines()
        assert table[0].split() == ["NAME", "WEBHOOKS", "AGE"] and table[1].split()[:2] == [name, "1"]
        resources = kubectl("api-resources", "--api-group=admissionregistration.k8s.io", "-o", "name").split()
        assert "validatingwebhookconfigurations.admissionregistration.k8s.io" in resources
        extensions = kubectl("api-resources", "--categories=api-extensions", "-o", "name").split()
        assert "validatingwebhookconfigurations.admissionregistration.k8s.io" in extensions
    finally:
        kubectl("delete", "validatingwebhookconfiguration", name)


@pytest.mark.shared
@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"sideEffects": None}, "webhooks[0].sideEffects",
         "Required value: must specify one of None, NoneOnDryRun"),
        ({"sideEffects": "Some"}, "webhooks[0].sideEffects",
         'Unsupported value: "Some": supported values: "None", "NoneOnDryRun"'),
        ({"timeoutSeconds": 31}, "webhooks[0].timeoutSeconds",
         "Invalid value: 31: the timeout value must be between 1 and 30 seconds"),
        ({"admissionReviewVersions": ["v2"]}, "webhooks[0].admissionReviewVersions",
         'Invalid value: ["v2"]: must include at least one of v1, v1beta1'),
        ({"name": "short.name"}, "webhooks[0].name",
         'Invalid value: "short.name": should be a domain with at least three segments separated by dots'),
        ({"clientConfig": {"url": "http://127.0.0.1:9443/validate"}}, "webhooks[0].clientConfig.url",
         "Invalid value: \"http\": 'https' is the only allowed URL scheme; desired format: https://host[/path]"),
        ({"clientConfig": {}}, "webhooks[0].clientConfig",
         "Required value: exactly one of url or service is required"),
        ({"rules": [rule("configmaps", operations=("PATCH",))]}, "webhooks[0].rules[0].operations[0]",
         'Unsupported value: "PATCH": supported values: "*", "CONNECT", "CREATE", "DELETE", "UPDATE"'),
        ({"failurePolicy": "Sometimes"}, "webhooks[0].failurePolicy",
         'Unsupported value: "Sometimes": supported values: "Fail", "Ignore"'),
    ],
    ids=["no-side-effects", "side-effects", "timeout", "review-versions", "name", "http", "no-client",
         "operation", "failure-policy"],
)  # fmt: skip
def test_an_invalid_configuration_is_refused_as_kube_apiserver_words_it(
    api_client: client.ApiClient, certificates: Certificates, change: Obj, field: str, problem: str
) -> None:
    name = _unique("invalid")
    body = yaml.safe_load(MANIFEST.format(name=name, ca_bundle=certificates.ca_bundle))
    webhook = {**body["webhooks"][0], **change}
    body["webhooks"] = [{k: v for k, v in webhook.items() if v is not None}]
    untyped = client.CustomObjectsApi(api_client)  # the typed client refuses a missing field itself
    error = _refused(
        lambda: untyped.create_cluster_custom_object(
            "admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations", body
        )
    )
    status = _status(error)
    assert (error.status, status["reason"]) == (422, "Invalid")
    assert status["message"] == (
        f'ValidatingWebhookConfiguration.admissionregistration.k8s.io "{name}" is invalid: {field}: {problem}'
    )


# subresources and Namespaces ------------------------------------------------------------------


@pytest.mark.shared
def test_an_eviction_is_sent_as_an_eviction_of_the_pod(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    """In ``default`` (where a pod needs no service account to be made first), chosen by a label of
    this test on the Eviction, which is the object the webhook judges."""
    label = {"webhooks-test": namespace}
    core.create_namespaced_pod("default", pod_body(f"evicted-{namespace}"))
    eviction_rule = rule("pods/eviction", operations=("CREATE",))
    configurations.create(
        namespace, hook(webhook_server, "evict", "/evict", namespace, eviction_rule, namespaceSelector={},
                        objectSelector={"matchLabels": label})
    )  # fmt: skip
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": f"evicted-{namespace}", "labels": label},
    }
    core.create_namespaced_pod_eviction(f"evicted-{namespace}", "default", body)
    [request] = webhook_server.requests("/evict")
    assert request["operation"] == "CREATE" and request["subResource"] == "eviction"
    assert request["kind"] == {"group": "policy", "version": "v1", "kind": "Eviction"}
    assert request["resource"] == {"group": "", "version": "v1", "resource": "pods"}
    assert (request["name"], request["namespace"]) == (f"evicted-{namespace}", "default")
    assert request["object"]["kind"] == "Eviction" and request["oldObject"] is None


@pytest.mark.shared
def test_a_namespace_is_its_own_namespace_and_judged_by_its_new_labels(
    core: client.CoreV1Api, webhook_server: WebhookServer, configurations: Configurations, namespace: str
) -> None:
    name = _unique("webhooks-ns")
    selector = {"matchLabels": {"webhooks-test": namespace}}
    configurations.create(
        namespace, hook(webhook_server, "ns", "/ns", namespace, rule("namespaces", operations=("CREATE",)),
                        namespaceSelector=selector, objectSelector={})
    )  # fmt: skip
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": name, "labels": {"webhooks-test": namespace}}})  # fmt: skip
    [request] = webhook_server.requests("/ns")
    assert (request["name"], request["namespace"], request["operation"]) == (name, name, "CREATE")
