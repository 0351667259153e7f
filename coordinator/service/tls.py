"""TLS material of the gRPC server, read from PEM files at start-up.

Pure: this reads and checks the files; `service.build_server` turns them into gRPC credentials.
A file that is missing or not PEM fails the start with a message naming the file, instead of
an opaque handshake error on the first call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ServerTls:
    certificate_chain: bytes
    """PEM certificate chain the server presents."""
    private_key: bytes = field(repr=False)
    """PEM private key of the certificate."""
    client_ca: bytes | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed."""


def load_server_tls(cert_file: str, key_file: str, client_ca_file: str = "") -> ServerTls:
    return ServerTls(
        certificate_chain=_read_pem(cert_file, "certificate"),
        private_key=_read_pem(key_file, "private key"),
        client_ca=_read_pem(client_ca_file, "client CA") if client_ca_file else None,
    )


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} file {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"the TLS {what} file {path} is not PEM (no -----BEGIN line)")
    return data
