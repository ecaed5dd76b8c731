"""Our JSON Schema (draft 2020-12) for a CDI spec file, as the node agent writes them.

This project wrote it, from the text of the Container Device Interface specification: ``SPEC.md``
of version 1.1.0 of the Go module ``tags.cncf.io/container-device-interface``, the version that
containerd v2.3.7 (which our real cluster builds) requires. Where that module's own checks (its
parser and validation code) refuse more than the text says, the schema refuses it too; where the
text is the stricter, the text's rule stands. Comments name each rule taken from that code.

It is a fast, offline check for the unit tests, not the last word: on the real cluster (``make
e2e``) containerd's CDI parser reads every spec the agent writes, and a spec it refuses fails the
pod's start there.

What it cannot say and so leaves to that consumer: device names unique within a file, net devices
unique by host and container name, the 256 kB limit on the annotations' total size.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from jsonschema.protocols import Validator

__all__ = ["CDI_VERSIONS", "cdi_spec_schema", "cdi_spec_validator"]

# The spec versions that version 1.1.0 of the specification lists as released, oldest first. A file
# names one of them; the consumer refuses a version it does not know.
CDI_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")

UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# ``$`` in Python's ``re`` also matches before a final newline; the lookahead after it makes every
# pattern below end at the very end of the string (and means nothing more to an ECMA-262 engine).
_END = r"$(?!\n)"


def _whole(regex: str) -> str:
    return rf"^(?:{regex}){_END}"


# Semantic Versioning 2.0: MAJOR.MINOR.PATCH without leading zeros, then an optional pre-release
# ("-" and dot-separated identifiers) and optional build metadata ("+" and identifiers).
_NUMBER = r"(?:0|[1-9][0-9]*)"
_IDENTIFIERS = r"[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*"
SEMVER = _whole(rf"{_NUMBER}\.{_NUMBER}\.{_NUMBER}(?:-{_IDENTIFIERS})?(?:\+{_IDENTIFIERS})?")

# kind = "<vendor>/<class>", one slash.
# Vendor: a DNS subdomain (labels of letters, digits and inner dashes, up to 63 characters each,
# joined by dots), 253 characters at most. The consumer also wants its first character a letter,
# and fails on a one-character vendor, so it has at least two.
_DNS_LABEL = r"[A-Za-z0-9](?:[-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
_VENDOR = rf"(?=[^/]{{2,253}}/)[A-Za-z](?:[-A-Za-z0-9]{{0,61}}[A-Za-z0-9])?(?:\.{_DNS_LABEL})*"
# Class (the spec's "name segment"): 63 characters at most, alphanumeric at both ends, dashes,
# underscores, dots and alphanumerics between. The consumer wants a letter first and two
# characters at least, as for the vendor.
_CLASS = r"(?=[^/]{2,63}$)[A-Za-z][-_.A-Za-z0-9]*[A-Za-z0-9]"
KIND = _whole(rf"{_VENDOR}/{_CLASS}")

# Device name: alphanumeric at both ends, dashes, underscores, dots and alphanumerics between; a
# single alphanumeric is a name too. (The consumer would also take ":" between; the text does not.)
DEVICE_NAME = _whole(r"[A-Za-z0-9](?:[-_.A-Za-z0-9]*[A-Za-z0-9])?")

# "NAME=VALUE": a non-empty name before the first "=", any value (empty too) after it.
ENV_ENTRY = r"^[^=]+="

# Annotation keys, as the consumer checks them (Kubernetes qualified names, compared lowercased):
# an optional DNS-subdomain prefix and a slash, then a name of up to 63 characters, alphanumeric at
# both ends, with dashes, underscores, dots and alphanumerics between.
_ANNOTATION_PREFIX = rf"(?=[^/]{{1,253}}/){_DNS_LABEL}(?:\.{_DNS_LABEL})*/"
ANNOTATION_KEY = _whole(
    rf"(?:{_ANNOTATION_PREFIX})?(?=[^/]{{1,63}}$)[A-Za-z0-9](?:[-_.A-Za-z0-9]*[A-Za-z0-9])?"
)

# The hook names the text lists (the OCI runtime's hook points). The consumer also still takes the
# deprecated "prestart"; the text does not list it, and neither do we.
HOOK_NAMES = ("createRuntime", "createContainer", "startContainer", "poststart", "poststop")

# Device node types, as the consumer knows them: block, character, unbuffered character, FIFO.
DEVICE_NODE_TYPES = ("b", "c", "u", "p")

# intelRdt.closID: "/" (the root class of service) or a name that could be a Linux file name.
CLOS_ID = _whole(r"/|(?!\.\.?$)[^/\n]{0,4095}")


def _string(**rules: Any) -> dict[str, Any]:
    return {"type": "string", **rules}


def _strings(**item_rules: Any) -> dict[str, Any]:
    return {"type": "array", "items": _string(**item_rules)}


def _integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _closed(required: tuple[str, ...], **members: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly these members (the spec defines them all), ``required`` among them."""
    return {
        "type": "object",
        "properties": members,
        "required": list(required),
        "additionalProperties": False,
    }


def _list_of(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item}


ANNOTATIONS = {
    "type": "object",
    "propertyNames": {"pattern": ANNOTATION_KEY},
    "additionalProperties": {"type": "string"},
}

