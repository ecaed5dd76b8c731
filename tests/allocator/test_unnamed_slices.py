def test_unnamed_slices_of_two_nodes_do_not_replace_each_other() -> None:
    """Slices built locally (generateName only, as driver.slices builds them) still count per node."""
    import random

    from driver.allocator import allocate
    from driver.demo.objects import build_claim, build_device_classes, gpu_request
    from driver.inventory.discover import discover_inventory
    from driver.slices import build_resource_slices

    slices = []
    for node in ("n1", "n2"):
        slices += build_resource_slices(discover_inventory(backend="fake", profile="l4-2x", node_name=node))
    assert all("name" not in s["metadata"] for s in slices)
    claims = []
    for i in range(4):
        claim = build_claim(f"c{i}", "ns", [gpu_request(memory="20Gi")])
        claim["metadata"]["uid"] = f"uid-{i}"
        claims.append(claim)
    result = allocate(
        claims,
        slices=slices,
        classes=build_device_classes(),
        pod_groups=[[i] for i in range(4)],
        rng=random.Random(1),
    )
    assert result is not None
    placed = {(a["devices"]["results"][0]["pool"], a["devices"]["results"][0]["device"]) for a in result}
    assert placed == {("n1", "gpu-0"), ("n1", "gpu-1"), ("n2", "gpu-0"), ("n2", "gpu-1")}
