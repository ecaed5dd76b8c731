"""Protobuf request bodies for the embedded API emulator (a test double): what kube-apiserver
accepts as ``Content-Type: application/vnd.kubernetes.protobuf`` (kubectl sends it for ``create
namespace``, ``create configmap``, ``create deployment``, ``auth can-i``, ``auth whoami`` and the
evictions of ``drain``).

The envelope is the magic ``k8s\\0`` followed by a ``runtime.Unknown`` whose ``typeMeta`` names
the kind and whose ``raw`` holds the object, both decoded with the stubs generated from
Kubernetes' own ``.proto`` definitions (``hack/gen_k8s_proto.py``, which reads them from the
published ``k8s.io/api`` and ``k8s.io/apimachinery`` modules). The decoded
message becomes the object's JSON form, as the API machinery's converters write it: empty strings
and zero times left out (Go writes every field in protobuf, ``omitempty`` drops them in JSON),
inlined structs flattened, ``Time`` as RFC 3339 with ``Z``, ``Quantity`` and ``IntOrString`` as
their string or number, ``RawExtension`` and ``FieldsV1`` as the JSON they carry, int64 as
numbers, bytes as base64. Answers stay JSON (the clients accept it alongside protobuf).
"""

from __future__ import annotations

import base64
import datetime
import importlib
import json
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from driver.cluster.apiserver.store import StatusError

__all__ = ["PROTOBUF", "decode_protobuf"]

PROTOBUF = "application/vnd.kubernetes.protobuf"
_MAGIC = b"k8s\x00"
# apiVersion -> stub module (generated from that group's generated.proto)
_MODULES = {
    "v1": "k8s_io_api_core_v1_pb2",
    "apps/v1": "k8s_io_api_apps_v1_pb2",
    "authorization.k8s.io/v1": "k8s_io_api_authorization_v1_pb2",
    "authentication.k8s.io/v1": "k8s_io_api_authentication_v1_pb2",
    "policy/v1": "k8s_io_api_policy_v1_pb2",
}
_META_KINDS = frozenset({"DeleteOptions"})  # meta/v1 kinds sent under any group version
_META = "k8s.io.apimachinery.pkg.apis.meta.v1"
# Go structs embedded with `json:",inline"`: a field in protobuf, flattened into its parent in JSON
_INLINE = frozenset({
    "k8s.io.api.core.v1.Probe.handler", "k8s.io.api.core.v1.Volume.volumeSource",
    "k8s.io.api.core.v1.EphemeralContainer.ephemeralContainerCommon",
    "k8s.io.api.core.v1.PersistentVolumeSpec.persistentVolumeSource",
})  # fmt: skip
_INT64 = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                    FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64})  # fmt: skip


def _stub(name: str) -> Any:
    return importlib.import_module(f"driver.cluster.apiserver.proto_gen.{name}")


def _bad(message: str) -> StatusError:
    return StatusError(code=400, reason="BadRequest", message=message)


def _time(message: Message, *, micro: bool) -> str | None:
    seconds = getattr(message, "seconds", 0)
    nanos = getattr(message, "nanos", 0)
    if seconds == 0 and nanos == 0:
        return None  # Go's zero time: null in JSON, left out here
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    if micro:
        return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos // 1000:06d}Z"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_json(value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    if field.type in _INT64:
        return int(value)
    return value


def to_json(message: Message) -> Any:
    """A decoded Kubernetes message as the JSON the API machinery writes for it."""
    name = message.DESCRIPTOR.full_name
    if name == f"{_META}.Time":
        return _time(message, micro=False)
    if name == f"{_META}.MicroTime":
        return _time(message, micro=True)
    if name == "k8s.io.apimachinery.pkg.api.resource.Quantity":
        return getattr(message, "string", "")
    if name == "k8s.io.apimachinery.pkg.util.intstr.IntOrString":
        if getattr(message, "type", 0) == 0:
            return getattr(message, "intVal", 0)
        return getattr(message, "strVal", "")
    if name in ("k8s.io.apimachinery.pkg.runtime.RawExtension", f"{_META}.FieldsV1"):
        raw = getattr(message, "raw", None) or getattr(message, "Raw", b"")
        return json.loads(raw) if raw else {}
    obj: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_STRING and not field.is_repeated and value == "":
            continue  # Go writes every non-pointer string; JSON's omitempty leaves empty ones out
        if field.full_name in _INLINE:
            obj.update(to_json(value))
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            obj[field.name] = {key: _value(value_field, item) for key, item in value.items()}
        elif field.is_repeated:
            obj[field.name] = [_value(field, item) for item in value]
        elif (converted := _value(field, value)) is not None:
            obj[field.name] = converted
    return obj


def decode_protobuf(raw: bytes) -> dict[str, Any]:
    """The JSON object a protobuf request body carries; 400 for what the server cannot decode."""
    if not raw.startswith(_MAGIC):
        raise _bad("the body is not a Kubernetes protobuf object (missing the k8s\\0 prefix)")
    runtime = _stub("k8s_io_apimachinery_pkg_runtime_pb2")
    unknown = runtime.Unknown()
    try:
        unknown.ParseFromString(raw[len(_MAGIC) :])
    except DecodeError as error:
        raise _bad(f"unable to decode the protobuf envelope: {error}") from None
    api_version, kind = unknown.typeMeta.apiVersion, unknown.typeMeta.kind
    if kind in _META_KINDS:
        module = _stub("k8s_io_apimachinery_pkg_apis_meta_v1_pb2")
    elif api_version in _MODULES:
        module = _stub(_MODULES[api_version])
    else:
        raise _bad(f"no kind {kind!r} is registered for version {api_version!r} in protobuf")
    message_type = getattr(module, kind, None)
    if message_type is None:
        raise _bad(f"no kind {kind!r} is registered for version {api_version!r} in protobuf")
    message = message_type()
    try:
        message.ParseFromString(unknown.raw)
    except DecodeError as error:
        raise _bad(f"unable to decode {kind}: {error}") from None
    obj = to_json(message)
    return {"apiVersion": api_version, "kind": kind, **obj}
