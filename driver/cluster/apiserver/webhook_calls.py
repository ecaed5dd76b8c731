"""One call of a validating admission webhook by the embedded API emulator (a test double), as
kube-apiserver makes it: the AdmissionReview it sends (``k8s.io/apiserver``'s
``pkg/admission/plugin/webhook/request/admissionreview.go``), the HTTPS POST to ``clientConfig``
(``pkg/util/webhook/client.go``: the path and its ``?timeout=``, ``caBundle`` as the only roots),
the answer checked (``VerifyAdmissionResponse``) and a refusal worded
(``webhook/errors/statuserror.go``). ``webhooks`` decides what the outcome means.

Departures: the emulator serves no Services and resolves none, so a ``clientConfig.service`` call
fails as kube-apiserver's fails for a Service that does not exist (``service "NAME" not found``).
Transport failures are worded as Go's client words the usual ones (connection refused, timeout,
an unknown certificate authority); rarer ones carry Python's text.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import socket
import ssl
import urllib.parse
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from driver.cluster.apiserver.formats import go_quote
from driver.cluster.apiserver.store import ResourceType, StatusError
from driver.cluster.apiserver.webhook_rules import ADMISSION_REVIEW_VERSIONS

__all__ = ["Attributes", "Operation", "Outcome", "admission_request", "call_webhook"]

Obj = dict[str, Any]
_ADMISSION_GROUP = "admission.k8s.io"
_NO_SIDE_EFFECTS = frozenset({"None", "NoneOnDryRun"})
_USER_AGENT = "kube-apiserver-admission"
_UNKNOWN_AUTHORITY = frozenset({2, 18, 19, 20, 21})  # OpenSSL's "no trusted issuer" verify codes
_GENERIC_MESSAGES = {  # apimachinery's NewGenericServerResponse, for an answer that is no Status
    400: "the server rejected our request for an unknown reason",
    401: "the server has asked for the client to provide credentials",
    404: "the server could not find the requested resource",
    405: "the server does not allow this method on the requested resource",
    409: "the server reported a conflict",
    422: "the server rejected our request due to an error in our request",
    429: "the server has received too many requests and has asked us to try again later",
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted, but may still be processing "
    "the request",
}


class Operation(StrEnum):
    CREATE = "CREATE"
    UPDATE = "UPDATE"
    DELETE = "DELETE"
    CONNECT = "CONNECT"


@dataclass(frozen=True, slots=True)
class Attributes:
    """One write as admission sees it (``admission.Attributes``): ``obj`` is None on DELETE, ``old``
    on CREATE; ``namespace`` of a Namespace is its own name; ``kind`` is the (group, version, kind)
    of ``obj`` (Eviction and Binding for those subresources); ``options`` the Create-, Update- or
    DeleteOptions; ``user`` the UserInfo of the writer."""

    rtype: ResourceType
    subresource: str
    operation: Operation
    namespace: str
    name: str
    obj: Obj | None
    old: Obj | None
    options: Obj | None
    dry_run: bool
    user: Obj
    kind: tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One call: allowed (neither set), refused (``refusal``) or failed (``failure``, the reason
    ``failurePolicy`` judges)."""

    warnings: tuple[str, ...] = ()
    refusal: StatusError | None = None
    failure: str | None = None


class _CallFailed(Exception):
    """A webhook could not be called or answered nothing usable (upstream's ErrCallingWebhook)."""


@dataclass(frozen=True, slots=True)
class _Endpoint:
    url: str  # as Go's client prints it in errors, with the timeout query
    host: str
    port: int
    target: str  # path and query
    context: ssl.SSLContext | None = None
    service: str | None = None  # a Service reference, which the emulator cannot resolve


# the AdmissionReview (request/admissionreview.go) --------------------------------------------


def admission_request(attributes: Attributes, *, uid: str, omit_empty: bool) -> Obj:
    """An AdmissionRequest: as Go encodes it (``omit_empty``: empty strings left out) for the
    review, or with every field for the ``request`` variable of matchConditions."""
    rtype = attributes.rtype
    group, version, kind = attributes.kind
    gvk = {"group": group, "version": version, "kind": kind}
    gvr = {"group": rtype.group, "version": rtype.version, "resource": rtype.plural}
    user = {
        "username": attributes.user.get("username", ""),
        "uid": attributes.user.get("uid", ""),
        "groups": list(attributes.user.get("groups") or []),
        "extra": dict(attributes.user.get("extra") or {}),
    }
    request: Obj = {
        "uid": uid, "kind": gvk, "resource": gvr, "subResource": attributes.subresource,
        "requestKind": dict(gvk), "requestResource": dict(gvr), "requestSubResource": attributes.subresource,
        "name": attributes.name, "namespace": attributes.namespace, "operation": attributes.operation.value,
        "userInfo": user, "object": attributes.obj, "oldObject": attributes.old, "dryRun": attributes.dry_run,
        "options": attributes.options,
    }  # fmt: skip
    if not omit_empty:
        del request["object"], request["oldObject"]  # variables of their own
        return request
    for key in ("subResource", "requestSubResource", "name", "namespace"):
        if not request[key]:
            del request[key]
    request["userInfo"] = {key: value for key, value in user.items() if value}
    return request


