"""The allocation guard called by the apiserver itself: the chart's ValidatingWebhookConfiguration
(rendered with Helm), pointed by URL at a controller that serves the guard, and another allocator's
allocations written through the API as kube-scheduler writes them. Shared: the same test runs on
the emulator and on the real kube-apiserver (``pytest --cluster=real``).

The chart leaves the controller's own service account out of the webhook; here the controller and
the other allocator are the same user, so the controller's own allocations reach the guard too and
must pass it (the guard knows them: they are its decisions in flight).
"""

from __future__ import annotations

import base64
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.controller.guard import GUARD_PATH
from tests.chart.chart_support import render_chart
from tests.controller.conftest import NAMESPACE, Cluster, RunningController, gated_pod, gpu_claim, wait_for
from tests.controller.test_allocation_guard import make_certificate

pytestmark = [pytest.mark.shared, pytest.mark.timeout(120)]

NODE = "node-a"
WEBHOOK = "fractional-test-allocation-guard"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def webhook_configuration(port: int, ca: Path) -> dict[str, Any]:
    """The chart's, as rendered, pointed at ``https://127.0.0.1:<port>`` (no Service here)."""
    (rendered,) = [o for o in render_chart() if o["kind"] == "ValidatingWebhookConfiguration"]
    rendered["metadata"] = {"name": WEBHOOK}
    for webhook in rendered["webhooks"]:
        webhook["clientConfig"] = {
            "url": f"https://127.0.0.1:{port}{GUARD_PATH}",
            "caBundle": base64.b64encode(ca.read_bytes()).decode(),
        }
    return dict(rendered)


def allocation_on(device: str, memory: str) -> dict[str, Any]:
    """A share as kube-scheduler writes it (with the reservation for its pod)."""
    return {
        "devices": {"results": [{
            "request": "gpu", "driver": "fractional.dev", "pool": NODE, "device": device,
            "shareID": str(uuid.uuid4()), "consumedCapacity": {"memory": memory, "compute": "0"},
        }]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
    }  # fmt: skip


@pytest.fixture
def guarded(cluster: Cluster, controller: Any, tmp_path: Path) -> Iterator[RunningController]:
    ca = make_certificate(tmp_path)
    port = free_port()
    running = controller(metrics_host="127.0.0.1", allocation_guard_port=port,
                         allocation_guard_cert_dir=str(tmp_path))  # fmt: skip
    registrations = client.AdmissionregistrationV1Api(cluster.api_client)
    registrations.create_validating_webhook_configuration(webhook_configuration(port, ca))
    try:
        yield running
    finally:
        registrations.delete_validating_webhook_configuration(WEBHOOK)


def write_status(cluster: Cluster, claim: dict[str, Any], allocation: dict[str, Any], **options: Any) -> Any:
    body = {**claim, "status": {"allocation": allocation}}
    return cluster.resource.replace_namespaced_resource_claim_status(
        claim["metadata"]["name"], NAMESPACE, body, **options
    )


def refused(
    cluster: Cluster, claim: dict[str, Any], allocation: dict[str, Any], **options: Any
) -> str | None:
    """The guard's refusal of this write, or None when it was stored (or would be, with dry run)."""
    try:
        write_status(cluster, claim, allocation, **options)
    except client.ApiException as error:
        if error.status == 403 and "allocation-guard.fractional.dev" in (error.body or ""):
            return str(error.body)
        raise
    return None


def test_another_allocators_write_past_a_device_the_controller_filled_is_refused(
    cluster: Cluster, guarded: RunningController
) -> None:
    cluster.add_node(NODE, "l4-2x")  # two L4s, 22Gi usable each, shared
    cluster.create_claim(gpu_claim("ours", memory="22Gi", compute=None))
    cluster.create_pod(gated_pod("p", ["ours"]))
    wait_for(
        lambda: cluster.allocated("ours") and cluster.ungated("p"), what="the controller's own placement"
    )
    (ours,) = cluster.claim("ours")["status"]["allocation"]["devices"]["results"]  # type: ignore[index]
    theirs = cluster.create_claim(gpu_claim("theirs", memory="1Gi", compute=None))
    on_ours = allocation_on(ours["device"], "1Gi")
    # kube-apiserver calls the webhook once its informer has the configuration: wait with dry runs.
    deadline = time.monotonic() + 30
    while (message := refused(cluster, theirs, on_ours, dry_run="All")) is None:
        assert time.monotonic() < deadline, "the webhook never came into force"
        time.sleep(0.2)
    assert f"device fractional.dev/{NODE}/{ours['device']}: memory 1Gi asked" in message
    assert refused(cluster, theirs, on_ours) is not None
    assert not (cluster.claim("theirs") or {}).get("status", {}).get("allocation")
    other = "gpu-1" if ours["device"] == "gpu-0" else "gpu-0"
    assert refused(cluster, theirs, allocation_on(other, "1Gi")) is None  # room there: stored
    assert cluster.allocated("theirs")
    late = cluster.create_claim(gpu_claim("late", memory="22Gi", compute=None))
    assert refused(cluster, late, allocation_on(other, "22Gi")) is not None  # 1Gi of it is taken now
