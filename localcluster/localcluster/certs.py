"""Certificates for the local control plane, made with the ``openssl`` command line.

One CA signs the API server's serving certificate and an admin client certificate
(``O=system:masters``); a separate RSA key signs service-account tokens.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path


class CertError(RuntimeError):
    """openssl is missing or failed."""


@dataclasses.dataclass(frozen=True)
class Certs:
    """Paths of everything the components need."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def apiserver_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def admin_crt(self) -> Path:
        return self.dir / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.dir / "admin.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CertError(f"openssl {args[0]} failed: {proc.stderr.strip()[-2000:]}")


def generate(directory: Path, days: int = 30) -> Certs:
    """Create a fresh CA, serving and client certificates and the service-account key pair."""
    if shutil.which("openssl") is None:
        raise CertError("the 'openssl' command is needed to make the local cluster's certificates")
    directory.mkdir(parents=True, exist_ok=True)
    c = Certs(directory)
    d = str(days)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        c.ca_key.name,
        "-out",
        c.ca_crt.name,
        "-days",
        d,
        "-subj",
        "/CN=megatron-localcluster-ca",
        cwd=directory,
    )
    san = "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost," + ",".join(
        f"DNS:{n}" for n in ("kubernetes", "kubernetes.default", "kubernetes.default.svc")
    )
    for name, subj, ext in (
        ("apiserver", "/CN=kube-apiserver", san),
        ("admin", "/O=system:masters/CN=megatron-localcluster-admin", "extendedKeyUsage=clientAuth"),
    ):
        _request(directory, name, subj)
        _sign(directory, c, name, ext, d)
    _openssl("genrsa", "-out", c.sa_key.name, "2048", cwd=directory)
    _openssl("rsa", "-in", c.sa_key.name, "-pubout", "-out", c.sa_pub.name, cwd=directory)
    return c


def serving_cert(c: Certs, name: str, days: int = 30) -> tuple[Path, Path]:
    """A serving certificate for ``127.0.0.1``, signed by the cluster's CA (a webhook the API server
    calls by URL); returns the certificate's and the key's paths, in the CA's folder."""
    _request(c.dir, name, f"/CN={name}")
    _sign(c.dir, c, name, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth", str(days))
    return c.dir / f"{name}.crt", c.dir / f"{name}.key"


def _request(directory: Path, name: str, subject: str) -> None:
    """A new key ``name.key`` and its signing request ``name.csr`` for ``subject``."""
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
        cwd=directory,
    )  # fmt: skip


def _sign(directory: Path, c: Certs, name: str, ext: str, days: str) -> None:
    ext_file = directory / f"{name}.ext"
    ext_file.write_text(ext + "\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        c.ca_crt.name,
        "-CAkey",
        c.ca_key.name,
        "-CAcreateserial",
        "-out",
        f"{name}.crt",
        "-days",
        days,
        "-extfile",
        ext_file.name,
        cwd=directory,
    )
