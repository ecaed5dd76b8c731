"""GangUnschedulable names what is short: when the devices fit but the node's CPU,
memory or pod slots do not take the pods, the Event says so, not "devices"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.controller.conftest import Cluster, RunningController, gated_pod, gpu_claim, wait_for

pytestmark = pytest.mark.shared  # also run on the real apiserver (--cluster=real)


def _unschedulable(cluster: Cluster) -> list[dict[str, Any]]:
    return [e for e in cluster.events() if e["reason"] == "GangUnschedulable"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("requests", "node", "short"),
    [
        ({"cpu": "8", "memory": "1Gi"}, {"cpu": "4"}, "node CPU is short"),
        ({"cpu": "1", "memory": "600Gi"}, {}, "node memory is short"),  # nodes have 512Gi
        ({"cpu": "1", "memory": "1Gi"}, {"pods": "0"}, "node pod count is short"),
    ],
)
def test_unschedulable_event_names_the_short_node_resource(
    cluster: Cluster, controller: Callable[..., RunningController], requests: dict[str, str],
    node: dict[str, str], short: str,
) -> None:  # fmt: skip
    cluster.add_node("node-a", "l4-2x", **node)
    cluster.create_claim(gpu_claim("c", memory="4Gi"))
    pod = gated_pod("p", ["c"])
    pod["spec"]["containers"][0]["resources"]["requests"] = requests
    cluster.create_pod(pod)
    controller()
    # The Event that names the short resource: any other (none is expected, add_node waits for the
    # real apiserver's not-ready taint to be lifted) does not count.
    (event,) = wait_for(
        lambda: [e for e in _unschedulable(cluster) if short in e["message"]][-1:],
        what="GangUnschedulable event naming the short resource",
    )
    message = event["message"]
    assert short in message, message
    assert "node-a" in message and "devices do not fit" not in message
    assert message.index(short) < message.index("best node"), message  # the cause comes first
    assert not cluster.allocated("c") and not cluster.ungated("p")
