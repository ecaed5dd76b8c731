"""Helpers for the chart tests: render the chart with the Helm SDK, validate objects strictly.

``render_chart`` goes through ``helm_python`` (Helm v4's Go SDK behind a C ABI, no ``helm``
binary), which also checks the values against ``values.schema.json``. ``validate_strict`` is
``kubernetes_validate.validate(..., strict=True)`` with the compiled validator kept per schema:
the package re-reads its schema files on every call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import referencing
import yaml

__all__ = [
    "CHART_DIR",
    "EXAMPLES_DIR",
    "FROM_RELEASE",
    "KUBE_VERSIONS",
    "NAMESPACE",
    "RELEASE",
    "REPO_ROOT",
    "VALUES_FILES",
    "SchemaMissing",
    "load_manifest_file",
    "object_id",
    "release",
    "render_chart",
    "rendered_for",
    "validate_strict",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "fractional-dra"
EXAMPLES_DIR = REPO_ROOT / "examples"
RELEASE = "fractional-dra"
NAMESPACE = "fractional-system"
KUBE_VERSIONS = ("1.34", "1.35", "1.37")

# (apiVersion, kind) the chart renders only from this release on (its templates choose by the
# cluster's version); Helm renders offline as for a newer release, so the tests check them there.
FROM_RELEASE = {
    ("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicy"): "1.36",
    ("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicyBinding"): "1.36",
}

# Values sets every rendering test runs: the defaults (real GPUs), then charts/fractional-dra/ci/.
VALUES_FILES: dict[str, Path | None] = {"default": None} | {
    path.stem: path for path in sorted((CHART_DIR / "ci").glob("*-values.yaml"))
}

_SCHEMA_ROOT = Path(kubernetes_validate.__file__).resolve().parent / "kubernetes-json-schema"


class SchemaMissing(LookupError):
    """kubernetes-validate ships no schema for this kind in this version (e.g. CRD kinds)."""


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def rendered_for(obj: dict[str, Any], version: str) -> bool:
    """Whether the chart installs ``obj`` on a cluster of ``version`` (FROM_RELEASE)."""
    since = FROM_RELEASE.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    return since is None or release(version) >= release(since)


def load_values(name: str) -> dict[str, Any] | None:
    path = VALUES_FILES[name]
    if path is None:
        return None
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict), f"{path}: expected a mapping"
    return loaded


@cache
def _chart() -> helm.Chart:
    return helm.Chart.load(str(CHART_DIR))


def render_chart(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """All objects the chart renders with ``values`` (NOTES.txt left out), in template order."""
    manifests = _chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[dict[str, Any]] = []
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            continue
        for document in yaml.safe_load_all(text):
            if document:
                assert isinstance(document, dict), f"{template}: a document is not a mapping"
                objects.append(document)
    return objects


def render_notes(values: dict[str, Any] | None = None) -> str:
    manifests = _chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for template, text in manifests.items() if template.endswith("NOTES.txt"))


def load_manifest_file(path: Path) -> Iterator[dict[str, Any]]:
    for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if document:
            assert isinstance(document, dict), f"{path}: a document is not a mapping"
            yield document


def object_id(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def _schema_dir(version: str) -> Path:
    """Same choice as kubernetes_validate: the newest schema set not newer than ``version``."""
    candidates = sorted(
        (tuple(int(part) for part in path.name[1:].split("-")[0].split(".")[:2]), path)
        for path in _SCHEMA_ROOT.glob("v*-local-strict")
    )
    wanted = tuple(int(part) for part in version.split("."))
    usable = [path for key, path in candidates if key <= wanted]
    if not usable:
        raise SchemaMissing(f"no schemas for Kubernetes {version}")
    return usable[-1]


@cache
def _definitions(version: str) -> referencing.Resource[Any]:
    text = (_schema_dir(version) / "_definitions.json").read_text(encoding="utf-8")
    return referencing.Resource.from_contents(json.loads(text))


@cache
def _validator(version: str, kind: str, api_version: str) -> jsonschema.Draft202012Validator:
    group_version = api_version.split("/")
    if len(group_version) == 2:
        group = group_version[0].split(".")[0]
        file_name = f"{kind.lower()}-{group}-{group_version[1]}.json"
    else:
        file_name = f"{kind.lower()}-{api_version}.json"
    path = _schema_dir(version) / file_name
    if not path.exists():
        raise SchemaMissing(f"no strict schema for {api_version} {kind} in Kubernetes {version}")
    schema = json.loads(path.read_text(encoding="utf-8"))
    registry = referencing.Registry().with_resources(
        [("file:///" + file_name, referencing.Resource.from_contents(schema))]
    )
    registry = _definitions(version) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_strict(obj: dict[str, Any], version: str) -> None:
    """Raise ``jsonschema.ValidationError`` (with the failing path) or ``SchemaMissing``."""
    validator = _validator(version, str(obj["kind"]), str(obj["apiVersion"]))
    errors = sorted(validator.iter_errors(obj), key=lambda error: list(error.absolute_path))
    if errors:
        raise jsonschema.ValidationError(
            "; ".join(
                f"{'.'.join(str(part) for part in error.absolute_path) or '<root>'}: {error.message}"
                for error in errors[:5]
            )
        )
