"""A gang whose node goes away while its allocations are being written: the re-check
before the gates come off covers the nodes and devices the gang was placed on; the written
allocations are cleared and the gang is planned again, no pod ungated onto the deleted node."""

from __future__ import annotations

import threading

import pytest

from driver.controller import WriteRecord
from driver.controller.model.objects import allocation_node
from driver.controller.view.cache import Kind
from tests.controller.conftest import Cluster, wait_for
from tests.controller.test_gang_faults import Harness, gang_state, harness, make_gang

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)

__all__ = ["harness"]  # the fixture, imported for pytest


def delete_node_and_slices(cluster: Cluster, node: str) -> None:
    cluster.core.delete_node(node)
    for resource_slice in cluster.resource.list_resource_slice().to_dict()["items"]:
        if (resource_slice.get("spec") or {}).get("node_name") == node:
            cluster.resource.delete_resource_slice(resource_slice["metadata"]["name"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("after_allocations", [1, 4])
def test_node_deleted_between_writes_is_never_ungated_onto(harness: Harness, after_allocations: int) -> None:
    cluster = harness.cluster
    for name in ("node-a", "node-b", "node-c"):
        cluster.add_node(name, "l4-2x")  # 6 L4s: 4 one-GPU claims fit on the two nodes left
    names = make_gang(cluster, "g")
    allocations: list[str] = []
    deleted: list[str] = []
    ungated_on: list[tuple[str, str]] = []
    fired = threading.Event()
    holder: dict[str, object] = {}

    def hook(record: WriteRecord) -> None:
        if record.action == "ungate":
            pod = record.key.split("/", 1)[1]
            claim = cluster.claim(pod)
            node = allocation_node(((claim or {}).get("status") or {}).get("allocation"))
            ungated_on.append((pod, str(node)))
        if record.action != "allocate" or fired.is_set():
            return
        allocations.append(record.key)
        if len(allocations) != after_allocations:
            return
        fired.set()
        wait_for(lambda: "controller" in holder, what="the test holds its controller")
        instance = holder["controller"]
        claim = cluster.claim(record.key.split("/", 1)[1])
        node = allocation_node((claim or {})["status"]["allocation"])
        assert node is not None
        deleted.append(node)
        delete_node_and_slices(cluster, node)

        def seen() -> bool:
            cache = instance.cache  # type: ignore[attr-defined]
            slices = [s for s in cache.objects(Kind.SLICE) if s["spec"].get("nodeName") == node]
            return cache.get(Kind.NODE, node) is None and not slices

        wait_for(seen, what=f"the controller saw Node {node} and its slices deleted")

    holder["controller"] = harness.start(hook)
    wait_for(fired.is_set, what="the fault injected")
    wait_for(lambda: gang_state(cluster, names) == "whole", what="the gang placed again, whole")
    gone = deleted[0]
    assert all(node != gone for _pod, node in ungated_on), ungated_on
    for name in names:
        claim = cluster.claim(name)
        assert allocation_node((claim or {})["status"]["allocation"]) != gone
