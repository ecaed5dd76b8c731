"""What preparing a claim means, computed without side effects.

``compute_prepared_devices(claim, inventory, settings)`` may run any number of times with the same
result: the same claim gives the same devices, CDI names and container edits. ``DeviceState``
records them in the checkpoint before running any effect, and re-renders the CDI files from them.

Container environment (the FRACTIONAL_* part is ours; sharing backends add theirs):

- every device: ``FRACTIONAL_CLAIM_UID``;
- every GPU of a claim: ``FRACTIONAL_GPU_UUID``, ``FRACTIONAL_GPU_MEMORY_LIMIT`` (bytes),
  ``FRACTIONAL_GPU_COMPUTE_PERCENT`` (0 = best effort) and ``FRACTIONAL_GPU_SHARING`` (backend).
  With several GPUs in one claim each variable holds one comma-separated value per GPU, in the
  same order (the order of the allocation results), so every device of the claim sets identical
  values and CDI's merge order never matters;
- every NIC of a claim: ``FRACTIONAL_NIC_INTERFACE``, ``NCCL_SOCKET_IFNAME`` (interface names) and,
  for RDMA NICs, ``FRACTIONAL_NIC_RDMA_DEVICE`` and ``NCCL_IB_HCA`` (comma-separated likewise),
  plus on real hosts the ``/dev/infiniband`` nodes (``uverbsN`` of each NIC and ``rdma_cm``).

``published_capacity(gpu)`` is what ``driver.slices`` publishes for a GPU (``memory`` rounded down to
256Mi, ``compute`` 100): the node agent refuses shares that would take a GPU past it.
``PreparedDevice.allocation_key()`` is what the API decided for a device (device, share, limits),
without what this agent version renders from it: two computations of one allocation have equal keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from driver.errors import ClaimError
from driver.inventory.model import GPU, NIC, NodeInventory
from driver.plugin import cdi
from driver.plugin.claims import (
    AllocationResult,
    Claim,
    ClaimRef,
    ClaimUID,
    base_request_name,
    bounded,
    check_node_selector,
    quoted,
)
from driver.plugin.gpuconfig import GpuConfig, resolve_share_configs
from driver.plugin.sharing.base import ContainerEdits, DeviceNode, ShareSpec, SharingBackend

__all__ = [
    "COMPUTE_CAPACITY_PERCENT",
    "MEMORY_STEP_BYTES",
    "BackendChoice",
    "DeviceCapacity",
    "DeviceKind",
    "PrepareSettings",
    "PreparedDevice",
    "choose_backend",
    "compute_prepared_devices",
    "deduplicated_edits",
    "make_claim_ref",
    "published_capacity",
]

# published memory is rounded down to this (docs/architecture.md: The share model)
MEMORY_STEP_BYTES = 256 * 1024 * 1024
COMPUTE_CAPACITY_PERCENT = 100  # a GPU's published ``compute`` capacity
RDMA_CM_NODE = "/dev/infiniband/rdma_cm"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class DeviceKind(StrEnum):
    GPU = "gpu"
    NIC = "nic"


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str
    options: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class DeviceCapacity:
    """A GPU's consumable capacities as its ResourceSlice publishes them."""

    memory_bytes: int
    compute_percent: int


def published_capacity(gpu: GPU) -> DeviceCapacity:
    """Pure: the ``memory`` and ``compute`` capacity ``driver.slices.build_gpu_device`` publishes."""
    return DeviceCapacity(
        memory_bytes=gpu.memory_bytes // MEMORY_STEP_BYTES * MEMORY_STEP_BYTES,
        compute_percent=COMPUTE_CAPACITY_PERCENT,
    )


