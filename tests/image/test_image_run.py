"""The image as deployed: the node agent and the controller from ``make image``, against the
embedded API on the host.

Run by ``make image-test`` (hack/image-test.sh), which builds the image first and names the
container runtime (FRACTIONAL_IMAGE_RUNTIME, e.g. ``podman --runtime runc``) and the image
(FRACTIONAL_IMAGE). Host network; the agent's socket and CDI directories are bind-mounted at the
same paths, so the kubelet simulator on the host reaches the sockets the agent advertises.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver import DRIVER_NAME
from driver.cluster.kubelet import KubeletSimulator
from driver.controller import GATE
from driver.inventory.fake import load_profile, resolve_profile
from driver.kube.client import load_configuration
from driver.slices import build_device_classes, build_resource_slices

pytestmark = [pytest.mark.image, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNTIME = shlex.split(os.environ.get("FRACTIONAL_IMAGE_RUNTIME", ""))
IMAGE = os.environ.get("FRACTIONAL_IMAGE", "fractional-dra:dev")
PROFILE = "l4-2x"  # 2 GPUs (gpu-0, gpu-1) + 1 RDMA NIC, shipped in the image
NAMESPACE = "default"
NON_ROOT_USER = "65532:65532"  # the Dockerfile's USER
MAX_IMAGE_BYTES = 300 * 1000 * 1000
T = 60.0  # generous deadline for polls: containers start slowly on a loaded 2-core machine


@pytest.fixture(autouse=True)
def _runtime_named() -> None:
    if not RUNTIME:
        pytest.skip("run through `make image-test` (it builds the image and names the runtime)")


def ctr(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*RUNTIME, *args], capture_output=True, text=True, check=False, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{shlex.join(done.args)}: exit {done.returncode}: {done.stderr[-2000:]}")
    return done


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = T) -> Any:
    deadline = time.monotonic() + timeout
    waiter = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        waiter.wait(0.05)


def checkout_version() -> str:
    with (REPO_ROOT / "pyproject.toml").open("rb") as file:
        return str(tomllib.load(file)["project"]["version"])


def agent_user() -> str:
    """Root, as the chart runs the agent, when the test is root or podman maps container root to
    the caller (rootless); with a rootful docker and a non-root caller, the caller's ids, so that
    what the agent writes into the bind mounts stays the caller's to read and remove."""
    if os.getuid() == 0 or Path(RUNTIME[0]).name == "podman":
        return "0:0"
    return f"{os.getuid()}:{os.getgid()}"


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """Under /tmp (socket paths stay under 108 bytes), traversable by the image's non-root user."""
    path = Path(tempfile.mkdtemp(prefix="fdi-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():  # left by a container user the caller cannot override: remove it as one
            ctr("run", "--rm", "--user", "0:0", "--entrypoint", "rm", "-v", f"{path}:{path}", IMAGE,
                "-rf", str(path), check=False)  # fmt: skip
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class Api:
    kubeconfig: Path
    api_client: client.ApiClient

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @property
    def resource(self) -> client.ResourceV1Api:
        return client.ResourceV1Api(self.api_client)

    def read(self, response: Any) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(response.data)
        return body


@pytest.fixture
def api(work_dir: Path) -> Iterator[Api]:
    """``fractional apiserver`` on the host, as a process; its kubeconfig readable by any user."""
    kubeconfig = work_dir / "kubeconfig"
    command = [sys.executable, "-m", "driver", "apiserver", "--port", "0"]
    command += ["--write-kubeconfig", str(kubeconfig)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:  # bounded by the test's timeout
            if line.startswith("kubeconfig written"):
                break
        else:
            raise AssertionError(f"fractional apiserver exited with {process.wait()}")
        kubeconfig.chmod(0o644)
        with client.ApiClient(load_configuration(str(kubeconfig))) as api_client:
            api = Api(kubeconfig=kubeconfig, api_client=api_client)
            for device_class in build_device_classes():
                api.resource.create_device_class(device_class)
            yield api
    finally:
        process.terminate()
        process.communicate(timeout=30)  # also closes its stdout


@dataclass
class Container:
    name: str

    def logs(self) -> str:
        done = ctr("logs", self.name, check=False)
        return (done.stdout + done.stderr)[-4000:]

    def stop(self) -> int:
        """SIGTERM, then the exit code once it has stopped."""
        ctr("kill", "--signal", "TERM", self.name)
        return int(ctr("wait", self.name, timeout=T).stdout.strip().splitlines()[-1])


@pytest.fixture
def run_container() -> Iterator[Callable[..., Container]]:
    started: list[Container] = []

    def run(*args: str, user: str | None = None) -> Container:
        container = Container(name=f"fractional-image-test-{uuid.uuid4().hex[:8]}")
        options = ["--user", user] if user else []
        ctr("run", "--detach", "--name", container.name, "--network", "host", *options, *args)
        started.append(container)
        return container

    yield run
    for container in started:
        ctr("rm", "--force", container.name, check=False)


def sockets_under(*directories: Path) -> list[Path]:
    return [
        path
        for directory in directories
        if directory.exists()
        for path in directory.rglob("*")
        if stat.S_ISSOCK(path.lstat().st_mode)
    ]


def test_version_matches_the_checkout() -> None:
    done = ctr("run", "--rm", IMAGE, "--version")
    assert done.stdout.strip() == f"fractional {checkout_version()}"


def test_image_is_lean_and_non_root() -> None:
    inspected = json.loads(ctr("image", "inspect", IMAGE).stdout)[0]
    assert inspected["Config"]["User"] == NON_ROOT_USER
    assert inspected["Size"] < MAX_IMAGE_BYTES, f"{inspected['Size'] / 1e6:.0f} MB"
    # Only the runtime: no pip, no demo extra.
    done = ctr("run", "--rm", "--entrypoint", "python", IMAGE, "-c",
               "import importlib.util as u; print([m for m in ('pip', 'matplotlib', 'kubernetes_validate')"
               " if u.find_spec(m)])")  # fmt: skip
    assert done.stdout.strip() == "[]"


def test_agent_registers_prepares_unprepares_and_stops_on_sigterm(
    api: Api, work_dir: Path, run_container: Callable[..., Container]
) -> None:
    registry, plugin, cdi = (work_dir / "registry", work_dir / "plugin", work_dir / "cdi")
    for directory in (registry, plugin, cdi):
        directory.mkdir()
    agent = run_container(
        "--volume", f"{work_dir}:{work_dir}", IMAGE,
        "plugin", "--node-name", "node-a", "--backend", "fake", "--profile", PROFILE,
        "--registry-dir", str(registry), "--plugin-dir", str(plugin), "--cdi-root", str(cdi),
        "--kubeconfig", str(api.kubeconfig), "--metrics-port", "0", "--log-format", "json",
        user=agent_user(),
    )  # fmt: skip
    kubelet = KubeletSimulator(registry, kubelet_version="1.35")
    try:
        registration = kubelet.register(timeout=T)
    except Exception as error:
        raise AssertionError(f"the agent did not register: {error}\n{agent.logs()}") from None
    try:
        assert registration.driver_name == DRIVER_NAME
        assert registration.endpoint.parent == plugin
        wait_for(lambda: api.read(api.resource.list_resource_slice(
            field_selector="spec.nodeName=node-a", _preload_content=False))["items"],
            "the agent's ResourceSlices")  # fmt: skip

        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": "image-claim", "namespace": NAMESPACE},
                 "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                     "deviceClassName": "gpu.fractional.dev"}}]}}}  # fmt: skip
        created = api.read(
            api.resource.create_namespaced_resource_claim(NAMESPACE, claim, _preload_content=False)
        )
        share_id = str(uuid.uuid4())
        created["status"] = {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER_NAME, "pool": "node-a",
                                     "device": "gpu-1", "shareID": share_id,
                                     "consumedCapacity": {"memory": "3Gi", "compute": "50"}}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]},
        }}  # fmt: skip
        api.resource.replace_namespaced_resource_claim_status("image-claim", NAMESPACE, created)
        ref = {"namespace": NAMESPACE, "name": "image-claim", "uid": created["metadata"]["uid"]}

        answer = kubelet.prepare([ref])[ref["uid"]]
        assert answer["error"] == "", agent.logs()
        (device,) = answer["devices"]
        (cdi_id,) = device["cdi_device_ids"]
        assert cdi_id.startswith("k8s.fractional.dev/gpu=")
        (spec_path,) = cdi.glob("*.json")  # written by the container, read by the caller
        spec = json.loads(spec_path.read_text())
        assert [f"{spec['kind']}={entry['name']}" for entry in spec["devices"]] == [cdi_id]

        assert kubelet.unprepare([ref]) == {ref["uid"]: {"error": ""}}
        assert not list(cdi.glob("*.json"))
    finally:
        kubelet.close()

    assert sockets_under(registry, plugin)
    assert agent.stop() == 0, agent.logs()
    assert not sockets_under(registry, plugin), agent.logs()


