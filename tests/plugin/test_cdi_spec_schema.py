"""Our CDI spec schema (cdi_spec_schema.py) accepts what the CDI specification admits and refuses
what it does not: a validator that can fail."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from driver.plugin import cdi
from driver.plugin.sharing.base import ContainerEdits, DeviceNode, Mount
from tests.plugin.cdi_spec_schema import CDI_VERSIONS, cdi_spec_schema, cdi_spec_validator

VALIDATOR = cdi_spec_validator()


def minimal() -> dict[str, Any]:
    return {
        "cdiVersion": "0.3.0",
        "kind": "k8s.fractional.dev/gpu",
        "devices": [{"name": "gpu-0", "containerEdits": {"env": ["A=1"]}}],
    }


def full() -> dict[str, Any]:
    """Every member the specification defines, each once."""
    edits = {
        "env": ["FRACTIONAL=1", "EMPTY="],
        "deviceNodes": [
            {
                "path": "/dev/nvidia0",
                "hostPath": "/dev/nvidia0",
                "type": "c",
                "major": 195,
                "minor": 0,
                "fileMode": 0o666,
                "permissions": "rwm",
                "uid": 0,
                "gid": 44,
            }
        ],
        "mounts": [
            {
                "hostPath": "/run/mps",
                "containerPath": "/run/mps",
                "type": "bind",
                "options": ["rbind", "ro"],
            }
        ],
        "hooks": [
            {
                "hookName": "createContainer",
                "path": "/usr/bin/hook",
                "args": ["hook", "--flag"],
                "env": ["HOOK=1"],
                "timeout": 5,
            }
        ],
        "additionalGids": [0, 44],
        "intelRdt": {
            "closID": "clos-1",
            "l3CacheSchema": "L3:0=ff",
            "memBwSchema": "MB:0=50",
            "schemata": ["L3:0=ff"],
            "enableMonitoring": True,
        },
        "netDevices": [{"hostInterfaceName": "ib0", "name": "net1"}],
    }
    return {
        "cdiVersion": "1.1.0",
        "kind": "foo.bar.baz/foo-bar123.B_az",
        "annotations": {"fractional.dev/claim": "abc", "plain": ""},
        "devices": [
            {
                "name": "0a_b.c-d",
                "annotations": {"k8s.fractional.dev/device": "gpu-0"},
                "containerEdits": copy.deepcopy(edits),
            }
        ],
        "containerEdits": edits,
    }


def test_the_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(cdi_spec_schema())


def test_accepts_a_minimal_spec() -> None:
    VALIDATOR.validate(minimal())


def test_accepts_a_spec_with_every_member() -> None:
    VALIDATOR.validate(full())


def test_accepts_what_our_driver_renders() -> None:
    edits = ContainerEdits(
        env=("FRACTIONAL_CLAIM_UID=x",),
        mounts=(Mount(host_path="/run/mps", container_path="/run/mps", type="bind", options=("rbind",)),),
        device_nodes=(DeviceNode(path="/dev/x", host_path="/dev/y", permissions="rw"),),
    )
    VALIDATOR.validate(cdi.render_claim_spec("gpu", [("9b1f-gpu-0", edits)]))


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        *parents, last = path
        target: Any = spec
        for key in parents:
            target = target[key]
        target[last] = value

    return change


def _drop(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        *parents, last = path
        target: Any = spec
        for key in parents:
            target = target[key]
        del target[last]

    return change


EDITS = ("devices", 0, "containerEdits")

REFUSED: dict[str, Callable[[dict[str, Any]], None]] = {
    "missing cdiVersion": _drop(("cdiVersion",)),
    "cdiVersion not a semantic version": _set(("cdiVersion",), "1.1"),
    "cdiVersion unknown to spec 1.1.0": _set(("cdiVersion",), "9.0.0"),
    "missing kind": _drop(("kind",)),
    "kind without a slash": _set(("kind",), "vendor.com"),
    "kind with two slashes": _set(("kind",), "vendor.com/foo/bar"),
    "kind ending in a slash": _set(("kind",), "vendor.com/foo/"),
    "vendor with an underscore": _set(("kind",), "ven_dor.com/foo"),
    "vendor starting with a digit": _set(("kind",), "1vendor.com/foo"),
    "vendor with an empty label": _set(("kind",), "vendor..com/foo"),
    "vendor label ending in a dash": _set(("kind",), "vendor-.com/foo"),
    "vendor longer than 253": _set(("kind",), ".".join(["a" * 63] * 4) + "/foo"),
    "class with a colon": _set(("kind",), "vendor.com/fo:o"),
    "class ending in a dot": _set(("kind",), "vendor.com/foo."),
    "class longer than 63": _set(("kind",), "vendor.com/" + "c" * 64),
    "empty class": _set(("kind",), "vendor.com/"),
    "device name with a slash": _set(("devices", 0, "name"), "gpu/0"),
    "device name with a space": _set(("devices", 0, "name"), "gpu 0"),
    "device name ending in a dash": _set(("devices", 0, "name"), "gpu-"),
    "device name with a trailing newline": _set(("devices", 0, "name"), "gpu0\n"),
    "missing devices": _drop(("devices",)),
    "empty devices": _set(("devices",), []),
    "device without a name": _drop(("devices", 0, "name")),
    "device without containerEdits": _drop(EDITS),
    "device whose edits change nothing": _set(EDITS, {"env": []}),
    "env entry without =": _set((*EDITS, "env"), ["NOVALUE"]),
    "env entry with an empty name": _set((*EDITS, "env"), ["=1"]),
    "deviceNode without path": _set((*EDITS, "deviceNodes"), [{"hostPath": "/dev/x"}]),
    "deviceNode with an unknown type": _set((*EDITS, "deviceNodes"), [{"path": "/dev/x", "type": "x"}]),
    "deviceNode with bad permissions": _set(
        (*EDITS, "deviceNodes"), [{"path": "/dev/x", "permissions": "rx"}]
    ),
    "deviceNode with a negative uid": _set((*EDITS, "deviceNodes"), [{"path": "/dev/x", "uid": -1}]),
    "deviceNode with an unknown member": _set((*EDITS, "deviceNodes"), [{"path": "/dev/x", "mode": 1}]),
    "mount without containerPath": _set((*EDITS, "mounts"), [{"hostPath": "/a"}]),
    "mount without hostPath": _set((*EDITS, "mounts"), [{"containerPath": "/a"}]),
    "mount options as a string": _set(
        (*EDITS, "mounts"), [{"hostPath": "/a", "containerPath": "/a", "options": "ro"}]
    ),
    "unknown hook name": _set((*EDITS, "hooks"), [{"hookName": "preStart", "path": "/bin/h"}]),
    "hook without path": _set((*EDITS, "hooks"), [{"hookName": "poststop"}]),
    "hook with a relative path": _set((*EDITS, "hooks"), [{"hookName": "poststop", "path": "bin/h"}]),
    "hook with a zero timeout": _set(
        (*EDITS, "hooks"), [{"hookName": "poststop", "path": "/h", "timeout": 0}]
    ),
    "netDevice without name": _set((*EDITS, "netDevices"), [{"hostInterfaceName": "ib0"}]),
    "intelRdt closID with a slash": _set((*EDITS, "intelRdt"), {"closID": "a/b"}),
    "additionalGids beyond uint32": _set((*EDITS, "additionalGids"), [2**32]),
    "unknown containerEdits member": _set((*EDITS, "devices"), []),
    "unknown device member": _set(("devices", 0, "id"), 1),
    "annotation value not a string": _set(("annotations",), {"a": 1}),
    "annotation key with a space": _set(("annotations",), {"a b": "c"}),
    "unknown top-level member": _set(("version",), "1.1.0"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refuses(case: str) -> None:
    spec = full()
    REFUSED[case](spec)
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(spec)


def test_refuses_the_minimal_spec_broken() -> None:
    """The same failures on the smallest spec, where no other member could be the cause."""
    for change in (_drop(("cdiVersion",)), _set(("kind",), "foo"), _set(("devices",), []), _drop(EDITS)):
        spec = minimal()
        change(spec)
        with pytest.raises(jsonschema.ValidationError):
            VALIDATOR.validate(spec)


# A member used in a file that names a version older than the member (the specification's table).
TOO_NEW: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("0.4.0", _set((*EDITS, "mounts"), [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}])),
    ("0.5.0", _set((*EDITS, "deviceNodes"), [{"path": "/dev/x", "hostPath": "/dev/y"}])),
    ("0.5.0", _set(("devices", 0, "name"), "0gpu")),
    ("0.6.0", _set(("annotations",), {"a": "b"})),
    ("0.6.0", _set(("devices", 0, "annotations"), {"a": "b"})),
    ("0.6.0", _set(("kind",), "vendor.com/gpu.v2")),
    ("0.7.0", _set(("containerEdits",), {"intelRdt": {}})),
    ("0.7.0", _set((*EDITS, "additionalGids"), [44])),
    ("1.1.0", _set((*EDITS, "netDevices"), [{"hostInterfaceName": "ib0", "name": "net1"}])),
    ("1.1.0", _set((*EDITS, "intelRdt"), {"schemata": []})),
    ("1.1.0", _set(("containerEdits",), {"intelRdt": {"enableMonitoring": True}})),
]


@pytest.mark.parametrize(("version", "change"), TOO_NEW)
def test_a_member_needs_the_version_that_added_it(
    version: str, change: Callable[[dict[str, Any]], None]
) -> None:
    spec = minimal()
    change(spec)
    earlier = CDI_VERSIONS[CDI_VERSIONS.index(version) - 1]
    spec["cdiVersion"] = version
    VALIDATOR.validate(spec)
    spec["cdiVersion"] = earlier
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(spec)


# The members the driver's ``minimum_cdi_version`` knows (it writes no others).
DRIVER_KNOWS = [(v, change) for v, change in TOO_NEW if CDI_VERSIONS.index(v) <= CDI_VERSIONS.index("0.6.0")]


@pytest.mark.parametrize(("version", "change"), DRIVER_KNOWS)
def test_the_driver_writes_the_version_the_schema_wants(
    version: str, change: Callable[[dict[str, Any]], None]
) -> None:
    spec = minimal()
    change(spec)
    assert cdi.minimum_cdi_version(spec) == version
