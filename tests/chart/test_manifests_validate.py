"""Every object the chart renders and every file in examples/ validates strictly (1.34, 1.35, 1.37).

Kinds without a schema in kubernetes-validate are skipped explicitly, by name: only the
prometheus-operator's ServiceMonitor (a CRD, monitoring.coreos.com/v1) — never silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chart_support import (
    EXAMPLES_DIR,
    FROM_RELEASE,
    KUBE_VERSIONS,
    VALUES_FILES,
    SchemaMissing,
    load_manifest_file,
    load_values,
    object_id,
    release,
    render_chart,
    rendered_for,
    validate_strict,
)

# (apiVersion, kind) that kubernetes-validate has no schema for, and why that is expected.
NO_SCHEMA = {("monitoring.coreos.com/v1", "ServiceMonitor"): "CRD of the prometheus-operator"}

BEFORE_RELEASE_VALUES = {"autoGate": {"apiVersion": "admissionregistration.k8s.io/v1beta1"}}

EXAMPLE_FILES = sorted(EXAMPLES_DIR.glob("*.yaml"))


def _check(objects: list[dict[str, Any]], version: str) -> None:
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        if not rendered_for(obj, version):
            pytest.skip(f"{object_id(obj)}: rendered from {FROM_RELEASE[key]} on (test_before_release_...)")
        if key in NO_SCHEMA:
            with pytest.raises(SchemaMissing):  # the day a schema appears, validate it
                validate_strict(obj, version)
            pytest.skip(f"{object_id(obj)}: no schema in kubernetes-validate {version} ({NO_SCHEMA[key]})")
        validate_strict(obj, version)


def _rendered_cases() -> list[Any]:
    cases = []
    for values_name in sorted(VALUES_FILES):
        for obj in render_chart(load_values(values_name)):
            for version in KUBE_VERSIONS:
                cases.append(pytest.param(obj, version, id=f"{values_name}-{object_id(obj)}-{version}"))
    return cases


@pytest.mark.parametrize(("obj", "version"), _rendered_cases())
def test_rendered_object_validates(obj: dict[str, Any], version: str) -> None:
    _check([obj], version)


@pytest.mark.parametrize("version", [v for v in KUBE_VERSIONS if release(v) < release("1.36")])
def test_before_release_objects_validate(version: str) -> None:
    """What older releases get instead of FROM_RELEASE's kinds validates there."""
    objects = [
        obj
        for obj in render_chart(BEFORE_RELEASE_VALUES)
        if (obj["apiVersion"].replace("v1beta1", "v1"), obj["kind"]) in FROM_RELEASE
    ]
    assert objects and all(obj["apiVersion"].endswith("/v1beta1") for obj in objects)
    _check(objects, version)


def test_examples_exist() -> None:
    names = {path.name for path in EXAMPLE_FILES}
    assert {
        "inference-fractional.yaml",
        "whole-gpu-pod.yaml",
        "gpu-nic-training.yaml",
        "gang-job.yaml",
        "cel-selection.yaml",
    } <= names
    readme = (EXAMPLES_DIR / "README.md").read_text(encoding="utf-8")
    for name in names:
        assert f"`{name}`" in readme, f"examples/README.md does not describe {name}"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_validates(path: Path, version: str) -> None:
    objects = list(load_manifest_file(path))
    assert objects, f"{path.name} is empty"
    _check(objects, version)


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    if obj["kind"] in ("Deployment", "Job", "DaemonSet", "StatefulSet"):
        return [obj["spec"]["template"]["spec"]]
    return []


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_references_resolve(path: Path) -> None:
    """Claims name our classes; pods name claims and templates the file defines; containers use them."""
    objects = list(load_manifest_file(path))
    chart_classes = {o["metadata"]["name"] for o in render_chart(None) if o["kind"] == "DeviceClass"}
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "ResourceClaim"}
    templates = {o["metadata"]["name"] for o in objects if o["kind"] == "ResourceClaimTemplate"}
    for obj in objects:
        spec = {"ResourceClaim": obj.get("spec"), "ResourceClaimTemplate": obj.get("spec", {}).get("spec")}
        claim_spec = spec.get(obj["kind"])
        if claim_spec:
            for request in claim_spec["devices"]["requests"]:
                assert request["exactly"]["deviceClassName"] in chart_classes
        for pod in _pod_specs(obj):
            pod_claims = {c["name"]: c for c in pod["resourceClaims"]}
            for entry in pod_claims.values():
                assert entry.get("resourceClaimName") in claims or (
                    entry.get("resourceClaimTemplateName") in templates
                ), entry
            for container in pod["containers"]:
                for used in container["resources"]["claims"]:
                    assert used["name"] in pod_claims


def test_gang_example_is_gated_and_labelled() -> None:
    (job,) = [o for o in load_manifest_file(EXAMPLES_DIR / "gang-job.yaml") if o["kind"] == "Job"]
    template = job["spec"]["template"]
    assert template["spec"]["schedulingGates"] == [{"name": "fractional.dev/allocation"}]
    assert template["metadata"]["labels"]["fractional.dev/gang"]
    size = template["metadata"]["annotations"]["fractional.dev/gang-size"]
    assert int(size) == job["spec"]["parallelism"] == job["spec"]["completions"] == 4
