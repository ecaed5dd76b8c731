"""``fractional status``: the cluster's GPUs as the API sees them, in the terminal.

Per GPU: memory and guaranteed compute allocated, the number of shares (the demo's table,
``driver.gpu_usage``), then per GPU the pods holding a share of it. ``--watch`` redraws every
``--interval`` seconds until Ctrl-C. Read-only: lists ResourceSlices and ResourceClaims.

The GPUs and their free counts are always the whole cluster's (every namespace's claims hold
capacity); ``-n NAMESPACE`` narrows only the list of who holds what, and the header says so.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from driver import DRIVER_NAME
from driver.config import StatusConfig
from driver.controller.diagnosis.explain import format_bytes
from driver.controller.model.objects import quantity
from driver.gpu_usage import compute_gpu_usage, render_usage_table
from driver.kube import as_dict

__all__ = ["read_cluster", "render_status", "run_status"]

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def _share_lines(claims: Iterable[Mapping[str, Any]], gpus: Mapping[tuple[str, str], int]) -> list[str]:
    """Per GPU ((pool, device) -> its memory), who holds it: namespace/pods [claim] size."""
    holders: dict[tuple[str, str], list[str]] = defaultdict(list)
    for claim in claims:
        meta = claim.get("metadata") or {}
        status = claim.get("status") or {}
        allocation = status.get("allocation") or {}
        pods = [r["name"] for r in status.get("reservedFor") or () if r.get("resource") == "pods"]
        who = f"{meta.get('namespace')}/{','.join(pods) if pods else '(no pod yet)'}"
        for result in (allocation.get("devices") or {}).get("results") or ():
            if result.get("driver") != DRIVER_NAME:
                continue
            key = (str(result.get("pool")), str(result.get("device")))
            consumed = result.get("consumedCapacity")
            if consumed is None or int(quantity(consumed.get("memory", 0))) >= gpus.get(key, 0) > 0:
                size = "whole GPU"
            else:
                size = format_bytes(int(quantity(consumed.get("memory", 0))))
                size += f" {int(quantity(consumed.get('compute', 0)))}%"
            holders[key].append(f"{who} [{meta.get('name')}] {size}")
    lines = []
    for pool, device in gpus:
        for holder in sorted(holders.get((pool, device), ())):
            lines.append(f"  {pool}/{device}: {holder}")
    return lines


def render_status(
    slices: list[dict[str, Any]], claims: list[dict[str, Any]], *, namespace: str | None = None
) -> str:
    """The table, then who holds each GPU (pure). ``claims``: every namespace's (the counts are the
    cluster's); ``namespace``: list only its holders."""
    usage = compute_gpu_usage(slices, claims)
    if not usage:
        return f"no GPUs published by {DRIVER_NAME} (no ResourceSlices of the driver)"
    pools = {
        (s["spec"].get("nodeName", s["spec"]["pool"]["name"]), d["name"]): s["spec"]["pool"]["name"]
        for s in slices
        if s["spec"].get("driver") == DRIVER_NAME
        for d in s["spec"].get("devices") or ()
    }
    gpus = {(pools.get((u.node, u.device), u.node), u.device): u.memory_total_bytes for u in usage}
    shared = sum(u.shares for u in usage if not u.exclusive)
    whole = sum(1 for u in usage if u.exclusive)
    free = sum(1 for u in usage if not u.exclusive and not u.shares)
    scope = (
        "the whole cluster"
        if namespace is None
        else f"the whole cluster; claims of namespace {namespace} listed"
    )
    lines = [
        f"GPUs of {scope}",
        render_usage_table(usage),
        "",
        f"{len(usage)} GPUs: {free} free, {whole} taken whole, {shared} shares on the others (cluster-wide)",
    ]
    listed = [
        c for c in claims if namespace is None or (c.get("metadata") or {}).get("namespace") == namespace
    ]
    holders = _share_lines(listed, gpus)
    if holders:
        lines += ["", "who holds what (namespace/pods [claim] size):", *holders]
    elif namespace is not None:
        lines += ["", f"no claim of namespace {namespace} holds a GPU"]
    return "\n".join(lines)


def read_cluster(configuration: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """ResourceSlices and the ResourceClaims of every namespace, as API-shaped dicts."""
    from kubernetes import client

    from driver.kube import REQUEST_TIMEOUT_SECONDS, api_errors, new_api_client

    api_client = new_api_client(configuration)
    resource = client.ResourceV1Api(api_client)
    with api_errors("list ResourceSlices"):
        slices = resource.list_resource_slice(_request_timeout=REQUEST_TIMEOUT_SECONDS).items
    with api_errors("list ResourceClaims of every namespace (what holds the GPUs)"):
        claims = resource.list_resource_claim_for_all_namespaces(
            _request_timeout=REQUEST_TIMEOUT_SECONDS
        ).items
    return [as_dict(s) for s in slices], [as_dict(c) for c in claims]


def run_status(config: StatusConfig, stop: threading.Event, out: TextIO) -> int:
    from driver.kube.client import load_configuration

    configuration = load_configuration(config.kubeconfig)
    while True:
        slices, claims = read_cluster(configuration)
        text = render_status(slices, claims, namespace=config.namespace)
        out.write((CLEAR_SCREEN if config.watch else "") + text + "\n")
        out.flush()
        if not config.watch or stop.wait(config.interval_seconds):
            return 0