def call_webhook(hook: Obj, attributes: Attributes) -> Outcome:
    """One webhook called (validating/dispatcher.go callHook)."""
    name = str(hook.get("name", ""))
    if attributes.dry_run:
        side_effects = hook.get("sideEffects")
        if side_effects is None:
            return Outcome(failure="Webhook SideEffects is nil")
        if side_effects not in _NO_SIDE_EFFECTS:  # refused whatever failurePolicy says
            message = f"admission webhook {go_quote(name)} does not support dry run"
            return Outcome(refusal=StatusError(code=400, reason="BadRequest", message=message))
    version = next(
        (v for v in hook.get("admissionReviewVersions") or () if v in ADMISSION_REVIEW_VERSIONS), None
    )
    if version is None:
        return Outcome(
            failure="could not create admission objects: "
            "webhook does not accept known AdmissionReview versions (v1, v1beta1)"
        )
    uid = str(uuid.uuid4())
    review = {
        "kind": "AdmissionReview",
        "apiVersion": f"{_ADMISSION_GROUP}/{version}",
        "request": admission_request(attributes, uid=uid, omit_empty=True),
    }
    timeout_seconds = int(hook.get("timeoutSeconds") or 10)
    try:
        endpoint = _endpoint(hook.get("clientConfig") or {}, timeout_seconds)
        answer = _post(endpoint, json.dumps(review).encode(), timeout_seconds)
        response = _verify(answer, uid=uid, version=version)
    except _CallFailed as failure:
        return Outcome(failure=str(failure))
    warnings = tuple(str(w) for w in response.get("warnings") or ())
    if response.get("allowed") is True:
        return Outcome(warnings=warnings)
    return Outcome(warnings=warnings, refusal=_refusal(name, response.get("status")))


def _endpoint(client_config: Obj, timeout_seconds: int) -> _Endpoint:
    """Where to POST (util/webhook/client.go): the URL's host and path, or the Service's name; the
    query carries the timeout as Go's client sends it."""
    query = f"?timeout={timeout_seconds}s"
    service = client_config.get("service")
    if isinstance(service, dict):
        host = f"{service.get('name')}.{service.get('namespace')}.svc"
        port = int(service.get("port") or 443)
        target = _clean_path(str(service.get("path") or "")) + query
        return _Endpoint(
            f"https://{host}:{port}{target}", host, port, target, service=str(service.get("name"))
        )
    parsed = urllib.parse.urlsplit(str(client_config.get("url", "")))
    target = _clean_path(parsed.path) + query
    url = f"{parsed.scheme}://{parsed.netloc}{target}"
    return _Endpoint(url, parsed.hostname or "", parsed.port or 443, target, _tls_context(client_config))


def _clean_path(path: str) -> str:
    """Go's ``path.Join("/", path)``: one leading slash, no empty segments or trailing slash."""
    return "/" + "/".join(segment for segment in path.split("/") if segment)


def _tls_context(client_config: Obj) -> ssl.SSLContext:
    """Verify the server against ``caBundle`` (base64 PEM), else the system's roots, as Go's client."""
    bundle = client_config.get("caBundle")
    if not bundle:
        return ssl.create_default_context()
    try:
        pem = base64.b64decode(str(bundle), validate=True).decode("ascii")
        return ssl.create_default_context(cadata=pem)
    except (binascii.Error, UnicodeDecodeError, ssl.SSLError, ValueError):
        raise _CallFailed(
            "could not get REST client: unable to load root certificates: unable to parse bytes as PEM block"
        ) from None


