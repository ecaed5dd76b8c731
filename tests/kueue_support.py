"""Kueue's CRDs (tests/data/kueue, from kubernetes-sigs/kueue v0.19.2) for tests that play Kueue."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

CRD_DIR = Path(__file__).parent / "data" / "kueue"
KUEUE_KINDS = ("admissionchecks", "clusterqueues", "localqueues", "resourceflavors", "workloads")
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"


@functools.cache
def kueue_crd(plural: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.load(
        (CRD_DIR / f"kueue.x-k8s.io_{plural}.yaml").read_text(encoding="utf-8"), Loader=yaml.CSafeLoader
    )
    return loaded


def install_kueue_crds(api: client.ApiClient, plurals: tuple[str, ...] = KUEUE_KINDS) -> None:
    extensions = client.ApiextensionsV1Api(api)
    for plural in plurals:
        extensions.create_custom_resource_definition(kueue_crd(plural), _preload_content=False)
