"""Thin helpers around the official ``kubernetes`` client.

Each thread builds its own ``ApiClient`` from one explicit ``Configuration`` (never the global
default). Every call passes ``_request_timeout=REQUEST_TIMEOUT_SECONDS``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client, config

from driver.errors import ConfigError

__all__ = [
    "REQUEST_TIMEOUT_SECONDS",
    "WATCH_TIMEOUT_SECONDS",
    "get_json",
    "send_json",
    "load_configuration",
    "new_api_client",
]

REQUEST_TIMEOUT_SECONDS = 10.0
WATCH_TIMEOUT_SECONDS = 60


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
    return configuration


def new_api_client(configuration: client.Configuration) -> client.ApiClient:
    """A fresh ``ApiClient`` (own connection pool) for the calling thread."""
    return client.ApiClient(configuration)


def get_json(api_client: client.ApiClient, path: str, *, what: str) -> dict[str, Any]:
    """GET ``path`` (e.g. ``/api/v1/nodes/n1``) as a plain dict.

    Used where a typed API class would cost more than it gives: ``CoreV1Api`` alone adds about
    25 MiB to a process, which the node agent does not otherwise need.
    """
    from driver.kube.errors import check_response_status

    method, url, headers, _body, _post = api_client.param_serialize(
        "GET", path, header_params={"Accept": "application/json"}, auth_settings=["BearerToken"]
    )
    response = api_client.call_api(
        method, url, header_params=headers, _request_timeout=REQUEST_TIMEOUT_SECONDS
    )
    response.read()  # type: ignore[no-untyped-call]
    check_response_status(response.status, response.data or b"", what)
    result: dict[str, Any] = json.loads(response.data or b"{}")
    return result


def send_json(
    api_client: client.ApiClient,
    method: str,
    path: str,
    path_params: dict[str, Any],
    body: dict[str, Any],
    *,
    what: str,
    content_type: str = "application/json",
) -> bytes:
    """Send ``body`` as it is to ``path`` (a template such as
    ``/api/v1/namespaces/{namespace}/pods/{name}``, filled from ``path_params``, quoted); returns
    the raw answer. Errors raise as ``api_errors`` turns them (ConflictError on 409, ...).

    The typed API methods first validate a dict body into the client's model (pydantic), then walk
    it again to serialize it: a fifth of the controller's CPU per write, and a model may drop fields
    it does not know (a newer server's). The chart's RBAC test reads the templates at the call sites.
    """
    from driver.kube.errors import api_errors, check_response_status

    params = {key: str(value) for key, value in path_params.items() if "{" + key + "}" in path}
    method, url, headers, _body, _post = api_client.param_serialize(
        method,
        path,
        path_params=params,
        header_params={"Accept": "application/json", "Content-Type": content_type},
        auth_settings=["BearerToken"],
    )
    with api_errors(what):
        response = api_client.call_api(
            method, url, header_params=headers, body=body, _request_timeout=REQUEST_TIMEOUT_SECONDS
        )
        response.read()  # type: ignore[no-untyped-call]
    data: bytes = response.data or b""
    check_response_status(response.status, data, what)
    return data
