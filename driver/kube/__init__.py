"""The small Kubernetes client layer the product runs on (the embedded cluster is `driver.cluster`)."""

from __future__ import annotations

from driver.kube.client import REQUEST_TIMEOUT_SECONDS, as_dict, load_configuration, new_api_client
from driver.kube.errors import api_errors, translate_api_exception

__all__ = [
    "REQUEST_TIMEOUT_SECONDS",
    "api_errors",
    "as_dict",
    "load_configuration",
    "new_api_client",
    "translate_api_exception",
]
