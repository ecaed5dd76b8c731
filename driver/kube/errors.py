"""The one place that knows the client's exception types; re-raises ours ``from`` them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from driver.errors import (
    ConflictError,
    FractionalError,
    NamespaceTerminatingError,
    NotFoundError,
    TransientError,
)

__all__ = ["api_errors", "check_response_status", "translate_api_exception"]


MAX_REASON_CHARS = 500  # an API message can quote a whole object (a tenant's claim): never echo it all


def _reason(error: ApiException) -> str:
    try:
        body = json.loads(error.body or "{}")
        reason = str(body.get("message") or error.reason)
    except (ValueError, TypeError, AttributeError, RecursionError):
        reason = str(error.reason)
    if len(reason) > MAX_REASON_CHARS:
        return f"{reason[:MAX_REASON_CHARS]}... ({len(reason) - MAX_REASON_CHARS} more characters)"
    return reason


def translate_api_exception(error: ApiException, what: str) -> FractionalError:
    status = error.status or 0
    message = f"{what}: HTTP {status}: {_reason(error)}"
    if status == 404:
        return NotFoundError(message)
    if status == 409:
        return ConflictError(message)
    if status == 429 or status >= 500 or status == 0:
        return TransientError(message)
    if status == 403 and _has_cause(error, "NamespaceTerminating"):
        return NamespaceTerminatingError(message)
    return FractionalError(message)


def _has_cause(error: ApiException, reason: str) -> bool:
    try:
        body = json.loads(error.body or "{}")
        causes = (body.get("details") or {}).get("causes") or []
        return any(isinstance(c, dict) and c.get("reason") == reason for c in causes)
    except (ValueError, TypeError, AttributeError, RecursionError):
        return False


@contextlib.contextmanager
def api_errors(what: str) -> Iterator[None]:
    """``with api_errors("update ResourceSlice x"): ...`` turns client errors into ours."""
    try:
        yield
    except ApiException as error:
        raise translate_api_exception(error, what) from error
    except (urllib3.exceptions.HTTPError, ConnectionError) as error:
        raise TransientError(f"{what}: {str(error)[:MAX_REASON_CHARS]}") from error


def check_response_status(status: int, body: bytes, what: str) -> None:
    """For raw calls (``ApiClient.call_api``), which return error answers instead of raising."""
    if 200 <= status < 300:
        return
    error = ApiException(status=status, reason=body.decode("utf-8", "replace")[:200])
    error.body = body.decode("utf-8", "replace")
    raise translate_api_exception(error, what)
