"""The real control plane behind the tests' ``api_server`` fixture (``pytest --cluster=real``).

etcd, kube-apiserver and kube-controller-manager of the local cluster's harness
(``hack/localcluster``), started once per session: no scheduler and no kubelet, as the emulator
has neither. The controller-manager is there because the emulator's built-in controllers stand in
for it (namespace deletion, claims from templates, garbage collection).

Each test expects the empty cluster the emulator gives it, so after each one everything it made is
removed: every object that was not there when the control plane came up (its finalizers cleared,
pods without grace), then the namespaces it made (finalized at once, their content being gone).
Test hooks that only the emulator has (fault injection, request counts) skip the test that uses
them on the real server.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from kubernetes import client, config

from driver.cluster.apiserver import bodies
from tests.differential.engine import http_sender
from tests.go_modules import provisioning_request_crd_path

REPO_ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("FRACTIONAL_REAL_STATE_DIR", "/tmp/fractional-real-apiserver"))
# No kubelet ever reports on the tests' Nodes. kube-controller-manager's node-lifecycle controller
# keeps each Node's health by name and forgets a deleted one only at its next 5 s pass: a Node the
# next test makes under the same name within that window inherits the old record, and is tainted
# node.kubernetes.io/unreachable at once when that record is older than the grace period (60 s by
# default). Seen as gangs held with "no node offers any" in random cases of a long run. Two hours of
# grace keeps every such Node healthy for a session, as the emulator's are; the not-ready taint that
# admission puts on a new Node is still lifted by that controller within about 2 s.
CONTROL_PLANE_ARGS = {
    "kube-controller-manager": ["--node-monitor-grace-period=2h", "--node-startup-grace-period=2h"],
}
# Custom resources the controller uses that no component of the bare control plane serves, from
# their published Go modules.
DEFINITIONS = (provisioning_request_crd_path,)
# Listed by the namespace that holds them, never deleted one by one.
_SKIPPED_TYPES = {("", "namespaces"), ("", "componentstatuses"), ("", "bindings")}


def _localcluster() -> Any:
    hack = str(REPO_ROOT / "hack")
    if hack not in sys.path:
        sys.path.insert(0, hack)
    import localcluster.cluster as module

    return module


@dataclass(frozen=True, slots=True)
class _Type:
    group: str
    version: str
    plural: str
    namespaced: bool

    @property
    def base(self) -> str:
        return f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        path = self.base
        if self.namespaced and namespace:
            path += f"/namespaces/{namespace}"
        path += f"/{self.plural}"
        return path + (f"/{name}" if name else "")


@dataclass
class RealAPIServer:
    """The surface of the emulator's ``APIServer`` that the tests use, on a real kube-apiserver."""

    cluster: Any  # localcluster.cluster.LocalCluster
    version: str
    _baseline: set[str] = field(default_factory=set)
    _context: ssl.SSLContext | None = None

    # ------------------------------------------------------------------ the emulator's surface
    @property
    def url(self) -> str:
        return str(self.cluster.apiserver_url)

    def configuration(self) -> client.Configuration:
        configuration = client.Configuration()
        config.load_kube_config(str(self.cluster.kubeconfig), client_configuration=configuration)
        return configuration

    def write_kubeconfig(self, path: str) -> None:
        Path(path).write_text(Path(self.cluster.kubeconfig).read_text(encoding="utf-8"), encoding="utf-8")

    def request_count(self, *args: Any, **kwargs: Any) -> NoReturn:
        pytest.skip("counts requests: only the emulator counts what it serves")

    def reset_counts(self) -> NoReturn:
        pytest.skip("counts requests: only the emulator counts what it serves")

    def inject_fault(self, *args: Any, **kwargs: Any) -> NoReturn:
        pytest.skip("injects an apiserver fault: only the emulator can")

    def object_count(self, *plurals: str) -> NoReturn:
        pytest.skip("reads the emulator's store")

    # ------------------------------------------------------------------ HTTP
    def tls_context(self) -> ssl.SSLContext:
        """The admin's client certificate and the cluster's CA (made once per control plane)."""
        if self._context is None:
            pki = Path(self.cluster.pki_dir)
            context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
            context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
            self._context = context
        return self._context

    def call(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
             accept: str = "application/json") -> tuple[int, Any]:  # fmt: skip
        """One request as the admin; (status, the decoded JSON answer or the raw text)."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        headers = {"Accept": accept, **({"Content-Type": content_type} if data is not None else {})}
        status, _, raw = http_sender(self.url, context=self.tls_context())(method, path, data, headers)
        try:
            return status, bodies.loads(raw)  # the hostile tests' claims nest deeper than json allows
        except ValueError:
            return status, raw.decode(errors="replace")

    # ------------------------------------------------------------------ state between tests
    def types(self) -> list[_Type]:
        """Every listable, deletable resource the server serves now (each group's preferred version)."""
        found: list[_Type] = []
        _, groups = self.call("GET", "/apis")
        versions = [("", "v1")] + [
            (g["name"], g["preferredVersion"]["version"]) for g in groups.get("groups", [])
        ]
        for group, version in versions:
            base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
            status, listing = self.call("GET", base)
            if status != 200:
                continue
            for resource in listing.get("resources", []):
                verbs = set(resource.get("verbs") or ())
                if "/" in resource["name"] or not {"list", "delete"} <= verbs:
                    continue
                if (group, resource["name"]) in _SKIPPED_TYPES:
                    continue
                found.append(_Type(group, version, resource["name"], bool(resource["namespaced"])))
        return found

    def _objects(self) -> list[tuple[_Type, dict[str, Any]]]:
        objects = []
        for rtype in self.types():
            status, listing = self.call("GET", rtype.path())
            if status == 200:
                objects.extend((rtype, item) for item in listing.get("items", []))
        return objects

    def _namespaces(self) -> list[dict[str, Any]]:
        return list(self.call("GET", "/api/v1/namespaces")[1].get("items", []))

    def install_definitions(self) -> None:
        """The custom resources of components the bare control plane lacks but the controller uses
        (cluster-autoscaler's ProvisioningRequest, as the emulator serves it), served before the
        baseline is taken, so every reset keeps them."""
        for where in DEFINITIONS:
            path = where()
            definition = yaml.safe_load(path.read_text(encoding="utf-8"))
            status, answer = self.call(
                "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", definition
            )
            if status not in (201, 409):
                raise RuntimeError(f"{path.name}: the CRD was refused ({status}): {answer}")
            name = definition["metadata"]["name"]
            deadline = time.monotonic() + 30
            while not _established(
                self.call("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")[1]
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"CRD {name} not established 30 s after it was made")
                time.sleep(0.1)

    def take_baseline(self) -> None:
        """What the control plane made for itself: kept by every reset."""
        deadline = time.monotonic() + 60
        while self.call("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the controller-manager made no default service account in 60 s")
            time.sleep(0.2)
        time.sleep(1.0)  # its other start-up writes (root CA configmaps, leases)
        self._baseline = {item["metadata"]["uid"] for _, item in self._objects()}
        self._baseline |= {ns["metadata"]["uid"] for ns in self._namespaces()}

    def reset(self) -> None:
        """Remove everything made since the baseline; where that fails, a fresh control plane, so
        one test's leftovers never fail the next."""
        try:
            self._reset()
        except Exception as error:  # any failure: start clean rather than cascade
            sys.stderr.write(f"real backend: clean-up failed ({error}); starting a fresh control plane\n")
            self.cluster.down()
            fresh = start(self.version)
            self.cluster, self._baseline, self._context = fresh.cluster, fresh._baseline, None

    def _reset(self) -> None:
        """Remove everything made since the baseline, custom objects before their definitions."""
        objects = [(t, o) for t, o in self._objects() if o["metadata"]["uid"] not in self._baseline]
        objects.sort(key=lambda entry: entry[0].plural == "customresourcedefinitions")
        for rtype, item in objects:
            metadata = item["metadata"]
            path = rtype.path(metadata.get("namespace"), metadata["name"])
            if metadata.get("finalizers") and rtype.plural != "customresourcedefinitions":
                self.call("PATCH", path, {"metadata": {"finalizers": None}},
                          content_type="application/merge-patch+json")  # fmt: skip
            self.call("DELETE", path, {"gracePeriodSeconds": 0, "propagationPolicy": "Background"})
        for namespace in self._namespaces():
            if namespace["metadata"]["uid"] in self._baseline:
                continue
            name = namespace["metadata"]["name"]
            self.call("DELETE", f"/api/v1/namespaces/{name}")
            # Its content is gone already: finalize it now rather than wait for the namespace controller.
            status, current = self.call("GET", f"/api/v1/namespaces/{name}")
            if status == 200:
                current["spec"] = {"finalizers": []}
                self.call("PUT", f"/api/v1/namespaces/{name}/finalize", current)
        self._wait_gone(objects)

    def _wait_gone(self, objects: list[tuple[_Type, dict[str, Any]]]) -> None:
        deadline = time.monotonic() + 30
        pending = [(t, o) for t, o in objects if t.plural == "customresourcedefinitions"]
        pending += [(_Type("", "v1", "namespaces", False), ns) for ns in self._namespaces()
                    if ns["metadata"]["uid"] not in self._baseline]  # fmt: skip
        for rtype, item in pending:
            path = rtype.path(None, item["metadata"]["name"])
            while self.call("GET", path)[0] != 404:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{path} still there 30 s after the test's clean-up")
                time.sleep(0.1)


def _established(definition: Any) -> bool:
    conditions = (
        (definition.get("status") or {}).get("conditions") or () if isinstance(definition, dict) else ()
    )
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def start(version: str | None = None) -> RealAPIServer:
    """The control plane of ``version`` (K8S_VERSION, default the harness's), up and baselined."""
    module = _localcluster()
    version = (version or os.environ.get("K8S_VERSION") or module.DEFAULT_VERSION).lstrip("v")
    cluster = module.LocalCluster(state_dir=STATE_DIR, version=version, extra_args=CONTROL_PLANE_ARGS)
    if cluster.processes.get("kube-apiserver") is not None:
        cluster.down()  # a session that was killed left it behind
        cluster = module.LocalCluster(state_dir=STATE_DIR, version=version, extra_args=CONTROL_PLANE_ARGS)
    binaries = module.Binaries.build(version, "control-plane")
    try:
        cluster.up_control_plane(binaries, components=("etcd", "kube-apiserver", "kube-controller-manager"))
        server = RealAPIServer(cluster=cluster, version=version)
        server.install_definitions()
        server.take_baseline()
    except BaseException:
        cluster.down()
        raise
    return server


def stop(server: RealAPIServer) -> None:
    server.cluster.down()
