"""examples/kueue/: every Kueue object is created in the emulator serving Kueue v0.19.2's CRDs (so
their schemas validate it), every core object too (strict Kubernetes schemas); the Configuration's
deviceClassMappings follow Kueue's rules and charge what the files' comments say; the Kueue twins
of examples Kueue refuses are ones it accepts."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from driver.cluster.apiserver import APIServer
from driver.controller.kueue.quota import (
    GPU_MEMORY_RESOURCE,
    NIC_RESOURCE,
    compute_claim_charges,
    kueue_refusals,
    parse_mappings,
)
from driver.inventory.fake import load_profile, resolve_profile
from driver.slices import build_device_classes, build_resource_slices
from tests.kueue_support import install_kueue_crds

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KUEUE_EXAMPLES = sorted((EXAMPLES / "kueue").glob("*.yaml"))
GI = 1024**3


def _objects(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


@pytest.fixture(scope="module")
def api() -> Iterator[client.ApiClient]:
    with APIServer() as server, client.ApiClient(server.configuration()) as api_client:
        install_kueue_crds(api_client)
        yield api_client


def _create(api: client.ApiClient, obj: dict[str, Any]) -> None:
    group, _, version = obj["apiVersion"].rpartition("/")
    namespace = obj["metadata"].get("namespace")
    if obj["kind"] == "ResourceClaimTemplate":
        client.ResourceV1Api(api).create_namespaced_resource_claim_template(namespace, obj)
    elif obj["kind"] == "Job":
        client.BatchV1Api(api).create_namespaced_job(namespace, obj)
    else:
        plural = {"ResourceFlavor": "resourceflavors", "AdmissionCheck": "admissionchecks",
                  "ClusterQueue": "clusterqueues", "LocalQueue": "localqueues"}[obj["kind"]]  # fmt: skip
        objects = client.CustomObjectsApi(api)
        if namespace:
            objects.create_namespaced_custom_object(group, version, namespace, plural, obj)
        else:
            objects.create_cluster_custom_object(group, version, plural, obj)


def test_every_example_is_accepted_by_the_schemas(api: client.ApiClient) -> None:
    kinds = []
    for path in KUEUE_EXAMPLES:
        for obj in _objects(path):
            kinds.append(obj["kind"])
            if obj["kind"] == "Configuration":
                continue  # Kueue's manager config, not an API object: checked below
            _create(api, obj)
    assert {"Configuration", "ResourceFlavor", "AdmissionCheck", "ClusterQueue", "LocalQueue", "Job"} <= set(
        kinds
    )


def test_a_bad_object_is_refused_by_the_crd_schema(api: client.ApiClient) -> None:
    (queue,) = _objects(EXAMPLES / "kueue" / "cluster-queue.yaml")
    queue["metadata"]["name"] = "too-many-flavors"
    queue["spec"]["resourceGroups"][0]["coveredResources"] = [f"r{i}" for i in range(65)]  # maxItems 64
    with pytest.raises(client.ApiException) as error:
        _create(api, queue)
    assert error.value.status == 422


def test_configuration_follows_kueues_rules_and_charges_as_documented() -> None:
    (configuration,) = _objects(EXAMPLES / "kueue" / "kueue-configuration.yaml")
    assert configuration["featureGates"]["KueueDRAIntegrationConsumableCapacity"] is True
    raw = configuration["resources"]["deviceClassMappings"]
    assert len(raw) <= 16 and len({m["name"] for m in raw}) == len(raw)  # pkg/config/validation.go
    assert all(1 <= len(m["deviceClassNames"]) <= 8 for m in raw)
    mappings = parse_mappings(configuration)
    classes = build_device_classes()
    assert {c["metadata"]["name"] for c in classes} == {n for m in mappings for n in m.device_class_names}
    slices = build_resource_slices(load_profile(resolve_profile("h100-8x"), node_name="n1"))
    templates = {
        o["metadata"]["name"]: o["spec"]["spec"]
        for path in KUEUE_EXAMPLES
        for o in _objects(path)
        if o["kind"] == "ResourceClaimTemplate"
    }
    charge = {name: compute_claim_charges(spec, slices=slices, classes=classes, mappings=mappings)
              for name, spec in templates.items()}  # fmt: skip
    assert charge["gpu-share-20gi"] == {GPU_MEMORY_RESOURCE: Decimal(20 * GI)}
    assert charge["rdma-nic"] == {NIC_RESOURCE: Decimal(1)}
    assert charge["whole-gpu"] == {GPU_MEMORY_RESOURCE: Decimal(79 * GI)}
    assert charge["big-ampere-or-newer"] == {GPU_MEMORY_RESOURCE: Decimal(16 * GI)}
    (queue,) = _objects(EXAMPLES / "kueue" / "cluster-queue.yaml")
    quota = {
        r["name"]: r["nominalQuota"] for r in queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    }
    assert quota[GPU_MEMORY_RESOURCE] == "1264Gi" and quota[NIC_RESOURCE] == 16  # two h100-8x nodes


@pytest.mark.parametrize(
    ("original", "twin"),
    [("whole-gpu-pod.yaml", "whole-gpu-job.yaml"), ("cel-selection.yaml", "cel-selection-job.yaml")],
)
def test_kueue_twins_are_accepted_where_the_originals_are_refused(original: str, twin: str) -> None:
    def refusals(path: Path) -> list[str]:
        found = []
        for obj in _objects(path):
            spec = obj.get("spec") or {}
            pod_spec = spec if obj["kind"] == "Pod" else (spec.get("template") or {}).get("spec")
            if obj["kind"] in ("Pod", "Job") and pod_spec:
                found += kueue_refusals(pod_spec, name=obj["metadata"]["name"])
            if obj["kind"] == "ResourceClaimTemplate":
                found += kueue_refusals(spec["spec"], name=obj["metadata"]["name"])
        return found

    assert refusals(EXAMPLES / original), f"{original} should be one Kueue refuses"
    assert refusals(EXAMPLES / "kueue" / twin) == []
    for obj in _objects(EXAMPLES / "kueue" / twin):
        if obj["kind"] == "Job":
            gates = [g["name"] for g in obj["spec"]["template"]["spec"]["schedulingGates"]]
            assert gates == ["fractional.dev/allocation"]  # our gate in the pod template
            assert obj["spec"]["suspend"] is True and obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]


def test_the_example_flavor_selects_no_label_that_nodes_lack() -> None:
    """Kueue copies a flavor's nodeLabels into the pods it admits: the example once named
    fractional.dev/gpu-node, which nothing sets, so admitted pods could never be scheduled."""
    flavors = [o for path in KUEUE_EXAMPLES for o in _objects(path) if o.get("kind") == "ResourceFlavor"]
    assert flavors
    known = {"nvidia.com/gpu.present", "kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for flavor in flavors:
        assert set((flavor.get("spec") or {}).get("nodeLabels") or {}) <= known, flavor["metadata"]["name"]
