"""TLS channel credentials for the clients, from PEM files.

    Client(address, credentials=tls_credentials(ca_file="ca.pem"), token=...)

No CA file means the system's trusted roots (a publicly signed server certificate). A client
certificate and key are for servers that require mutual TLS (`--tls-client-ca` on the server).
"""

from __future__ import annotations

from pathlib import Path

import grpc


def tls_credentials(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """Credentials for a TLS channel; raises ValueError naming a missing or non-PEM file."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs its key: give both cert_file and key_file")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(ca_file, "CA") if ca_file else None,
        private_key=_read_pem(key_file, "client key") if key_file else None,
        certificate_chain=_read_pem(cert_file, "client certificate") if cert_file else None,
    )


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} file {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"the TLS {what} file {path} is not PEM (no -----BEGIN line)")
    return data
