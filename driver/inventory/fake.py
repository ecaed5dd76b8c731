"""The ``fake`` backend: a node described by a YAML profile in ``fake_devices/``.

Profiles are templates (the node name comes from the caller) and are validated on load: a bad
profile raises ``InventoryError`` naming the file, the device and the field. The format is
documented in ``fake_devices/README.md``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import yaml

import driver
from driver.errors import InventoryError
from driver.inventory.model import (
    GPU,
    NIC,
    NodeInventory,
    NUMANode,
    assign_device_names,
    normalize_pci_bus_id,
    normalize_version,
    parse_cpu_list,
)

__all__ = ["PROFILE_DIR", "list_profiles", "load_profile", "resolve_profile"]

PROFILE_DIR = Path(driver.__file__).resolve().parent.parent / "fake_devices"
"""Where the shipped profiles live: ``<repo>/fake_devices``."""

MIB = 1024 * 1024
MIN_USABLE_MEMORY_BYTES = 256 * MIB  # the smallest share (docs/architecture.md: The share model)
MAX_ATTRIBUTE_STRING = 64  # resource.k8s.io DeviceAttribute.string limit

# ``templates`` is free-form and ignored: a place for YAML anchors that devices merge in (``<<: *h100``).
_TOP_LEVEL = {
    "description",
    "driverVersion",
    "cudaDriverVersion",
    "labels",
    "numaNodes",
    "gpus",
    "nics",
    "templates",
}
_GPU_FIELDS = {
    "uuid",
    "productName",
    "brand",
    "architecture",
    "cudaComputeCapability",
    "memoryTotalMiB",
    "memoryReservedMiB",
    "multiprocessors",
    "pciBusId",
    "pcieRoot",
    "numaNode",
    "minorNumber",
    "nvlinkDomain",
    "migEnabled",
}
_NIC_FIELDS = {"ifName", "pciBusId", "pcieRoot", "numaNode", "rdmaDevice", "linkSpeedMbps", "macAddress"}
_GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5,19}$")
_IF_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_DNS_LABELISH = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,62}[A-Za-z0-9])?$")

T = TypeVar("T")
_MISSING = object()


def list_profiles() -> list[str]:
    """Names of the shipped profiles (``fake_devices/<name>.yaml``), sorted."""
    return sorted(path.stem for path in PROFILE_DIR.glob("*.yaml"))


def resolve_profile(name_or_path: str | Path) -> Path:
    """A shipped profile name (``h100-8x``) or a path to a YAML file -> the file's path."""
    candidate = Path(name_or_path)
    if candidate.is_file():
        return candidate
    text = str(name_or_path)
    if "/" not in text and not text.endswith((".yaml", ".yml")):
        shipped = PROFILE_DIR / f"{text}.yaml"
        if shipped.is_file():
            return shipped
    known = ", ".join(list_profiles()) or "none"
    raise InventoryError(
        source=text, problem=f"no such profile file, and not a shipped profile name (shipped: {known})"
    )


def load_profile(path: str | Path, *, node_name: str = "node-1") -> NodeInventory:
    """Read and validate one profile; devices are named ``gpu-<n>``/``nic-<n>`` in PCI bus id order."""
    source = str(path)
    try:
        document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise InventoryError(source=source, problem=f"cannot read: {error.strerror or error}") from error
    except yaml.YAMLError as error:
        raise InventoryError(source=source, problem=f"not valid YAML: {error}") from error
    return _ProfileParser(source).parse(document, node_name=node_name)


