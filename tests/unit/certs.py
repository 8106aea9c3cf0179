"""Test helper: a throwaway CA with a server/client certificate for 127.0.0.1."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tandem.common.tls import TLSSettings


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def make_pki(folder: Path) -> tuple[TLSSettings, TLSSettings]:
    """(settings signed by the test CA, settings signed by a stranger CA) — both valid for 127.0.0.1."""
    now = datetime.datetime.now(datetime.UTC)
    out = []
    for label in ("trusted", "stranger"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{label}-ca"))
            .issuer_name(_name(f"{label}-ca"))
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{label}-component"))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        (folder / f"{label}-ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        (folder / f"{label}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, folder / f"{label}.key")
        out.append(
            TLSSettings(
                enabled=True,
                cert_file=folder / f"{label}.pem",
                key_file=folder / f"{label}.key",
                ca_file=folder / "trusted-ca.pem",  # both trust the test CA; only one is signed by it
            )
        )
    return out[0], out[1]