DEVICE_NODE = _closed(
    ("path",),
    path=_string(minLength=1),
    hostPath=_string(),
    type=_string(enum=list(DEVICE_NODE_TYPES)),
    major=_integer(INT64_MIN, INT64_MAX),
    minor=_integer(INT64_MIN, INT64_MAX),
    fileMode=_integer(0, UINT32_MAX),
    permissions=_string(pattern=_whole("[rwm]+")),  # read, write, mknod: one or more
    uid=_integer(0, UINT32_MAX),
    gid=_integer(0, UINT32_MAX),
)

MOUNT = _closed(
    ("hostPath", "containerPath"),
    hostPath=_string(minLength=1),
    containerPath=_string(minLength=1),
    type=_string(),
    options=_strings(),
)

HOOK = _closed(
    ("hookName", "path"),
    hookName=_string(enum=list(HOOK_NAMES)),
    path=_string(pattern="^/"),  # the text: the path MUST be absolute
    args=_strings(),
    env=_strings(pattern=ENV_ENTRY),
    timeout={"type": "integer", "exclusiveMinimum": 0},  # seconds; if set, more than zero
)

INTEL_RDT = _closed(
    (),
    closID=_string(pattern=CLOS_ID),
    l3CacheSchema=_string(),
    memBwSchema=_string(),
    schemata=_strings(),
    enableMonitoring={"type": "boolean"},
)

NET_DEVICE = _closed(
    ("hostInterfaceName", "name"), hostInterfaceName=_string(minLength=1), name=_string(minLength=1)
)

CONTAINER_EDITS = _closed(
    (),
    env=_strings(pattern=ENV_ENTRY),
    deviceNodes=_list_of(DEVICE_NODE),
    mounts=_list_of(MOUNT),
    hooks=_list_of(HOOK),
    additionalGids=_list_of(_integer(0, UINT32_MAX)),  # 0 is allowed, and ignored
    intelRdt=INTEL_RDT,
    netDevices=_list_of(NET_DEVICE),
)

# The consumer refuses a device whose edits would change nothing: one list at least is non-empty,
# or intelRdt is there.
_EDITS_THAT_DO_SOMETHING = {
    "anyOf": [
        {"required": [member], "properties": {member: {"minItems": 1}}}
        for member in ("env", "deviceNodes", "mounts", "hooks", "additionalGids", "netDevices")
    ]
    + [{"required": ["intelRdt"]}]
}

DEVICE = _closed(
    ("name", "containerEdits"),
    name=_string(pattern=DEVICE_NAME),
    annotations=ANNOTATIONS,
    containerEdits={"allOf": [CONTAINER_EDITS, _EDITS_THAT_DO_SOMETHING]},
)


# Each member's first version (the specification's table of released versions). A file that uses a
# member must name that version or a later one: the consumer refuses it otherwise.


def _has(member: str, condition: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": [member], "properties": {member: condition}}


def _some(item_condition: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "contains": item_condition}


def _edits_anywhere(condition: dict[str, Any]) -> dict[str, Any]:
    """A spec whose own edits, or some device's, match ``condition``."""
    edits = {"type": "object", **condition}
    return {"anyOf": [_has("containerEdits", edits), _has("devices", _some(_has("containerEdits", edits)))]}


def _non_empty_list(member: str) -> dict[str, Any]:
    return _has(member, {"type": "array", "minItems": 1})


_NEW_IN: dict[str, list[dict[str, Any]]] = {
    "0.4.0": [_edits_anywhere(_has("mounts", _some(_has("type", _string(minLength=1)))))],
    "0.5.0": [
        _edits_anywhere(_has("deviceNodes", _some(_has("hostPath", _string(minLength=1))))),
        _has("devices", _some(_has("name", _string(pattern="^[0-9]")))),
    ],
    "0.6.0": [
        _has("annotations", {"type": "object", "minProperties": 1}),
        _has("devices", _some(_has("annotations", {"type": "object", "minProperties": 1}))),
        _has("kind", _string(pattern=r"^[^/]*/.*\.")),  # a dot in the class
    ],
    "0.7.0": [_edits_anywhere(_has("intelRdt", {})), _edits_anywhere(_non_empty_list("additionalGids"))],
    "1.1.0": [
        _edits_anywhere(_non_empty_list("netDevices")),
        _edits_anywhere(
            _has(
                "intelRdt", {"anyOf": [{"required": ["schemata"]}, _has("enableMonitoring", {"const": True})]}
            )
        ),
    ],
}


def _version_rules() -> list[dict[str, Any]]:
    rules = []
    for version, uses in _NEW_IN.items():
        later = list(CDI_VERSIONS[CDI_VERSIONS.index(version) :])
        rules.append({"if": {"anyOf": uses}, "then": {"properties": {"cdiVersion": {"enum": later}}}})
    return rules


def cdi_spec_schema() -> dict[str, Any]:
    """The schema of a whole CDI spec file (a fresh dict each call)."""
    spec = _closed(
        ("cdiVersion", "kind", "devices"),
        cdiVersion=_string(pattern=SEMVER, enum=list(CDI_VERSIONS)),
        kind=_string(pattern=KIND),
        annotations=ANNOTATIONS,
        devices={"type": "array", "minItems": 1, "items": DEVICE},
        containerEdits=CONTAINER_EDITS,
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "CDI spec file (CDI specification 1.1.0)",
        **spec,
        "allOf": _version_rules(),
    }


def cdi_spec_validator() -> Validator:
    """A ready validator: ``.validate(spec)`` raises ``jsonschema.ValidationError`` on a bad spec."""
    schema = cdi_spec_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)
