"""Thin helpers around the official ``kubernetes`` client.

Each thread builds its own ``ApiClient`` from one explicit ``Configuration`` (never the global
default). Every call passes ``_request_timeout=REQUEST_TIMEOUT_SECONDS``.
"""

from __future__ import annotations

import os

from kubernetes import client, config

from driver.errors import ConfigError

__all__ = ["REQUEST_TIMEOUT_SECONDS", "WATCH_TIMEOUT_SECONDS", "load_configuration", "new_api_client"]

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
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        elif os.path.exists(config.incluster_config.SERVICE_TOKEN_FILENAME):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(client_configuration=configuration)
    except (config.ConfigException, OSError) as error:
        raise ConfigError(field="--kubeconfig (FRACTIONAL_KUBECONFIG)", problem=str(error)) from error
    return configuration


def new_api_client(configuration: client.Configuration) -> client.ApiClient:
    """A fresh ``ApiClient`` (own connection pool) for the calling thread."""
    return client.ApiClient(configuration)
