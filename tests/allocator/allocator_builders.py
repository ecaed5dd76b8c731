"""Small builders of API-shaped dicts for allocator tests (camelCase, as the API server serves them)."""

from __future__ import annotations

from typing import Any

DRIVER = "driver-a"
OURS = "fractional.dev"
GI = 1 << 30


def device(
    name: str,
    *,
    attributes: dict[str, Any] | None = None,
    capacity: dict[str, Any] | None = None,
    multi: bool | None = None,
    taints: list[dict[str, Any]] | None = None,
    consumes: list[dict[str, Any]] | None = None,
    binding_conditions: list[str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name}
    if attributes:
        out["attributes"] = {
            k: v if isinstance(v, dict) else {_attr_kind(v): v} for k, v in attributes.items()
        }
    if capacity:
        out["capacity"] = {k: v if isinstance(v, dict) else {"value": str(v)} for k, v in capacity.items()}
    if multi is not None:
        out["allowMultipleAllocations"] = multi
    if taints:
        out["taints"] = taints
    if consumes:
        out["consumesCounters"] = consumes
    if binding_conditions:
        out["bindingConditions"] = binding_conditions
        out["bindingFailureConditions"] = ["failed"]
    out.update(extra)
    return out


def _attr_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return "string"


def version(text: str) -> dict[str, str]:
    return {"version": text}


def resource_slice(
    name: str,
    devices: list[dict[str, Any]] | None = None,
    *,
    node: str | None = "node1",
    pool: str | None = None,
    driver: str = DRIVER,
    generation: int = 1,
    count: int = 1,
    all_nodes: bool = False,
    node_selector: dict[str, Any] | None = None,
    counters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": pool or node or name, "generation": generation, "resourceSliceCount": count},
    }
    if all_nodes:
        spec["allNodes"] = True
    elif node_selector is not None:
        spec["nodeSelector"] = node_selector
    else:
        spec["nodeName"] = node
    if devices is not None:
        spec["devices"] = devices
    if counters is not None:
        spec["sharedCounters"] = counters
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


def device_class(
    name: str = "class-a",
    *,
    driver: str = DRIVER,
    selectors: list[str] | None = None,
    config: list[Any] | None = None,
) -> dict[str, Any]:
    expressions = selectors if selectors is not None else [f'device.driver == "{driver}"']
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": e}} for e in expressions]}
    if config:
        spec["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": spec,
    }


def exact(
    name: str = "req0",
    *,
    class_name: str = "class-a",
    count: int | None = None,
    all_devices: bool = False,
    selectors: list[str] | None = None,
    capacity: dict[str, str] | None = None,
    admin: bool = False,
    tolerations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": class_name}
    if all_devices:
        body["allocationMode"] = "All"
    else:
        body["allocationMode"] = "ExactCount"
        body["count"] = count or 1
    if selectors:
        body["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    if capacity:
        body["capacity"] = {"requests": capacity}
    if admin:
        body["adminAccess"] = True
    if tolerations:
        body["tolerations"] = tolerations
    return {"name": name, "exactly": body}


def first_available(name: str, *subs: dict[str, Any]) -> dict[str, Any]:
    """``subs`` are built with ``exact(sub_name, ...)``; their bodies become the subrequests."""
    return {"name": name, "firstAvailable": [{"name": s["name"], **s["exactly"]} for s in subs]}


def claim(
    name: str = "claim-0",
    *requests: dict[str, Any],
    constraints: list[dict[str, Any]] | None = None,
    config: list[dict[str, Any]] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests) or [exact()]}
    if constraints:
        devices["constraints"] = constraints
    if config:
        devices["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"},
        "spec": {"devices": devices},
    }


def with_allocation(raw_claim: dict[str, Any], allocation: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw_claim)
    out["status"] = {"allocation": allocation}
    return out


def allocated_result(
    device_name: str, *, pool: str = "node1", request: str = "req0", driver: str = DRIVER, **extra: Any
) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device_name, **extra}


