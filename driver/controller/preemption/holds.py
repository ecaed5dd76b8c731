"""The holds a leader keeps in memory, as text a successor can take over.

A nomination (the place a preemption or a consolidation freed for a waiting gang), a reservation
(the place a consolidation kept for a moved pod's replacement) and the time each owner's pods were
last moved (the consolidation cooldown) live in the leader's memory. The leader writes them, with
every renewal, into an annotation of its own Lease (``HOLDS_ANNOTATION``): only the holder of the
Lease can write it, and a successor reads it as it takes the Lease over. So a failover or a rolling
update no longer forgets them (docs/consolidation.md).

The text is JSON. Claims are kept by name and UID only (a hold needs no more of them to count its
allocation), deadlines as wall-clock times (each process turns them into its own monotonic clock).
A text over ``MAX_HOLDS_BYTES`` is not written: a successor then starts without the holds, as
before, and the leader says so in its log.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from driver.controller.model.objects import GangKey, Resources, is_gated
from driver.controller.preemption.preemptor import Nomination, Preemptor, Reservation
from driver.controller.view.cache import Kind

__all__ = [
    "HOLDS_ANNOTATION",
    "MAX_HOLDS_BYTES",
    "Holds",
    "HoldsError",
    "decode_holds",
    "encode_holds",
    "restore_holds",
    "take_holds",
]

HOLDS_ANNOTATION = "fractional.dev/holds"
MAX_HOLDS_BYTES = 64 * 1024  # written with every renewal: small, and far under the 256 KiB of annotations
FORMAT = 1


class HoldsError(ValueError):
    """The annotation's text is not holds this version can read; the message names the field."""


@dataclass
class Holds:
    nominations: dict[GangKey, Nomination] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    moved_at: dict[str, float] = field(default_factory=dict)  # owner UID -> wall time of its last move

    def __bool__(self) -> bool:
        return bool(self.nominations or self.reservations or self.moved_at)


# -- writing ----------------------------------------------------------------------------------------


def _slim(claim: Mapping[str, Any]) -> dict[str, Any]:
    meta = claim.get("metadata") or {}
    return {"metadata": {k: meta[k] for k in ("namespace", "name", "uid") if meta.get(k)}}


def _pairs(pairs: tuple[tuple[dict[str, Any], dict[str, Any]], ...]) -> list[list[Any]]:
    return [[_slim(claim), allocation] for claim, allocation in pairs]


def _room(room: Resources) -> list[int]:
    return [room.cpu_millis, room.memory_bytes, room.pods]


def _nomination(gang: str, nomination: Nomination, at: Callable[[float], float]) -> dict[str, Any]:
    return {
        "gang": gang,
        "priority": nomination.priority,
        "podNodes": nomination.pod_nodes,
        "allocations": _pairs(nomination.allocations),
        "victimPods": sorted(nomination.victim_pods),
        "victimClaims": [_slim(c) for c in nomination.victim_claims],
        "deadline": at(nomination.deadline),
        "source": nomination.source,
        "created": nomination.created,
        "room": [[pod, node, _room(r)] for pod, node, r in nomination.room],
    }


def _reservation(rid: str, reservation: Reservation, at: Callable[[float], float]) -> dict[str, Any]:
    return {
        "id": rid,
        "owner": reservation.owner_uid,
        "node": reservation.node,
        "allocations": _pairs(reservation.allocations),
        "deadline": at(reservation.deadline),
        "gang": reservation.gang,
        "token": reservation.token,
        "room": _room(reservation.room),
    }


def encode_holds(holds: Holds, *, wall: float, monotonic: float) -> str:
    """The holds as text ("" when there are none); deadlines turned from ``monotonic`` to ``wall``."""
    if not holds:
        return ""

    def at(deadline: float) -> float:
        return round(wall + (deadline - monotonic), 3)

    doc = {
        "format": FORMAT,
        "nominations": [_nomination(gang, n, at) for gang, n in sorted(holds.nominations.items())],
        "reservations": [_reservation(rid, r, at) for rid, r in sorted(holds.reservations.items())],
        "movedAt": dict(sorted(holds.moved_at.items())),
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


# -- reading ----------------------------------------------------------------------------------------


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise HoldsError(f"{where}.{key}: missing")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise HoldsError(f"{where}.{key}: not a {getattr(kind, '__name__', kind)}")
    return value


def _number(obj: Any, key: str, where: str) -> float:
    value = float(_get(obj, key, (int, float), where))
    if not math.isfinite(value):
        raise HoldsError(f"{where}.{key}: not a finite number")
    return value


def _read_room(value: Any, where: str) -> Resources:
    if not (isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value)):
        raise HoldsError(f"{where}: not [cpu millicores, memory bytes, pods]")
    return Resources(value[0], value[1], value[2])


def _read_claim(value: Any, where: str) -> dict[str, Any]:
    meta = _get(value, "metadata", dict, where)
    for key in ("namespace", "name"):
        _get(meta, key, str, f"{where}.metadata")
    return {"metadata": dict(meta)}


def _read_pairs(value: Any, where: str) -> tuple[tuple[dict[str, Any], dict[str, Any]], ...]:
    if not isinstance(value, list):
        raise HoldsError(f"{where}: not a list")
    pairs = []
    for index, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], dict)):
            raise HoldsError(f"{where}[{index}]: not [claim, allocation]")
        pairs.append((_read_claim(pair[0], f"{where}[{index}][0]"), pair[1]))
    return tuple(pairs)


