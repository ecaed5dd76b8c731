"""Kueue's CRDs, from its Go module at the version the local cluster builds, for tests that play
Kueue (a test that needs them skips where the module cannot be had: ``tests/go_modules.py``)."""

from __future__ import annotations

import functools
from typing import Any

import yaml
from kubernetes import client

from tests.go_modules import kueue_crd_path

KUEUE_KINDS = ("admissionchecks", "clusterqueues", "localqueues", "resourceflavors", "workloads")
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"


@functools.cache
def kueue_crd(plural: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.load(
        kueue_crd_path(plural).read_text(encoding="utf-8"), Loader=yaml.CSafeLoader
    )
    return loaded


def install_kueue_crds(api: client.ApiClient, plurals: tuple[str, ...] = KUEUE_KINDS) -> None:
    extensions = client.ApiextensionsV1Api(api)
    for plural in plurals:
        extensions.create_custom_resource_definition(kueue_crd(plural), _preload_content=False)