AllocationKey = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One allocation result of a prepared claim: what the kubelet gets and what CDI injects."""

    kind: DeviceKind
    request_names: tuple[str, ...]
    pool: str
    device: str
    share_id: str | None
    cdi_name: str
    cdi_device_ids: tuple[str, ...]
    edits: ContainerEdits
    admin_access: bool = False
    share: ShareSpec | None = None  # GPUs only
    backend: str | None = None  # GPUs only: the sharing backend enforcing ``share``

    def allocation_key(self) -> AllocationKey:
        """What the API allocated and the limits enforced on it; container edits and CDI ids, which
        an agent upgrade may render differently, are left out."""
        share = self.share
        limits = (
            None
            if share is None
            else (
                share.gpu_uuid,
                share.memory_bytes,
                share.compute_percent,
                share.whole_gpu,
                share.backend_options,
            )
        )
        return (
            str(self.kind),
            self.request_names,
            self.pool,
            self.device,
            self.share_id,
            self.admin_access,
            self.backend,
            limits,
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": str(self.kind),
            "requestNames": list(self.request_names),
            "pool": self.pool,
            "device": self.device,
            "shareID": self.share_id,
            "cdiName": self.cdi_name,
            "cdiDeviceIDs": list(self.cdi_device_ids),
            "containerEdits": cdi.render_container_edits(self.edits),
            "adminAccess": self.admin_access,
            "backend": self.backend,
        }
        if self.share is not None:
            share = self.share
            data["share"] = {
                "claimUID": share.claim_uid,
                "device": share.device,
                "gpuUUID": share.gpu_uuid,
                "ordinal": share.ordinal,
                "shareID": share.share_id,
                "memoryBytes": share.memory_bytes,
                "computePercent": share.compute_percent,
                "wholeGPU": share.whole_gpu,
                "backendOptions": [list(pair) for pair in share.backend_options],
            }
            if share.claim_key:
                data["share"]["claimKey"] = share.claim_key
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PreparedDevice:
        raw_share = data.get("share")
        share = None
        if raw_share is not None:
            share = ShareSpec(
                claim_uid=str(raw_share["claimUID"]),
                device=str(raw_share["device"]),
                gpu_uuid=str(raw_share["gpuUUID"]),
                ordinal=int(raw_share["ordinal"]),
                share_id=raw_share.get("shareID"),
                memory_bytes=int(raw_share["memoryBytes"]),
                compute_percent=int(raw_share["computePercent"]),
                whole_gpu=bool(raw_share["wholeGPU"]),
                backend_options=tuple((str(k), str(v)) for k, v in raw_share.get("backendOptions", ())),
                claim_key=str(raw_share.get("claimKey", "")),
            )
        return cls(
            kind=DeviceKind(data["kind"]),
            request_names=tuple(data["requestNames"]),
            pool=str(data["pool"]),
            device=str(data["device"]),
            share_id=data.get("shareID"),
            cdi_name=str(data["cdiName"]),
            cdi_device_ids=tuple(data["cdiDeviceIDs"]),
            edits=cdi.parse_container_edits(data.get("containerEdits", {})),
            admin_access=bool(data.get("adminAccess", False)),
            share=share,
            backend=data.get("backend"),
        )


@dataclass(frozen=True, slots=True, eq=False)
class PrepareSettings:
    """Node-wide inputs of ``compute_prepared_devices`` (fixed for the agent's lifetime)."""

    default_backend: str = "none"  # --sharing
    allow_claim_backend_override: bool = True  # false: a FromClaim config naming a backend is refused
    backends: Mapping[str, SharingBackend] = field(default_factory=dict)
    pool_name: str | None = None  # None: the node name (node-local pool)
    toolkit_cdi: bool = False  # real GPUs: also hand out the NVIDIA toolkit's nvidia.com/gpu=<uuid>
    rdma_device_nodes: Mapping[str, tuple[DeviceNode, ...]] = field(default_factory=dict)  # real hosts


def make_claim_ref(*, namespace: str, name: str, uid: str) -> ClaimRef:
    """The kubelet's ``{namespace, uid, name}``, checked before it reaches a URL or a file name."""
    key = f"{bounded(namespace, 63)}/{bounded(name, 253)}"  # the kubelet's values, echoed bounded
    if not _DNS_LABEL.fullmatch(namespace):
        raise ClaimError(claim=key, field="namespace", problem=f"{quoted(namespace)} is not a DNS label")
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise ClaimError(claim=key, field="metadata.name", problem=f"{quoted(name)} is not a DNS subdomain")
    cdi.check_name_part(uid, claim=key, field="metadata.uid")
    return ClaimRef(namespace=namespace, name=name, uid=ClaimUID(uid))


def choose_backend(config: GpuConfig | None, default_backend: str) -> BackendChoice:
    """The sharing backend for one GPU result: its effective ``GpuConfig`` (class configs, then
    claim configs, the last matching one wins; ``driver.plugin.gpuconfig``), else the node's
    ``--sharing`` default. Pure."""
    if config is None:
        return BackendChoice(name=default_backend)
    name = config.effective_backend(default_backend)
    return BackendChoice(name=name, options=config.backend_options(name))


def _quantity(claim: Claim, result: AllocationResult, name: str) -> int | None:
    raw = result.consumed(name)
    if raw is None:
        return None
    # Imported here: the kubernetes package takes ~1 s to import, and the agent answers the
    # kubelet's registration before it has loaded it (see driver.plugin.agent).
    from kubernetes.utils.quantity import parse_quantity

    try:
        return int(parse_quantity(raw))  # type: ignore[no-untyped-call]
    except ValueError as error:
        raise ClaimError(
            claim=claim.key,
            field=f"{result.field}.consumedCapacity.{name}",
            problem=f"{quoted(raw)} is not a quantity",
        ) from error


def _gpu_share(
    claim: Claim, result: AllocationResult, gpu: GPU, ordinal: int, choice: BackendChoice
) -> ShareSpec:
    published_memory = published_capacity(gpu).memory_bytes
    if result.share_id is None:  # exclusive allocation: the whole GPU
        memory, compute = gpu.memory_bytes, 100
    else:
        consumed_memory = _quantity(claim, result, "memory")
        memory = published_memory if consumed_memory is None else consumed_memory
        compute = _quantity(claim, result, "compute") or 0
    if not 0 < memory <= gpu.memory_bytes:
        raise ClaimError(
            claim=claim.key,
            field=f"{result.field}.consumedCapacity.memory",
            problem=f"{memory} bytes is outside 1..{gpu.memory_bytes} of {gpu.name}",
        )
    if not 0 <= compute <= 100:
        raise ClaimError(
            claim=claim.key,
            field=f"{result.field}.consumedCapacity.compute",
            problem=f"{compute} is outside 0..100",
        )
    return ShareSpec(
        claim_uid=claim.uid,
        claim_key=claim.key,
        device=gpu.name,
        gpu_uuid=gpu.uuid,
        ordinal=ordinal,
        share_id=result.share_id,
        memory_bytes=memory,
        compute_percent=compute,
        whole_gpu=memory >= published_memory,
        backend_options=choice.options,
    )


def deduplicated_edits(edits: ContainerEdits) -> ContainerEdits:
    """Pure: ``edits`` without exact repeats (env entries, mounts, device nodes), first one kept.

    Merging the claim-wide FRACTIONAL_* part with a backend's edits, or several backends' edits,
    can repeat an entry (HAMi adds the same cache mount for every share of a claim). A repeated
    identical mount or variable changes nothing in the container but makes the spec longer and
    some runtimes log it; an entry that differs in any field is kept, so a real conflict still shows.
    """
    return ContainerEdits(
        env=tuple(dict.fromkeys(edits.env)),
        mounts=tuple(dict.fromkeys(edits.mounts)),
        device_nodes=tuple(dict.fromkeys(edits.device_nodes)),
    )


def _joined(values: list[str]) -> str:
    return ",".join(values)


def compute_prepared_devices(
    claim: Claim, inventory: NodeInventory, settings: PrepareSettings
) -> tuple[PreparedDevice, ...]:
    """Pure: the devices of ``claim`` (this driver's results only), in allocation order.

    Raises ``ClaimError`` naming the field for a device this node does not have, a foreign pool,
    unsafe names, bad consumed capacity or an unknown sharing backend.
    """
    uid = cdi.check_name_part(claim.uid, claim=claim.key, field="metadata.uid")
    pool_name = settings.pool_name or inventory.node_name
    check_node_selector(claim.body, inventory.node_name, claim.key)
    configs = (
        resolve_share_configs(claim.body, allow_claim_backend=settings.allow_claim_backend_override)
        if claim.results
        else {}
    )
    gpus: list[tuple[AllocationResult, GPU, ShareSpec, str, SharingBackend]] = []
    nics: list[tuple[AllocationResult, NIC]] = []
    for result in claim.results:
        cdi.check_name_part(result.device, claim=claim.key, field=f"{result.field}.device")
        if result.share_id is not None:
            cdi.check_name_part(result.share_id, claim=claim.key, field=f"{result.field}.shareID")
        if result.pool != pool_name:
            raise ClaimError(
                claim=claim.key,
                field=f"{result.field}.pool",
                problem=f"{quoted(result.pool)} is not this node's {pool_name!r}",
            )
        gpu, nic = inventory.gpu(result.device), inventory.nic(result.device)
        if gpu is not None:
            choice = choose_backend(configs.get(result.request), settings.default_backend)
            backend = settings.backends.get(choice.name)
            if backend is None:
                raise ClaimError(
                    claim=claim.key,
                    field=f"{result.field} sharing backend",
                    problem=f"{quoted(choice.name)} is not enabled on this node "
                    f"(have {sorted(settings.backends)})",
                )
            gpus.append(
                (result, gpu, _gpu_share(claim, result, gpu, len(gpus), choice), choice.name, backend)
            )
        elif nic is not None:
            nics.append((result, nic))
        else:
            raise ClaimError(
                claim=claim.key,
                field=f"{result.field}.device",
                problem=f"{quoted(result.device)} is not a device of this node",
            )

    claim_env: tuple[str, ...] = (f"FRACTIONAL_CLAIM_UID={uid}",)
    gpu_env = claim_env
    if gpus:
        gpu_env += (
            "FRACTIONAL_GPU_UUID=" + _joined([gpu.uuid for _, gpu, _, _, _ in gpus]),
            "FRACTIONAL_GPU_MEMORY_LIMIT=" + _joined([str(share.memory_bytes) for _, _, share, _, _ in gpus]),
            "FRACTIONAL_GPU_COMPUTE_PERCENT="
            + _joined([str(share.compute_percent) for _, _, share, _, _ in gpus]),
            "FRACTIONAL_GPU_SHARING=" + _joined([name for _, _, _, name, _ in gpus]),
        )
    nic_env = claim_env
    nic_nodes: tuple[DeviceNode, ...] = ()
    if nics:
        if_names = _joined([nic.if_name for _, nic in nics])
        nic_env += (f"FRACTIONAL_NIC_INTERFACE={if_names}", f"NCCL_SOCKET_IFNAME={if_names}")
        rdma_devices = [nic.rdma_device for _, nic in nics if nic.rdma_device]
        if rdma_devices:
            nic_env += (
                f"FRACTIONAL_NIC_RDMA_DEVICE={_joined(rdma_devices)}",
                f"NCCL_IB_HCA={_joined(rdma_devices)}",
            )
            nodes = [node for rdma in rdma_devices for node in settings.rdma_device_nodes.get(rdma, ())]
            if nodes:
                nic_nodes = (*nodes, DeviceNode(path=RDMA_CM_NODE))

    prepared: dict[int, PreparedDevice] = {}
    for result, gpu, share, backend_name, backend in gpus:
        name = cdi.device_name(uid, result.device, result.share_id)
        ids: tuple[str, ...] = (cdi.qualified_device_id("gpu", name),)
        if settings.toolkit_cdi:
            ids += (cdi.toolkit_device_id(gpu.uuid),)
        edits = deduplicated_edits(ContainerEdits(env=gpu_env).merged(backend.container_edits(share)))
        prepared[result.index] = PreparedDevice(
            kind=DeviceKind.GPU,
            request_names=(base_request_name(result.request),),
            pool=result.pool,
            device=result.device,
            share_id=result.share_id,
            cdi_name=name,
            cdi_device_ids=ids,
            edits=edits,
            admin_access=result.admin_access,
            share=share,
            backend=backend_name,
        )
    for result, _nic in nics:
        name = cdi.device_name(uid, result.device, result.share_id)
        prepared[result.index] = PreparedDevice(
            kind=DeviceKind.NIC,
            request_names=(base_request_name(result.request),),
            pool=result.pool,
            device=result.device,
            share_id=result.share_id,
            cdi_name=name,
            cdi_device_ids=(cdi.qualified_device_id("nic", name),),
            edits=deduplicated_edits(ContainerEdits(env=nic_env, device_nodes=nic_nodes)),
            admin_access=result.admin_access,
        )
    return tuple(prepared[index] for index in sorted(prepared))
