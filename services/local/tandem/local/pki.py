"""The local stack's certificate authority: one CA kept in the cache folder,
and one key and certificate per role (gateway, router, prefill, decode,
operator), so that ``make run`` and the tests' stacks run internal gRPC over
mutual TLS with the same per-role checks as the chart.

``ensure_pki(folder)`` creates what is missing and renews what is close to
expiry or was signed by another CA; it is called by
:class:`tandem.local.stack.LocalStack` before any component starts.
``python -m tandem.local.pki --rotate`` issues every role a new key and
certificate in place: running servers use them for their next handshake and
clients for their next channel, with no restart (:mod:`tandem.common.tls`).

Each certificate names its role in a URI SAN (:func:`tandem.common.identity.role_uri`)
and a DNS SAN (:func:`~tandem.common.identity.role_dns_name`), and carries the
DNS names ``tandem-internal`` (the name callers check, as in the chart) and
``localhost``, and the IP 127.0.0.1. Keys are EC P-256, written with mode 0600;
files are replaced atomically (written aside, then renamed), under a lock so
that two stacks starting at once share one CA.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tandem.common.identity import ROLES, role_dns_name, role_uri
from tandem.common.tls import TLSSettings

#: The name callers check in a server's certificate (TLSSettings.server_name_override), as in the chart.
SERVER_NAME = "tandem-internal"
CA_VALIDITY = datetime.timedelta(days=3650)
CERT_VALIDITY = datetime.timedelta(days=30)
#: A certificate with less than this left is issued again at the next start.
RENEW_BEFORE = datetime.timedelta(days=10)


def default_pki_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "pki"


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tandem"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(aside, mode)
    os.replace(aside, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    try:
        cert = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.not_valid_after_utc - _now() < RENEW_BEFORE:
        return None
    return cert, key


def _create_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("tandem local CA"))
        .issuer_name(_name("tandem local CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(key, hashes.SHA256())
    )
    _write(folder / "ca.key", _key_pem(key), 0o600)
    _write(folder / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def settings_for(folder: Path, role: str) -> TLSSettings:
    """The TLS settings of a component of ``role`` with this folder's files."""
    return TLSSettings(
        enabled=True,
        cert_file=folder / f"{role}.crt",
        key_file=folder / f"{role}.key",
        ca_file=folder / "ca.crt",
        server_name_override=SERVER_NAME,
    )


def _needs_issuing(folder: Path, role: str, ca: x509.Certificate) -> bool:
    try:
        cert = x509.load_pem_x509_certificate((folder / f"{role}.crt").read_bytes())
        (folder / f"{role}.key").stat()
    except (OSError, ValueError):
        return True
    return cert.issuer != ca.subject or cert.not_valid_after_utc - _now() < RENEW_BEFORE or _signature_fails(cert, ca)


def _signature_fails(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception):  # InvalidSignature has no common base with the others
        return True
    return False


def issue(
    folder: Path, role: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None
) -> TLSSettings:
    """A new key and certificate for ``role``, replacing the old ones (signed by ``ca``, else the folder's
    CA, created if missing)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_cert, ca_key = ca or _load_ca(folder) or _create_ca(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"tandem-{role}"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.UniformResourceIdentifier(role_uri(role)),
                    x509.DNSName(role_dns_name(role)),
                    x509.DNSName(SERVER_NAME),
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    # The key first: a server sees a pair that does not match until the certificate follows, and waits.
    _write(folder / f"{role}.key", _key_pem(key), 0o600)
    _write(folder / f"{role}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return settings_for(folder, role)


def ensure_pki(folder: Path | None = None, roles: tuple[str, ...] = ROLES) -> dict[str, TLSSettings]:
    """The CA and every role's certificate in ``folder`` (default ~/.cache/tandem/pki), created or
    renewed as needed; the TLS settings of each role."""
    folder = folder or default_pki_dir()
    with _locked(folder):
        ca = _load_ca(folder) or _create_ca(folder)
        return {
            role: issue(folder, role, ca) if _needs_issuing(folder, role, ca[0]) else settings_for(folder, role)
            for role in roles
        }


def rotate(folder: Path | None = None, roles: tuple[str, ...] = ROLES) -> dict[str, TLSSettings]:
    """Every role's key and certificate issued anew (same CA)."""
    folder = folder or default_pki_dir()
    with _locked(folder):
        ca = _load_ca(folder) or _create_ca(folder)
        return {role: issue(folder, role, ca) for role in roles}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.local.pki", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=default_pki_dir(), help="where the CA and certificates live")
    parser.add_argument("--rotate", action="store_true", help="issue every role a new key and certificate")
    args = parser.parse_args(argv)
    issued = rotate(args.dir) if args.rotate else ensure_pki(args.dir)
    for role, tls in issued.items():
        print(f"{role:9s} {tls.cert_file}")
    print(f"{'ca':9s} {args.dir / 'ca.crt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
