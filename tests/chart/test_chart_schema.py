"""values.schema.json: a typo or a wrong type fails `helm install`/`helm lint`, and it covers values.yaml."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from chart_support import CHART_DIR, NAMESPACE, render_chart

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text(encoding="utf-8"))
DEFAULTS = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))

# Objects deliberately passed through: Kubernetes types the API server validates, Helm's
# `global`, and the per-backend GpuConfig options the agent decodes strictly at prepare time.
PASS_THROUGH = {
    "agent.affinity",
    "controller.affinity",
    "global",
    "deviceClasses.gpu.config.sharing.mps",
    "deviceClasses.gpu.config.sharing.hami",
}


def _objects(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if schema.get("type") == "object" or "properties" in schema:
        yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from _objects(child, f"{path}.{name}" if path else name)
    for key in ("anyOf", "oneOf", "allOf"):
        for child in schema.get(key, []):
            yield from _objects(child, path)
    if isinstance(schema.get("items"), dict):
        yield from _objects(schema["items"], f"{path}[]")


def test_every_object_closes_its_keys() -> None:
    for path, schema in _objects(SCHEMA):
        assert "additionalProperties" in schema, f"{path or '<root>'}: additionalProperties not set"
        extra = schema["additionalProperties"]
        if extra is True:
            assert path in PASS_THROUGH, f"{path}: open object"
        elif isinstance(extra, dict):
            assert "properties" not in schema, f"{path}: a map must not also declare properties"


def test_defaults_follow_the_schema() -> None:
    jsonschema.Draft7Validator(SCHEMA).validate(DEFAULTS)


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for name, child in schema.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        paths.add(path)
        paths |= _schema_paths(child, path)
    return paths


def _value_paths(values: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for name, child in values.items():
        path = f"{prefix}.{name}" if prefix else name
        paths.add(path)
        if isinstance(child, dict) and path not in _MAPS:
            paths |= _value_paths(child, path)
    return paths


_MAPS = {"agent.resources.requests", "agent.resources.limits", "controller.resources.requests"}
_MAPS |= {"controller.resources.limits", "metrics.dashboard.labels"}


def test_every_default_value_is_declared() -> None:
    declared = _schema_paths(SCHEMA)
    assert _value_paths(DEFAULTS) - declared == set()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"fakeDevice": {"enabled": True}}, "additional properties 'fakeDevice' not allowed"),
        ({"fakeDevices": {"enable": True}}, "additional properties 'enable' not allowed"),
        ({"agent": {"resource": {}}}, "additional properties 'resource' not allowed"),
        ({"agent": {"resources": {"request": {"cpu": "1"}}}}, "additional properties 'request' not allowed"),
        ({"sharing": {"backend": "MPS"}}, "sharing/backend"),
        ({"controller": {"replicas": "2"}}, "controller/replicas"),
        ({"controller": {"policy": "bestfit"}}, "controller/policy"),
        ({"agent": {"metricsPort": 0}}, "agent/metricsPort"),
        ({"agent": {"tolerations": [{"key": "a", "efect": "NoSchedule"}]}}, "'efect' not allowed"),
        ({"agent": {"extraEnv": {"NODE_NAME": "x"}}}, "invalid propertyName 'NODE_NAME'"),
        ({"metrics": {"serviceMonitor": {"enabled": True, "intreval": "1m"}}}, "'intreval' not allowed"),
        ({"deviceClasses": {"gpu": {"config": {"sharing": {"backend": "mig"}}}}}, "sharing/backend"),
        ({"deviceClasses": {"gpu": {"config": {"sharnig": {}}}}}, "'sharnig' not allowed"),
        ({"realGpu": {"nvidiaDriverRoot": "run/nvidia/driver"}}, "realGpu/nvidiaDriverRoot"),
        ({"controller": {"kubeAPIQPS": -1}}, "controller/kubeAPIQPS"),
        ({"controller": {"kubeAPIBurst": 0}}, "controller/kubeAPIBurst"),
        ({"controller": {"flowSchema": {"enable": False}}}, "'enable' not allowed"),
        (
            {"controller": {"flowSchema": {"matchingPrecedence": 0}}},
            "controller/flowSchema/matchingPrecedence",
        ),
    ],
)
def test_a_typo_fails_install_and_lint(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match="don't meet the specifications") as raised:
        render_chart(values)
    assert message in str(raised.value)
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace=NAMESPACE)
    assert any(message in error for error in report["errors"]), report
