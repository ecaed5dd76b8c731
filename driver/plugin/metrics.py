"""Prometheus metrics of the node agent (served on ``--metrics-port`` at ``/metrics``).

Defined once per process on the default registry; several in-process agents (tests, the demo)
share them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "CHECKPOINT_CORRUPT_TOTAL",
    "CLAIM_OPERATIONS_TOTAL",
    "CLAIM_STATUS_WRITES_TOTAL",
    "GPUS_CLAIMED_ELSEWHERE",
    "HEALTH_CHANGES_TOTAL",
    "HEALTH_STREAMS",
    "PREPARED_CLAIMS",
    "PREPARES_REDONE_TOTAL",
    "PREPARE_REFUSED_TOTAL",
    "REGISTERED",
    "REGISTRATION_NOTIFICATIONS_TOTAL",
    "RPC_SECONDS",
]

REGISTERED = Gauge(
    "fractional_plugin_registered",
    "1 when the kubelet's last NotifyRegistrationStatus said the plugin is registered, else 0",
)
REGISTRATION_NOTIFICATIONS_TOTAL = Counter(
    "fractional_plugin_registration_notifications",
    "NotifyRegistrationStatus calls received from the kubelet",
    ["registered"],
)
RPC_SECONDS = Histogram(
    "fractional_plugin_rpc_seconds",
    "Duration of kubelet-facing RPCs",
    ["service", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 45.0),
)
CLAIM_OPERATIONS_TOTAL = Counter(
    "fractional_plugin_claim_operations",
    "Per-claim prepare/unprepare outcomes",
    ["operation", "result"],
)
CLAIM_STATUS_WRITES_TOTAL = Counter(
    "fractional_plugin_claim_status_writes",
    "ResourceClaim status.devices writes after prepare (write) and unprepare (remove), by outcome "
    "(ok, unchanged, gone, failed)",
    ["operation", "result"],
)
HEALTH_CHANGES_TOTAL = Counter(
    "fractional_plugin_health_changes",
    "Device health changes seen by the monitor (each triggers a slice publish and a health-stream message)",
)
CHECKPOINT_CORRUPT_TOTAL = Counter(
    "fractional_plugin_checkpoint_corrupt",
    "Checkpoint files found corrupt and set aside",
)
PREPARED_CLAIMS = Gauge("fractional_plugin_prepared_claims", "Claims in the checkpoint")
PREPARE_REFUSED_TOTAL = Counter(
    "fractional_plugin_prepare_refused",
    "Allocated claims the node agent refused to prepare, by reason (overcommit: a share would take a "
    "GPU past its published memory or compute capacity)",
    ["reason"],
)
PREPARES_REDONE_TOTAL = Counter(
    "fractional_plugin_prepares_redone",
    "Prepared claims prepared again from scratch, by reason (reallocated: the API allocated other "
    "devices, shares or limits under the same claim UID; the old ones were released first)",
    ["reason"],
)
HEALTH_STREAMS = Gauge(
    "fractional_plugin_health_streams", "Open NodeWatchResources streams (each holds a worker)"
)
GPUS_CLAIMED_ELSEWHERE = Gauge(
    "fractional_plugin_gpus_claimed_elsewhere",
    "GPUs of this node also handed out by NVIDIA's device plugin (claimed_by=device-plugin: the Node "
    "advertises nvidia.com/gpu, so all of them) or published by another DRA driver with the same UUID "
    "(claimed_by=dra-driver); withheld from the slices unless --withhold-claimed-gpus=false",
    ["node", "claimed_by"],
)