def allocated_claim(name: str, *results: dict[str, Any]) -> dict[str, Any]:
    return with_allocation(claim(name), {"devices": {"results": list(results)}})


# ------------------------------------------------ slices like ours (docs/architecture.md: The share model)


def gpu_device(
    index: int, *, memory_gi: int = 80, numa: int = 0, pcie_root: str | None = None, multi: bool = True
) -> dict[str, Any]:
    memory = memory_gi * GI
    step = 256 << 20
    memory_capacity: dict[str, Any] = {"value": f"{memory_gi}Gi"}
    compute: dict[str, Any] = {"value": "100"}
    if multi:
        memory_capacity["requestPolicy"] = {
            "default": f"{memory_gi}Gi",
            "validRange": {"min": str(step), "max": f"{memory_gi}Gi", "step": str(step)},
        }
        compute["requestPolicy"] = {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}
    assert memory % step == 0
    return device(
        f"gpu-{index}",
        attributes={
            "type": "gpu",
            "uuid": f"GPU-{index:04d}",
            "resource.kubernetes.io/numaNode": numa,
            "resource.kubernetes.io/pcieRoot": pcie_root or f"pci0000:{index:02x}",
        },
        capacity={"memory": memory_capacity, "compute": compute},
        multi=multi if multi else None,
    )


def nic_device(index: int, *, numa: int = 0, pcie_root: str | None = None) -> dict[str, Any]:
    return device(
        f"nic-{index}",
        attributes={
            "type": "nic",
            "resource.kubernetes.io/numaNode": numa,
            "resource.kubernetes.io/pcieRoot": pcie_root or f"pci0000:{index:02x}",
        },
        capacity={"bandwidth": "100000"},
    )


def node_slice(
    node: str,
    *,
    gpus: int = 8,
    memory_gi: int = 80,
    nics: int = 0,
    multi: bool = True,
    generation: int = 1,
) -> dict[str, Any]:
    """Our node slice: GPU i on NUMA i // (gpus/2), one PCIe root per GPU pair, NIC j beside GPU pair j."""
    half = max(1, gpus // 2)
    devices = [
        gpu_device(i, memory_gi=memory_gi, numa=i // half, pcie_root=f"pci{i // 2}", multi=multi)
        for i in range(gpus)
    ]
    devices += [
        nic_device(j, numa=(2 * j) // max(1, gpus) if gpus else 0, pcie_root=f"pci{j}") for j in range(nics)
    ]
    return resource_slice(f"{node}-{OURS}", devices, node=node, driver=OURS, generation=generation)


def our_classes() -> list[dict[str, Any]]:
    return [
        device_class(
            "gpu.fractional.dev", driver=OURS,
            selectors=[f'device.driver == "{OURS}" && device.attributes["{OURS}"].type == "gpu"'],
        ),
        device_class(
            "nic.fractional.dev", driver=OURS,
            selectors=[f'device.driver == "{OURS}" && device.attributes["{OURS}"].type == "nic"'],
        ),
    ]  # fmt: skip


def share(name: str, memory_gi: float, compute: int = 0, *, namespace: str = "default") -> dict[str, Any]:
    """A single-share claim of our GPU class."""
    memory = f"{int(memory_gi * 1024)}Mi"
    return claim(
        name,
        exact("gpu", class_name="gpu.fractional.dev", capacity={"memory": memory, "compute": str(compute)}),
        namespace=namespace,
    )


def gpu_cluster(nodes: int, gpus: int = 8) -> Any:
    """A ``ClusterState`` of ``nodes`` nodes of ``gpus`` 80 GiB GPUs each, our classes installed."""
    from driver.allocator import ClusterState

    state = ClusterState()
    for device_class in our_classes():
        state.upsert_class(device_class)
    for index in range(nodes):
        state.upsert_slice(node_slice(f"n{index:02d}", gpus=gpus))
    return state
