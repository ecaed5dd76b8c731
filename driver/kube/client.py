"""Thin helpers around the official ``kubernetes`` client.

Each thread builds its own ``ApiClient`` from one explicit ``Configuration`` (never the global
default). Every call passes ``_request_timeout=REQUEST_TIMEOUT_SECONDS``. A ``Configuration`` with a
rate limiter attached (``driver.kube.ratelimit``) gives clients that wait for its tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client, config

from driver.errors import ConfigError
from driver.kube.ratelimit import RateLimitedApiClient, rate_limiter_of

__all__ = [
    "REQUEST_TIMEOUT_SECONDS",
    "WATCH_TIMEOUT_SECONDS",
    "as_dict",
    "get_json",
    "load_configuration",
    "new_api_client",
]

REQUEST_TIMEOUT_SECONDS = 10.0
WATCH_TIMEOUT_SECONDS = 60

_SERIALIZER: Any = None


def as_dict(obj: Any) -> dict[str, Any]:
    """A client model as the API serves it (camelCase dict); the client's own serializer is untyped."""
    global _SERIALIZER
    if _SERIALIZER is None:
        _SERIALIZER = client.ApiClient()
    result: dict[str, Any] = _SERIALIZER.sanitize_for_serialization(obj)
    return result


def load_configuration(kubeconfig: str | None) -> client.Configuration:
    """Resolve the cluster the usual way: an explicit kubeconfig file, else ``KUBECONFIG`` /
    ``~/.kube/config``, else the in-cluster service account.

    ``kubeconfig`` comes from ``--kubeconfig`` / ``FRACTIONAL_KUBECONFIG`` (cli.py); the client
    library itself consults ``KUBECONFIG``.
    """
    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)  # type: ignore[no-untyped-call]
        elif os.path.exists(config.incluster_config.SERVICE_TOKEN_FILENAME):
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError) as error:
        raise ConfigError(field="--kubeconfig (FRACTIONAL_KUBECONFIG)", problem=str(error)) from error
    except (TypeError, AttributeError, KeyError, ValueError) as error:  # YAML, but not a kubeconfig
        raise ConfigError(
            field="--kubeconfig (FRACTIONAL_KUBECONFIG)",
            problem=f"not a kubeconfig (a mapping with clusters, users and contexts): {type(error).__name__}",
        ) from error
    return configuration


def new_api_client(configuration: client.Configuration) -> client.ApiClient:
    """A fresh ``ApiClient`` (own connection pool) for the calling thread; its requests wait for
    the process's rate limiter when ``configuration`` has one (``attach_rate_limiter``)."""
    limiter = rate_limiter_of(configuration)
    if limiter is None:
        return client.ApiClient(configuration)
    return RateLimitedApiClient(configuration, limiter)


def get_json(
    api_client: client.ApiClient, path: str, *, what: str, timeout_seconds: float = REQUEST_TIMEOUT_SECONDS
) -> dict[str, Any]:
    """GET ``path`` (e.g. ``/api/v1/nodes/n1``) as a plain dict.

    Used where a typed API class would cost more than it gives: ``CoreV1Api`` alone adds about
    25 MiB to a process, which the node agent does not otherwise need.
    """
    from driver.kube.errors import api_errors, check_response_status

    method, url, headers, _body, _post = api_client.param_serialize(
        "GET", path, header_params={"Accept": "application/json"}, auth_settings=["BearerToken"]
    )
    # A refused connection is a TransientError like any other call's (raw urllib3 errors escaped
    # here once, and the controller's leader exited when kube-apiserver restarted).
    with api_errors(what):
        response = api_client.call_api(method, url, header_params=headers, _request_timeout=timeout_seconds)
        response.read()  # type: ignore[no-untyped-call]
    check_response_status(response.status, response.data or b"", what)
    result: dict[str, Any] = json.loads(response.data or b"{}")
    return result
