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


def test_gang_one_pod_more_than_gpus_is_rejected_and_one_less_fits() -> None:
    """9 pods of whole GPU + NIC on one PCIe root do not fit 8 GPU/NIC pairs; 8 do (one per pair)."""
    import random

    from driver.allocator import allocate
    from driver.demo.objects import build_claim, build_device_classes, gpu_request, nic_request
    from driver.inventory.discover import discover_inventory
    from driver.slices import build_resource_slices

    slices = build_resource_slices(discover_inventory(backend="fake", profile="h100-8x", node_name="n1"))

    def gang(size: int) -> list[dict[str, object]]:
        claims = []
        for i in range(size):
            claim = build_claim(f"c{i}", "ns", [gpu_request(), nic_request()], match_pcie_root=True)
            claim["metadata"]["uid"] = f"uid-{i}"
            claims.append(claim)
        return claims

    for policy in ("best-fit", "first-fit"):
        fits = allocate(gang(8), slices=slices, classes=build_device_classes(), policy=policy,
                        pod_groups=[[i] for i in range(8)], rng=random.Random(1))  # fmt: skip
        assert fits is not None
        assert len({r["device"] for a in fits for r in a["devices"]["results"]}) == 16
        assert allocate(gang(9), slices=slices, classes=build_device_classes(), policy=policy,
                        pod_groups=[[i] for i in range(9)], rng=random.Random(1)) is None  # fmt: skip
