"""Certificates and keys for the local cluster, made with the openssl command (Debian's).

One CA signs everything: the apiserver's serving certificate (SANs for loopback, the node
addresses and the `kubernetes` Service), x509 client certificates for the admin and each
component (the Node authorizer and RBAC read their CN and O), each kubelet's serving certificate,
and the service-account signing key pair.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClientCert", "Pki", "make_pki", "serving_cert"]

DAYS = 3650


@dataclass(frozen=True, slots=True)
class ClientCert:
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class Pki:
    directory: Path
    ca_cert: Path
    ca_key: Path
    serving: ClientCert
    sa_key: Path
    sa_pub: Path

    def client(self, name: str) -> ClientCert:
        return ClientCert(self.directory / f"{name}.crt", self.directory / f"{name}.key")


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()[-500:]}")


def _key(path: Path) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        str(path),
        cwd=path.parent,
    )


def _signed(pki_dir: Path, name: str, subject: str, *, sans: list[str] | None, usage: str) -> ClientCert:
    key, csr, cert = pki_dir / f"{name}.key", pki_dir / f"{name}.csr", pki_dir / f"{name}.crt"
    ext = pki_dir / f"{name}.ext"
    lines = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment"]
    lines.append(f"extendedKeyUsage={usage}")
    if sans:
        lines.append("subjectAltName=" + ",".join(sans))
    ext.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr), cwd=pki_dir)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", str(DAYS), "-sha256", "-extfile", str(ext), "-out", str(cert), cwd=pki_dir,
    )  # fmt: skip
    csr.unlink()
    ext.unlink()
    return ClientCert(cert, key)


def make_pki(pki_dir: Path, *, clients: dict[str, str], node_ips: list[str]) -> Pki:
    """``clients``: file name -> subject (``/CN=.../O=...``). Each node IP gets a kubelet serving
    certificate ``kubelet-<ip>``."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    _key(pki_dir / "ca.key")
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=fractional-local-ca", "-days", str(DAYS),
        "-sha256", "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", "-out", "ca.crt", cwd=pki_dir,
    )  # fmt: skip
    names = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"]
    names.append("kubernetes.default.svc.cluster.local")
    sans = [f"DNS:{n}" for n in names] + ["IP:127.0.0.1", "IP:10.0.0.1"] + [f"IP:{ip}" for ip in node_ips]
    serving = _signed(pki_dir, "apiserver", "/CN=kube-apiserver", sans=sans, usage="serverAuth")
    for name, subject in clients.items():
        _signed(pki_dir, name, subject, sans=None, usage="clientAuth")
    for ip in node_ips:
        _signed(pki_dir, f"kubelet-{ip}", f"/CN={ip}", sans=[f"IP:{ip}", f"DNS:{ip}"], usage="serverAuth")
    _openssl(
        "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=pki_dir
    )
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki_dir)
    return Pki(
        pki_dir, pki_dir / "ca.crt", pki_dir / "ca.key", serving, pki_dir / "sa.key", pki_dir / "sa.pub"
    )


def node_certs(pki_dir: Path, ip: str) -> None:
    """The certificates of a node that joins after the control plane started: its kubelet's client
    certificate ``node-<ip>`` and serving certificate ``kubelet-<ip>``, as ``make_pki`` makes them."""
    _signed(pki_dir, f"node-{ip}", f"/CN=system:node:{ip}/O=system:nodes", sans=None, usage="clientAuth")
    _signed(pki_dir, f"kubelet-{ip}", f"/CN={ip}", sans=[f"IP:{ip}", f"DNS:{ip}"], usage="serverAuth")


def serving_cert(pki_dir: Path, name: str, sans: list[str]) -> ClientCert:
    """A serving certificate ``<name>.crt`` for ``sans`` (``IP:...``, ``DNS:...``), signed by the CA
    of ``pki_dir`` (for a webhook server the apiserver calls)."""
    return _signed(pki_dir, name, f"/CN={name}", sans=sans, usage="serverAuth")