class _ProfileParser:
    """Turns one parsed YAML document into a ``NodeInventory``; every error names file/device/field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, problem: str, *, device: str | None = None, field: str | None = None) -> InventoryError:
        return InventoryError(source=self.source, device=device, field=field, problem=problem)

    def parse(self, document: object, *, node_name: str) -> NodeInventory:
        if not isinstance(document, dict):
            raise self.fail(f"expected a mapping at the top level, found {_type_name(document)}")
        unknown = sorted(set(document) - _TOP_LEVEL)
        if unknown:
            raise self.fail(f"unknown field (known: {', '.join(sorted(_TOP_LEVEL))})", field=str(unknown[0]))
        driver_version = self.version(document, "driverVersion", device=None)
        cuda_version = self.version(document, "cudaDriverVersion", device=None)
        labels = self.labels(document.get("labels", {}))
        numa_nodes = self.numa_nodes(self.sequence(document, "numaNodes", required=False))
        cpus_by_node = {node.id: node.cpus for node in numa_nodes}
        gpu_entries = self.sequence(document, "gpus", required=False)
        nic_entries = self.sequence(document, "nics", required=False)
        gpus = [self.gpu(entry, index, cpus_by_node) for index, entry in enumerate(gpu_entries)]
        nics = [self.nic(entry, index, cpus_by_node) for index, entry in enumerate(nic_entries)]
        self.check_unique(gpus, nics)
        gpus = self.link_nvlink_peers(gpus)
        named_gpus, named_nics = assign_device_names(gpus, nics)
        return NodeInventory(
            node_name=node_name,
            gpus=named_gpus,
            nics=named_nics,
            numa_nodes=numa_nodes,
            driver_version=driver_version,
            cuda_driver_version=cuda_version,
            backend="fake",
            labels=labels,
        )

    # -- sections ---------------------------------------------------------------------------

    def sequence(self, document: dict[str, Any], key: str, *, required: bool) -> list[Any]:
        value = document.get(key, _MISSING)
        if value is _MISSING or value is None:
            if required:
                raise self.fail("missing", field=key)
            return []
        if not isinstance(value, list):
            raise self.fail(f"expected a list, found {_type_name(value)}", field=key)
        return value

    def labels(self, value: object) -> tuple[tuple[str, str], ...]:
        if not isinstance(value, dict):
            raise self.fail(f"expected a mapping, found {_type_name(value)}", field="labels")
        for key, label in value.items():
            if not isinstance(key, str) or not isinstance(label, str):
                raise self.fail("keys and values must be strings", field=f"labels.{key}")
        return tuple(sorted(value.items()))

    def numa_nodes(self, entries: list[Any]) -> tuple[NUMANode, ...]:
        nodes: dict[int, NUMANode] = {}
        for index, entry in enumerate(entries):
            where = f"numaNodes[{index}]"
            if not isinstance(entry, dict):
                raise self.fail(f"expected a mapping, found {_type_name(entry)}", device=where)
            unknown = sorted(set(entry) - {"id", "cpus"})
            if unknown:
                raise self.fail("unknown field (known: cpus, id)", device=where, field=str(unknown[0]))
            node_id = self.field(entry, "id", int, device=where)
            if node_id < 0:
                raise self.fail(f"must be >= 0, found {node_id}", device=where, field="id")
            if node_id in nodes:
                raise self.fail(f"NUMA node {node_id} is declared twice", device=where, field="id")
            nodes[node_id] = NUMANode(id=node_id, cpus=self.cpus(entry, where))
        return tuple(nodes[key] for key in sorted(nodes))

    def cpus(self, entry: dict[str, Any], where: str) -> tuple[int, ...]:
        raw = entry.get("cpus", "")
        if isinstance(raw, list) and all(isinstance(cpu, int) and not isinstance(cpu, bool) for cpu in raw):
            if any(cpu < 0 for cpu in raw):
                raise self.fail("CPU numbers must be >= 0", device=where, field="cpus")
            return tuple(sorted(set(raw)))
        if isinstance(raw, int) and not isinstance(raw, bool):
            raw = str(raw)  # "cpus: 0" is a one-CPU list
        if not isinstance(raw, str):
            raise self.fail(
                f"expected a CPU list like '0-3,8-11' or a list of ints, found {_type_name(raw)}",
                device=where,
                field="cpus",
            )
        try:
            return parse_cpu_list(raw)
        except ValueError as error:
            raise self.fail(str(error), device=where, field="cpus") from None

    def gpu(self, entry: object, index: int, cpus_by_node: Mapping[int, tuple[int, ...]]) -> GPU:
        where = self.device_label("gpus", index, entry)
        entry = self.device_mapping(entry, where, _GPU_FIELDS)
        total_mib = self.field(entry, "memoryTotalMiB", int, device=where)
        reserved_mib = self.field(entry, "memoryReservedMiB", int, device=where, default=0)
        for key, value in (("memoryTotalMiB", total_mib), ("memoryReservedMiB", reserved_mib)):
            if value < 0:
                raise self.fail(f"must be >= 0, found {value}", device=where, field=key)
        usable_bytes = (total_mib - reserved_mib) * MIB
        if usable_bytes < MIN_USABLE_MEMORY_BYTES:
            raise self.fail(
                f"usable memory (memoryTotalMiB {total_mib} - memoryReservedMiB {reserved_mib}) "
                "must be at least 256 MiB",
                device=where,
                field="memoryReservedMiB",
            )
        multiprocessors = self.field(entry, "multiprocessors", int, device=where)
        if multiprocessors <= 0:
            raise self.fail(f"must be > 0, found {multiprocessors}", device=where, field="multiprocessors")
        uuid = self.field(entry, "uuid", str, device=where)
        if not _GPU_UUID.fullmatch(uuid):
            raise self.fail(
                f"{uuid!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, lower-case hex)",
                device=where,
                field="uuid",
            )
        minor = self.field(entry, "minorNumber", int, device=where, default=None)
        if minor is not None and minor < 0:
            raise self.fail(f"must be >= 0, found {minor}", device=where, field="minorNumber")
        numa_node = self.numa_node(entry, where, cpus_by_node)
        domain = self.attribute_string(entry, "nvlinkDomain", where, required=False)
        if domain is not None and not _DNS_LABELISH.fullmatch(domain):
            raise self.fail(
                f"{domain!r} must be letters, digits, '-', '_' or '.'", device=where, field="nvlinkDomain"
            )
        return GPU(
            name="",
            uuid=uuid,
            product_name=self.attribute_string(entry, "productName", where) or "",
            brand=self.attribute_string(entry, "brand", where) or "",
            architecture=self.attribute_string(entry, "architecture", where) or "",
            cuda_compute_capability=self.version(entry, "cudaComputeCapability", device=where),
            memory_bytes=usable_bytes,
            multiprocessors=multiprocessors,
            pci_bus_id=self.bus_id(entry, where),
            pcie_root=self.pcie_root(entry, where),
            numa_node=numa_node,
            nvlink_domain=domain,
            minor_number=minor,
            local_cpus=cpus_by_node.get(numa_node, ()) if numa_node is not None else (),
            mig_enabled=self.field(entry, "migEnabled", bool, device=where, default=False),
        )

    def nic(self, entry: object, index: int, cpus_by_node: Mapping[int, tuple[int, ...]]) -> NIC:
        where = self.device_label("nics", index, entry)
        entry = self.device_mapping(entry, where, _NIC_FIELDS)
        if_name = self.field(entry, "ifName", str, device=where)
        if not _IF_NAME.fullmatch(if_name):
            raise self.fail(
                f"{if_name!r} is not an interface name (1-15 characters)", device=where, field="ifName"
            )
        speed = self.field(entry, "linkSpeedMbps", int, device=where, default=None)
        if speed is not None and speed <= 0:
            raise self.fail(f"must be > 0, found {speed}", device=where, field="linkSpeedMbps")
        mac = self.field(entry, "macAddress", str, device=where, default=None)
        if mac is not None and not _MAC.fullmatch(mac.lower()):
            raise self.fail(f"{mac!r} is not a MAC address", device=where, field="macAddress")
        numa_node = self.numa_node(entry, where, cpus_by_node)
        return NIC(
            name="",
            if_name=if_name,
            pci_bus_id=self.bus_id(entry, where),
            pcie_root=self.pcie_root(entry, where),
            numa_node=numa_node,
            rdma_device=self.attribute_string(entry, "rdmaDevice", where, required=False),
            link_speed_mbps=speed,
            mac_address=mac.lower() if mac else None,
            local_cpus=cpus_by_node.get(numa_node, ()) if numa_node is not None else (),
        )

    # -- cross-device checks ----------------------------------------------------------------

    def check_unique(self, gpus: list[GPU], nics: list[NIC]) -> None:
        seen_bus: dict[str, str] = {}
        groups: tuple[tuple[str, Sequence[GPU | NIC]], ...] = (("gpus", gpus), ("nics", nics))
        for kind, devices in groups:
            for index, device in enumerate(devices):
                where = f"{kind}[{index}] ({device.pci_bus_id})"
                if device.pci_bus_id in seen_bus:
                    raise self.fail(
                        f"duplicate PCI bus id, also used by {seen_bus[device.pci_bus_id]}",
                        device=where,
                        field="pciBusId",
                    )
                seen_bus[device.pci_bus_id] = f"{kind}[{index}]"
        seen_uuid: dict[str, int] = {}
        for index, gpu in enumerate(gpus):
            if gpu.uuid in seen_uuid:
                raise self.fail(
                    f"duplicate UUID, also used by gpus[{seen_uuid[gpu.uuid]}]",
                    device=f"gpus[{index}] ({gpu.pci_bus_id})",
                    field="uuid",
                )
            seen_uuid[gpu.uuid] = index
        seen_if: dict[str, int] = {}
        for index, nic in enumerate(nics):
            if nic.if_name in seen_if:
                raise self.fail(
                    f"duplicate interface name, also used by nics[{seen_if[nic.if_name]}]",
                    device=f"nics[{index}] ({nic.pci_bus_id})",
                    field="ifName",
                )
            seen_if[nic.if_name] = index

    @staticmethod
    def link_nvlink_peers(gpus: list[GPU]) -> list[GPU]:
        """GPUs that declare the same ``nvlinkDomain`` reach each other over NVLink/NVSwitch."""
        by_domain: dict[str, list[str]] = {}
        for gpu in gpus:
            if gpu.nvlink_domain:
                by_domain.setdefault(gpu.nvlink_domain, []).append(gpu.pci_bus_id)
        return [
            replace(
                gpu,
                nvlink_peers=tuple(
                    sorted(bus for bus in by_domain.get(gpu.nvlink_domain or "", []) if bus != gpu.pci_bus_id)
                ),
            )
            for gpu in gpus
        ]

    # -- fields -----------------------------------------------------------------------------

    @staticmethod
    def device_label(kind: str, index: int, entry: object) -> str:
        bus = entry.get("pciBusId") if isinstance(entry, dict) else None
        return f"{kind}[{index}] ({bus})" if isinstance(bus, str) else f"{kind}[{index}]"

    def device_mapping(self, entry: object, where: str, known: set[str]) -> dict[str, Any]:
        if not isinstance(entry, dict):
            raise self.fail(f"expected a mapping, found {_type_name(entry)}", device=where)
        unknown = sorted(str(key) for key in set(entry) - known)
        if unknown:
            raise self.fail(
                f"unknown field (known: {', '.join(sorted(known))})", device=where, field=unknown[0]
            )
        return entry

    def field(
        self,
        entry: Mapping[str, Any],
        key: str,
        kind: type[T],
        *,
        device: str | None,
        default: Any = _MISSING,
    ) -> T:
        value = entry.get(key, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise self.fail("missing", device=device, field=key)
            return default  # type: ignore[no-any-return]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            hint = " (quote it)" if kind is str and isinstance(value, int | float) else ""
            raise self.fail(
                f"expected {_KIND_NAMES.get(kind, kind.__name__)}{hint}, found {_type_name(value)} {value!r}",
                device=device,
                field=key,
            )
        return value

    def attribute_string(
        self, entry: Mapping[str, Any], key: str, where: str, *, required: bool = True
    ) -> str | None:
        value = self.field(entry, key, str, device=where, default=_MISSING if required else None)
        if value is not None and not 0 < len(value) <= MAX_ATTRIBUTE_STRING:
            raise self.fail(
                f"must be 1..{MAX_ATTRIBUTE_STRING} characters, found {len(value)}", device=where, field=key
            )
        return value

    def version(self, entry: Mapping[str, Any], key: str, *, device: str | None) -> str:
        return self._parsed(entry, key, device, normalize_version)

    def bus_id(self, entry: Mapping[str, Any], where: str) -> str:
        return self._parsed(entry, "pciBusId", where, normalize_pci_bus_id)

    def _parsed(
        self, entry: Mapping[str, Any], key: str, device: str | None, parse: Callable[[str], str]
    ) -> str:
        raw = self.field(entry, key, str, device=device)
        try:
            return parse(raw)
        except ValueError as error:
            raise self.fail(str(error), device=device, field=key) from None

    def pcie_root(self, entry: Mapping[str, Any], where: str) -> str | None:
        value = self.field(entry, "pcieRoot", str, device=where, default=None)
        if value is not None and not _PCIE_ROOT.fullmatch(value):
            raise self.fail(f"{value!r} is not a PCIe root (pciDDDD:BB)", device=where, field="pcieRoot")
        return value

    def numa_node(
        self, entry: Mapping[str, Any], where: str, cpus_by_node: Mapping[int, tuple[int, ...]]
    ) -> int | None:
        value = self.field(entry, "numaNode", int, device=where, default=None)
        if value is not None and value not in cpus_by_node:
            declared = ", ".join(str(node) for node in sorted(cpus_by_node)) or "none"
            raise self.fail(
                f"NUMA node {value} is not declared in numaNodes (declared: {declared})",
                device=where,
                field="numaNode",
            )
        return value


_KIND_NAMES = {str: "a string", int: "an integer", bool: "a boolean (true/false)"}


def _type_name(value: object) -> str:
    return {dict: "a mapping", list: "a list", type(None): "nothing"}.get(type(value), type(value).__name__)