def test_controller_as_non_root_allocates_a_gated_pod_and_removes_its_gate(
    api: Api, run_container: Callable[..., Container]
) -> None:
    inventory = load_profile(resolve_profile(PROFILE), node_name="node-b")
    allocatable = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    api.core.create_node({"apiVersion": "v1", "kind": "Node",
                          "metadata": {"name": "node-b", "labels": {"kubernetes.io/hostname": "node-b",
                                                                    **dict(inventory.labels)}},
                          "status": {"allocatable": allocatable, "capacity": allocatable}})  # fmt: skip
    for resource_slice in build_resource_slices(inventory):
        api.resource.create_resource_slice(resource_slice)
    api.resource.create_namespaced_resource_claim(NAMESPACE, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "gated-claim", "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.fractional.dev",
            "capacity": {"requests": {"memory": "12Gi", "compute": "15"}}}}]}},
    })  # fmt: skip
    api.core.create_namespaced_pod(NAMESPACE, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gated", "namespace": NAMESPACE},
        "spec": {"schedulingGates": [{"name": GATE}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": "gated-claim"}],
                 "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                 "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                               "claims": [{"name": "gpu"}]}}]},
    })  # fmt: skip

    # No --user: the image's own non-root user.
    controller = run_container(
        "--volume", f"{api.kubeconfig}:{api.kubeconfig}:ro", IMAGE,
        "controller", "--kubeconfig", str(api.kubeconfig), "--metrics-port", "0", "--log-format", "json",
    )  # fmt: skip
    assert ctr("inspect", "--format", "{{.Config.User}}", controller.name).stdout.strip() == NON_ROOT_USER

    def ungated() -> bool:
        pod = api.read(api.core.read_namespaced_pod("gated", NAMESPACE, _preload_content=False))
        return not any(gate["name"] == GATE for gate in pod["spec"].get("schedulingGates") or ())

    try:
        wait_for(ungated, "the controller to remove the gate")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{controller.logs()}") from None
    claim = api.read(
        api.resource.read_namespaced_resource_claim("gated-claim", NAMESPACE, _preload_content=False)
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER_NAME, "node-b")
    assert controller.stop() == 0, controller.logs()