def _post(endpoint: _Endpoint, body: bytes, timeout_seconds: int) -> tuple[int, str, bytes]:
    """(status, content type, body) of the webhook's answer; raise ``_CallFailed`` as Go's client
    fails: ``failed to call webhook: Post "URL": <transport error>``."""
    prefix = f"failed to call webhook: Post {go_quote(endpoint.url)}"
    if endpoint.service is not None:
        raise _CallFailed(f"{prefix}: service {go_quote(endpoint.service)} not found")
    connection = http.client.HTTPSConnection(
        endpoint.host, endpoint.port, timeout=timeout_seconds, context=endpoint.context
    )
    try:
        connection.request(
            "POST", endpoint.target, body=body,
            headers={"Content-Type": "application/json", "Accept": "application/json, */*",
                     "User-Agent": _USER_AGENT},
        )  # fmt: skip
        answer = connection.getresponse()
        return answer.status, answer.getheader("Content-Type") or "", answer.read()
    except TimeoutError:
        raise _CallFailed(f"{prefix}: context deadline exceeded") from None
    except ssl.SSLCertVerificationError as error:
        problem = (
            "certificate signed by unknown authority"
            if error.verify_code in _UNKNOWN_AUTHORITY
            else str(error.verify_message)
        )
        raise _CallFailed(f"{prefix}: tls: failed to verify certificate: x509: {problem}") from None
    except ConnectionRefusedError:
        raise _CallFailed(
            f"{prefix}: dial tcp {endpoint.host}:{endpoint.port}: connect: connection refused"
        ) from None
    except socket.gaierror:
        raise _CallFailed(f"{prefix}: dial tcp: lookup {endpoint.host}: no such host") from None
    except http.client.RemoteDisconnected:
        raise _CallFailed(f"{prefix}: EOF") from None
    except (OSError, http.client.HTTPException) as error:
        raise _CallFailed(f"{prefix}: {error}") from None
    finally:
        connection.close()


def _verify(answer: tuple[int, str, bytes], *, uid: str, version: str) -> Obj:
    """The ``response`` of a usable answer (client-go's decoding, then VerifyAdmissionResponse)."""
    status, content_type, body = answer
    if not 200 <= status <= 206:
        raise _CallFailed(f"failed to call webhook: {_error_answer(status, content_type, body)}")
    text = body.decode("utf-8", errors="replace")
    try:
        review = json.loads(text)
    except ValueError as error:
        raise _CallFailed(
            f"failed to call webhook: couldn't get version/kind; json parse error: {error}"
        ) from None
    if not isinstance(review, dict) or not review.get("kind"):
        raise _CallFailed(f"failed to call webhook: Object 'Kind' is missing in '{text}'")
    response = review.get("response")
    invalid = "received invalid webhook response: "
    if not isinstance(response, dict):
        raise _CallFailed(invalid + "webhook response was absent")
    if version == "v1":
        if response.get("uid") != uid:
            raise _CallFailed(
                invalid
                + f"expected response.uid={go_quote(uid)}, got {go_quote(str(response.get('uid', '')))}"
            )
        if review.get("apiVersion") != f"{_ADMISSION_GROUP}/v1" or review.get("kind") != "AdmissionReview":
            group, _, got_version = str(review.get("apiVersion", "")).rpartition("/")
            raise _CallFailed(
                invalid + f"expected webhook response of {_ADMISSION_GROUP}/v1, Kind=AdmissionReview, got "
                f"{group}/{got_version}, Kind={review.get('kind')}"
            )
        if response.get("patch"):
            raise _CallFailed(invalid + "validating webhook may not return response.patch")
        if response.get("patchType") is not None:
            raise _CallFailed(invalid + "validating webhook may not return response.patchType")
    return response


def _error_answer(status: int, content_type: str, body: bytes) -> str:
    """The error client-go makes of a non-2xx answer: the Status it carries, else a generic one."""
    try:
        decoded = json.loads(body)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict) and decoded.get("kind") == "Status" and decoded.get("message"):
        return str(decoded["message"])
    textual = not content_type or content_type.split(";")[0].strip().startswith("text/")
    server_message = body[:1024].decode("utf-8", errors="replace").strip() if textual else "unknown"
    if status in (403, 406, 415):
        return server_message
    if status in _GENERIC_MESSAGES:
        return _GENERIC_MESSAGES[status]
    if status >= 500:
        return (
            f"an error on the server ({go_quote(server_message)}) has prevented the request from succeeding"
        )
    return f"the server responded with the status code {status} but did not return more information"


def _refusal(name: str, result: Any) -> StatusError:
    """errors/statuserror.go ToStatusErr: the webhook's status, its code at least 400, its message
    prefixed with who denied the request."""
    result = result if isinstance(result, dict) else {}
    denied_by = f"admission webhook {go_quote(name)} denied the request"
    code = result.get("code") if isinstance(result.get("code"), int) else 0
    message, reason = str(result.get("message") or ""), str(result.get("reason") or "")
    if message:
        text = f"{denied_by}: {message}"
    elif reason:
        text = f"{denied_by}: {reason}"
    else:
        text = f"{denied_by} without explanation"
    details = result.get("details") if isinstance(result.get("details"), dict) else None
    return StatusError(code=max(code, 400), reason=reason, message=text, details=details)