def _read_nomination(item: Any, where: str, deadline: float) -> Nomination:
    pod_nodes = _get(item, "podNodes", dict, where)
    if not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in pod_nodes.items()):
        raise HoldsError(f"{where}.podNodes: not pod name -> node")
    room = []
    for j, entry in enumerate(_get(item, "room", list, where)):
        named = isinstance(entry, list) and len(entry) == 3 and all(isinstance(e, str) for e in entry[:2])
        if not named:
            raise HoldsError(f"{where}.room[{j}]: not [pod, node, requests]")
        room.append((entry[0], entry[1], _read_room(entry[2], f"{where}.room[{j}][2]")))
    return Nomination(
        priority=int(_get(item, "priority", int, where)),
        pod_nodes=dict(pod_nodes),
        allocations=_read_pairs(_get(item, "allocations", list, where), f"{where}.allocations"),
        victim_pods=frozenset(str(p) for p in _get(item, "victimPods", list, where)),
        victim_claims=tuple(
            _read_claim(c, f"{where}.victimClaims[{j}]")
            for j, c in enumerate(_get(item, "victimClaims", list, where))
        ),
        deadline=deadline,
        source=str(_get(item, "source", str, where)),
        created=str(_get(item, "created", str, where)),
        room=tuple(room),
    )


def _read_reservation(item: Any, where: str, deadline: float) -> Reservation:
    return Reservation(
        owner_uid=_get(item, "owner", str, where),
        node=_get(item, "node", str, where),
        allocations=_read_pairs(_get(item, "allocations", list, where), f"{where}.allocations"),
        deadline=deadline,
        gang=GangKey(_get(item, "gang", str, where)),
        token=_get(item, "token", str, where),
        room=_read_room(_get(item, "room", list, where), f"{where}.room"),
    )


def decode_holds(text: str, *, wall: float, monotonic: float) -> Holds:
    """The holds in ``text`` whose deadlines have not passed by ``wall``, with deadlines on the
    ``monotonic`` clock. Raises ``HoldsError`` naming the first field it cannot read (out-of-date
    entries are read too: a bad one is refused all the same)."""
    holds = Holds()
    if not text:
        return holds
    try:
        doc = json.loads(text)
    except ValueError as error:
        raise HoldsError(f"not JSON: {error}") from error
    if _get(doc, "format", int, "holds") != FORMAT:
        raise HoldsError(f"holds.format: {doc['format']}, this version reads {FORMAT}")
    for index, item in enumerate(_get(doc, "nominations", list, "holds")):
        where = f"holds.nominations[{index}]"
        left = _number(item, "deadline", where) - wall
        nomination = _read_nomination(item, where, monotonic + left)
        if left > 0:
            holds.nominations[GangKey(_get(item, "gang", str, where))] = nomination
    for index, item in enumerate(_get(doc, "reservations", list, "holds")):
        where = f"holds.reservations[{index}]"
        left = _number(item, "deadline", where) - wall
        reservation = _read_reservation(item, where, monotonic + left)
        if left > 0:
            holds.reservations[_get(item, "id", str, where)] = reservation
    for owner, moved in _get(doc, "movedAt", dict, "holds").items():
        if isinstance(moved, bool) or not isinstance(moved, (int, float)) or not math.isfinite(moved):
            raise HoldsError(f"holds.movedAt.{owner}: not a time")
        holds.moved_at[str(owner)] = float(moved)
    return holds


# -- the leader's side ------------------------------------------------------------------------------


def take_holds(
    preemptor: Preemptor, moved_at: Mapping[str, float], *, cooldown_seconds: float, wall: float
) -> Holds:
    """The holds in force now (reservations past their deadline dropped; moves older than the
    cooldown forgotten, they hold nothing back). Under ``cache.lock``."""
    preemptor.expire_reservations()
    return Holds(
        nominations=dict(preemptor.nominations),
        reservations=dict(preemptor.reservations),
        # dict() copies at once: the consolidator records a move from its writer thread, unlocked.
        moved_at={owner: at for owner, at in dict(moved_at).items() if wall - at < cooldown_seconds},
    )


def restore_holds(preemptor: Preemptor, moved_at: dict[str, float], holds: Holds) -> tuple[int, int]:
    """Take over a predecessor's holds: a nomination whose gang still has a pod waiting, every
    reservation, every move's time; what this process holds already wins. Returns the nominations
    and reservations taken. Under ``cache.lock``."""
    nominations = 0
    for gang, nomination in holds.nominations.items():
        waiting = any(
            (pod := preemptor.cache.get(Kind.POD, key)) is not None and is_gated(pod)
            for key in nomination.pod_nodes
        )
        if waiting and gang not in preemptor.nominations:
            preemptor.nominations[gang] = nomination
            nominations += 1
    reservations = 0
    for rid, reservation in holds.reservations.items():
        if rid not in preemptor.reservations:
            preemptor.reservations[rid] = reservation
            reservations += 1
    for owner, at in holds.moved_at.items():
        moved_at[owner] = max(at, moved_at.get(owner, at))
    return nominations, reservations
