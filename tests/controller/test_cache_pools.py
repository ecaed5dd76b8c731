"""The cache's index by pool: what a gang's commit reads instead of every slice and claim (the scan
of every claim took a tenth of the controller's CPU in a 1,000-pod backlog on a real cluster)."""

from __future__ import annotations

from typing import Any

from driver.controller.view.cache import ClusterCache, Kind

DRIVER = "fractional.dev"


def resource_slice(name: str, pool: str, driver: str = DRIVER) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {"driver": driver, "nodeName": pool, "pool": {"name": pool, "generation": 1,
                 "resourceSliceCount": 1}, "devices": [{"name": "gpu-0"}]},
    }  # fmt: skip


def claim(name: str, rv: str, *pools: str) -> dict[str, Any]:
    results = [{"request": "gpu", "driver": DRIVER, "pool": pool, "device": "gpu-0"} for pool in pools]
    status = {"allocation": {"devices": {"results": results}}} if pools else {}
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": rv},
        "spec": {},
        "status": status,
    }


def names(objects: list[dict[str, Any]]) -> set[str]:
    return {str(o["metadata"]["name"]) for o in objects}


def test_claims_are_found_by_the_pools_of_their_results_as_they_change() -> None:
    cache = ClusterCache(topology_label="zone")
    cache.apply(Kind.CLAIM, "ADDED", claim("c", "1"))
    assert cache.in_pools(Kind.CLAIM, {(DRIVER, "node-a")}) == []  # not allocated: in no pool
    cache.apply(Kind.CLAIM, "MODIFIED", claim("c", "2", "node-a", "node-b"))
    cache.apply(Kind.CLAIM, "ADDED", claim("d", "3", "node-b"))
    assert names(cache.in_pools(Kind.CLAIM, {(DRIVER, "node-a")})) == {"c"}
    assert names(cache.in_pools(Kind.CLAIM, {(DRIVER, "node-b")})) == {"c", "d"}
    assert cache.in_pools(Kind.CLAIM, {("other.example.com", "node-b")}) == []
    cache.apply(Kind.CLAIM, "MODIFIED", claim("c", "4", "node-b"))  # moved off node-a
    assert cache.in_pools(Kind.CLAIM, {(DRIVER, "node-a")}) == []
    cache.apply(Kind.CLAIM, "MODIFIED", claim("c", "5"))  # deallocated
    assert names(cache.in_pools(Kind.CLAIM, {(DRIVER, "node-a"), (DRIVER, "node-b")})) == {"d"}
    cache.apply(Kind.CLAIM, "DELETED", claim("d", "6", "node-b"))
    assert cache.in_pools(Kind.CLAIM, {(DRIVER, "node-b")}) == []


def test_slices_are_found_by_their_pool_and_a_relist_drops_what_is_gone() -> None:
    cache = ClusterCache(topology_label="zone")
    cache.apply(Kind.SLICE, "ADDED", resource_slice("a-1", "node-a"))
    cache.apply(Kind.SLICE, "ADDED", resource_slice("b-1", "node-b"))
    cache.apply(Kind.SLICE, "ADDED", resource_slice("x-1", "node-a", driver="other.example.com"))
    assert names(cache.in_pools(Kind.SLICE, {(DRIVER, "node-a")})) == {"a-1"}
    cache.replace(Kind.SLICE, [resource_slice("b-1", "node-b")])
    assert cache.in_pools(Kind.SLICE, {(DRIVER, "node-a")}) == []
    assert names(cache.in_pools(Kind.SLICE, {(DRIVER, "node-b")})) == {"b-1"}
