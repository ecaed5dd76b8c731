"""Kueue on the local cluster: its manager, built from its own Go module (hack/upstream-build.sh,
component ``kueue``), runs on this machine out of cluster against the real kube-apiserver, with its
CRDs and its webhooks, as Kueue's own integration tests run it on envtest.

- CRDs: ``config/components/crd/bases`` of the module, applied server-side.
- Webhooks: ``config/components/webhook/manifests.yaml``, only the entries for Kueue's own kinds and
  for ``batch/v1`` Jobs (the one integration turned on), each pointed at
  ``https://127.0.0.1:<port><path>`` with the cluster CA as its ``caBundle``. An entry for an
  integration that is off would answer 404 and, with ``failurePolicy: Fail``, refuse every object
  of its kind (pods included) cluster-wide.
- Certificates: a serving certificate for 127.0.0.1 signed by the cluster CA, for the webhook server
  and (Kueue reads it from a fixed path when its internal certificate management is off) the
  metrics server, whose directory ``/etc/kueue/metrics/certs`` is made here and removed again.
- Configuration: ``config.kueue.x-k8s.io/v1beta2`` with no leader election, no internal certificate
  management, the Job integration, our GPU memory mapped to Kueue's DRA accounting
  (``KueueDRAIntegrationConsumableCapacity``, as docs/kueue.md describes), and no on-demand
  visibility API (its server reads a certificate from a fixed /visibility and exits without one).
"""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from localcluster.cluster import Binaries, ClusterError, LocalCluster, free_port
from localcluster.node import kubectl_command
from localcluster.pki import serving_cert

__all__ = ["KUEUE_NAMESPACE", "start_kueue", "stop_kueue"]

KUEUE_NAMESPACE = "kueue-system"
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
WEBHOOK_GROUPS = {"kueue.x-k8s.io", "batch"}
# Kueue's two configurations, renamed with a kueue- prefix (their upstream names are generic).
WEBHOOK_CONFIGURATIONS = (
    ("mutatingwebhookconfiguration", "kueue-mutating-webhook-configuration"),
    ("validatingwebhookconfiguration", "kueue-validating-webhook-configuration"),
)


def _module_dir(binaries: Binaries) -> Path:
    """The Kueue module's source in the Go module cache (its CRDs and webhook manifests)."""
    version = binaries.kueue.name.removeprefix("kueue-")
    cache = binaries.kueue.parent.parent / "go" / "mod" / "sigs.k8s.io" / f"kueue@{version}"
    if not (cache / "config" / "components").is_dir():
        raise ClusterError(f"Kueue's module source is not in the Go module cache: {cache}")
    return cache


def _configuration(cluster: LocalCluster, ports: dict[str, int], cert_dir: Path) -> dict[str, Any]:
    selector = 'device.driver == "fractional.dev" && device.attributes["fractional.dev"].type == "gpu"'
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['health']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{ports['metrics']}"},
        "webhook": {"host": "127.0.0.1", "port": ports["webhook"], "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["batch/job"]},
        # VisibilityOnDemand (on by default) serves its API with a certificate from /visibility and
        # exits when there is none; nothing here reads that API.
        "featureGates": {"KueueDRAIntegrationConsumableCapacity": True, "VisibilityOnDemand": False},
        "resources": {
            "deviceClassMappings": [
                {
                    "name": "fractional.dev/gpu-memory",
                    "deviceClassNames": ["gpu.fractional.dev"],
                    "sources": [
                        {
                            "capacity": {
                                "name": "memory",
                                "driver": "fractional.dev",
                                "deviceSelector": {"cel": {"expression": selector}},
                            }
                        }
                    ],
                },
                {"name": "fractional.dev/nic", "deviceClassNames": ["nic.fractional.dev"]},
            ]
        },
    }


def _webhooks(module: Path, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, kept to Kueue's kinds and Jobs, served at 127.0.0.1."""
    documents = yaml.safe_load_all((module / "config/components/webhook/manifests.yaml").read_text())
    configurations = []
    for document in documents:
        if not document:
            continue
        kept = []
        for webhook in document.get("webhooks", []):
            groups = {g for rule in webhook.get("rules", []) for g in rule.get("apiGroups", [])}
            if not groups <= WEBHOOK_GROUPS:
                continue
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
            kept.append(webhook)
        document["metadata"]["name"] = f"kueue-{document['metadata']['name']}"
        document["webhooks"] = kept
        configurations.append(document)
    return configurations


def _kubectl(cluster: LocalCluster, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [*kubectl_command(cluster), *args], input=stdin, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args[:3])}: {done.stderr.strip()[-1000:]}")
    return done.stdout


