"""TLS for `simpletuner server --ssl`: load a supplied pair, or generate a self-signed one; fingerprints."""

import datetime
import os
import shutil
import socket
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .endpoints import host_ip
from .errors import CLIError

CERT_VALID_DAYS = 825


def cert_fingerprint(cert):
    """Return the SHA-256 fingerprint of ``cert`` as colon-separated upper-case hex, as openssl prints it."""
    return ":".join(f"{byte:02X}" for byte in cert.fingerprint(hashes.SHA256()))


def load_cert(certfile):
    """Return the PEM certificate in ``certfile``."""
    return x509.load_pem_x509_certificate(certfile.read_bytes())


def load_tls_pair(certfile, keyfile):
    """Return the certificate in ``certfile``; raise CLIError (status 2) unless it and ``keyfile`` form a pair."""
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not path.is_file():
            raise CLIError(f"{flag} {path}: no such file", status=2)
    try:
        cert = x509.load_pem_x509_certificate(certfile.read_bytes())
    except (OSError, ValueError) as exc:
        raise CLIError(f"--ssl-certfile {certfile}: not a PEM certificate ({exc})", status=2) from None
    try:
        key = serialization.load_pem_private_key(keyfile.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CLIError(f"--ssl-keyfile {keyfile}: not an unencrypted PEM private key ({exc})", status=2) from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise CLIError(f"--ssl-keyfile {keyfile} is not the key of --ssl-certfile {certfile}", status=2)
    return cert


def _subject_alt_names(host):
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    ip = host_ip(host)
    if ip is None or not ip.is_unspecified:
        names.append(host)
    entries = []
    for name in dict.fromkeys(names):
        ip = host_ip(name)
        entries.append(x509.IPAddress(ip) if ip is not None else x509.DNSName(name))
    return entries


def _self_signed_cert(key, host):
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "SimpleTuner orchestrator (self-signed)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    public_key = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(_subject_alt_names(host)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key), critical=False)
        .sign(key, hashes.SHA256())
    )


def ensure_self_signed_cert(tls_dir, host):
    """Return (cert path, key path, created): the pair in ``tls_dir``, generated there if it has none.

    The pair is written into a private temporary directory that is then renamed to ``tls_dir``, so two
    servers starting at once on one data directory end up sharing one matching pair.
    Raise CLIError if ``tls_dir`` holds only one of the two files.
    """
    cert_path, key_path = tls_dir / "cert.pem", tls_dir / "key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path, False
    if cert_path.exists() or key_path.exists():
        raise CLIError(f"{tls_dir} holds only one of cert.pem and key.pem; remove the directory to generate a new pair")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _self_signed_cert(key, host)
    tls_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tls-", dir=tls_dir.parent))
    try:
        key_fd = os.open(staging / "key.pem", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(key_fd, "wb") as fh:
            fh.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        (staging / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        try:
            os.rename(staging, tls_dir)
        except OSError:
            if not (cert_path.exists() and key_path.exists()):
                raise
            return cert_path, key_path, False  # another server generated the pair first
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cert_path, key_path, True
