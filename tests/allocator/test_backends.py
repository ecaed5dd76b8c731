"""Sharing backends in placement: the allocator never mixes shares whose backends
cannot live on one GPU, never places a backend on a node that cannot run it, and counts the
backends of allocations it did not make (kube-scheduler's) from their ``devices.config``."""

from __future__ import annotations

from typing import Any

import pytest

from driver.allocator import AllocationError, ClusterState, allocate
from driver.allocator.backends import backends_compatible, check_no_claim_backend
from tests.allocator.allocator_builders import OURS, node_slice, our_classes, share, with_allocation


def gpu_config(backend: str | None, requests: list[str] | None = None) -> dict[str, Any]:
    sharing = {} if backend is None else {"backend": backend}
    parameters = {"apiVersion": "fractional.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing}
    entry: dict[str, Any] = {"opaque": {"driver": OURS, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def share_with(name: str, memory_gi: float, backend: str | None) -> dict[str, Any]:
    raw = share(name, memory_gi)
    if backend is not None:
        raw["spec"]["devices"]["config"] = [gpu_config(backend)]
    return raw


def one_node(gpus: int, **attributes: str) -> dict[str, Any]:
    resource_slice = node_slice("node1", gpus=gpus, memory_gi=24)
    for device in resource_slice["spec"]["devices"]:
        for key, value in attributes.items():
            device["attributes"][key] = {"string": value}
    return resource_slice


def place(claims: list[dict[str, Any]], slices: list[dict[str, Any]], allocated: list[dict[str, Any]] = (),
          policy: str = "best-fit") -> list[dict[str, Any]] | None:  # type: ignore[assignment]  # fmt: skip
    return allocate(
        claims, slices=slices, classes=our_classes(), allocated=allocated, node=None, policy=policy
    )


def device_of(allocation: dict[str, Any]) -> str:
    (result,) = allocation["devices"]["results"]
    return str(result["device"])


def allocated(
    raw: dict[str, Any], slices: list[dict[str, Any]], before: list[dict[str, Any]]
) -> dict[str, Any]:
    result = place([raw], slices, before)
    assert result is not None
    return with_allocation(raw, result[0])


@pytest.mark.parametrize("policy", ["best-fit", "first-fit"])
def test_default_share_never_joins_an_mps_share_on_a_node_without_mps_default(policy: str) -> None:
    slices = [one_node(2, sharing="none")]
    mps = allocated(share_with("tenant-mps", 4, "mps"), slices, [])
    later = place([share_with("plain", 4, None)], slices, [mps], policy=policy)
    assert later is not None and device_of(later[0]) != device_of(mps["status"]["allocation"])
    full = [one_node(1, sharing="none")]
    mps_alone = allocated(share_with("tenant-mps", 4, "mps"), full, [])
    assert place([share_with("plain", 4, None)], full, [mps_alone], policy=policy) is None


def test_default_share_joins_mps_where_mps_is_the_node_default() -> None:
    slices = [one_node(1, sharing="mps")]
    mps = allocated(share_with("tenant-mps", 4, "mps"), slices, [])
    assert place([share_with("plain", 4, None)], slices, [mps]) is not None


def test_unpublished_default_keeps_named_and_default_shares_apart() -> None:
    slices = [one_node(1)]  # an agent that does not publish its --sharing
    hami = allocated(share_with("a", 4, "hami"), slices, [])
    assert place([share_with("b", 4, None)], slices, [hami]) is None
    assert place([share_with("c", 4, "none")], slices, [hami]) is not None  # hami and none mix
    assert place([share_with("d", 4, "mps")], slices, [hami]) is None


def test_one_gang_never_mixes_backends_on_a_device() -> None:
    slices = [one_node(2, sharing="none")]
    result = place([share_with("a", 4, "mps"), share_with("b", 4, None)], slices)
    assert result is not None and device_of(result[0]) != device_of(result[1])
    assert place([share_with("a", 4, "mps"), share_with("b", 4, None)], [one_node(1, sharing="none")]) is None


def test_backend_the_node_cannot_run_is_not_placed_there() -> None:
    slices = [one_node(1, sharing="none", sharingBackends="none,hami")]
    assert place([share_with("a", 4, "mps")], slices) is None
    assert place([share_with("b", 4, "hami")], slices) is not None


def test_class_config_picks_the_backend_and_claim_config_overrides_it() -> None:
    classes = our_classes()
    classes[0]["spec"]["config"] = [gpu_config("mps")]
    slices = [one_node(1, sharing="none")]
    state = ClusterState()
    for item in classes:
        state.upsert_class(item)
    state.upsert_slice(slices[0])
    first = state.allocate([share_with("a", 4, None)])  # mps, from its class
    assert first is not None
    state.upsert_claim(with_allocation(share_with("a", 4, None), first[0]))
    assert state.allocate([share_with("b", 4, "none")]) is None  # none beside the class's mps
    assert state.allocate([share_with("c", 4, None)]) is not None  # mps, from its class too


def test_released_share_frees_its_backend() -> None:
    slices = [one_node(1, sharing="none")]
    state = ClusterState()
    for item in our_classes():
        state.upsert_class(item)
    state.upsert_slice(slices[0])
    mps = allocated(share_with("a", 4, "mps"), slices, [])
    state.upsert_claim(mps)
    assert state.allocate([share_with("b", 4, None)]) is None
    state.remove_claim(mps["metadata"]["uid"])
    assert state.allocate([share_with("b", 4, None)]) is not None


@pytest.mark.parametrize(
    ("first", "second", "default", "expected"),
    [
        ("mps", "mps", None, True),
        (None, None, None, True),
        ("hami", "none", None, True),
        ("mps", "none", None, False),
        ("mps", None, "mps", True),
        ("mps", None, "none", False),
        ("hami", None, None, False),
        ("hami", None, "none", True),
    ],
)
def test_compatibility_table(
    first: str | None, second: str | None, default: str | None, expected: bool
) -> None:
    assert backends_compatible(first, second, default) is expected
    assert backends_compatible(second, first, default) is expected


def test_claim_backend_refused_naming_the_field_when_overrides_are_forbidden() -> None:
    raw = share_with("t", 4, "none")
    raw["spec"]["devices"]["config"].insert(0, {"opaque": {"driver": "other.dev", "parameters": {}}})
    with pytest.raises(AllocationError, match=r"default/t: spec\.devices\.config\[1\]\.opaque\.parameters"
                       r"\.sharing\.backend: set to 'none'"):  # fmt: skip
        check_no_claim_backend(raw, driver=OURS)
    check_no_claim_backend(share_with("ok", 4, None), driver=OURS)  # no backend named: fine