def start_kueue(cluster: LocalCluster, binaries: Binaries, *, timeout_seconds: float = 120.0) -> None:
    """Start Kueue's manager against the cluster and wait for its webhooks to answer."""
    if cluster.processes.get("kueue") is not None:
        return
    module = _module_dir(binaries)
    state = cluster.state_dir / "kueue"
    cert_dir = state / "certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    serving = serving_cert(cluster.pki_dir, "kueue-webhook", ["IP:127.0.0.1"])
    shutil.copyfile(serving.cert, cert_dir / "tls.crt")
    shutil.copyfile(serving.key, cert_dir / "tls.key")
    METRICS_CERTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(serving.cert, METRICS_CERTS / "tls.crt")
    shutil.copyfile(serving.key, METRICS_CERTS / "tls.key")
    ports = {"webhook": free_port(), "health": free_port(), "metrics": free_port()}
    cluster.processes.extra["kueue_ports"] = ports
    config = state / "configuration.yaml"
    config.write_text(yaml.safe_dump(_configuration(cluster, ports, cert_dir)), encoding="utf-8")

    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}}
    _kubectl(cluster, "apply", "-f", "-", stdin=json.dumps(namespace))
    crds = sorted((module / "config/components/crd/bases").glob("*.yaml"))
    _kubectl(cluster, "apply", "--server-side", "--force-conflicts", *[f"-f={p}" for p in crds])
    _kubectl(cluster, "wait", "--for=condition=Established", "--timeout=60s", *[f"-f={p}" for p in crds])

    cluster.processes.start(
        "kueue",
        [str(binaries.kueue / "kueue"), f"--config={config}", f"--kubeconfig={cluster.kubeconfig}",
         "--zap-log-level=info"],
    )  # fmt: skip
    _wait_ready(cluster, ports, timeout_seconds)
    ca_bundle = base64.b64encode((cluster.pki_dir / "ca.crt").read_bytes()).decode()
    items = _webhooks(module, ports["webhook"], ca_bundle)
    webhooks = {"apiVersion": "v1", "kind": "List", "items": items}
    _kubectl(cluster, "apply", "-f", "-", stdin=json.dumps(webhooks))


def _wait_ready(cluster: LocalCluster, ports: dict[str, int], timeout_seconds: float) -> None:
    process = cluster.processes.get("kueue")
    assert process is not None
    context = ssl.create_default_context(cafile=str(cluster.pki_dir / "ca.crt"))
    deadline = time.monotonic() + timeout_seconds
    last = ""
    while time.monotonic() < deadline:
        if not process.alive():
            raise ClusterError(f"Kueue exited; log: {process.log}\n{_tail(Path(process.log))}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['health']}/readyz", timeout=3) as answer:
                if answer.status == 200:
                    # The webhook server too: a TLS handshake with our CA.
                    with urllib.request.urlopen(
                        f"https://127.0.0.1:{ports['webhook']}/", timeout=3, context=context
                    ):
                        pass
                    return
        except urllib.error.HTTPError as error:
            if error.code == 404 and "readyz" not in error.url:  # the webhook server answers, no page at /
                return
            last = str(error)
        except OSError as error:
            last = str(error)
        time.sleep(1)
    raise ClusterError(f"Kueue was not ready in {timeout_seconds:.0f}s ({last}); log: {process.log}")


def stop_kueue(cluster: LocalCluster) -> list[str]:
    """Remove the webhooks first (so the cluster works without Kueue), then stop the manager."""
    done = []
    process = cluster.processes.get("kueue")
    for kind, name in WEBHOOK_CONFIGURATIONS:
        subprocess.run(
            [*kubectl_command(cluster), "delete", kind, name, "--ignore-not-found", "--wait=false"],
            capture_output=True, check=False,
        )  # fmt: skip
    if process is not None:
        cluster.processes.stop(process)
        done.append(f"stopped kueue (pid {process.pid})")
    shutil.rmtree(METRICS_CERTS.parent.parent, ignore_errors=True)
    return done


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
