"""TLS and mTLS for the gRPC port (TGIS's TLS_CERT_PATH, TLS_KEY_PATH, TLS_CLIENT_CA_CERT_PATH).

The pairing rules (both cert and key or neither; a client CA only with the pair) are checked by
`ServerConfig`; this module reads the PEM files and checks them before the model loads, so a bad
path or a key that does not match its certificate stops start-up with a message naming the file
instead of failing every handshake later. HTTP (/health, /metrics, the OpenAI-compatible API)
stays plaintext, as in TGIS: probes reach /health over plain HTTP without client certificates
(docs/deployment.md, "TLS and mTLS").
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from server.config import ServerConfig


class TLSConfigError(ValueError):
    """A TLS file is missing, unreadable or not valid PEM, or the key does not match the cert."""


def _read_pem(file: Path, what: str, env: str) -> bytes:
    if not file.exists():
        raise TLSConfigError(f"tls: {what} file {str(file)!r} ({env}) does not exist")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise TLSConfigError(f"tls: cannot read {what} file {str(file)!r} ({env}): {e}") from e
    if b"-----BEGIN " not in data:
        raise TLSConfigError(f"tls: {what} file {str(file)!r} ({env}) is not PEM")
    return data


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """The gRPC server credentials for `config`, or None when TLS is off (plaintext port).

    With `tls_client_ca_cert_path`, clients must present a certificate signed by that CA
    (`require_client_auth=True`). Raises TLSConfigError, naming the file, when a file is missing,
    unreadable or not PEM, when the key does not match the certificate, or when the CA bundle
    holds no usable certificate.
    """
    if config.tls_cert_path is None or config.tls_key_path is None:
        return None
    cert_file = Path(config.tls_cert_path).expanduser()
    key_file = Path(config.tls_key_path).expanduser()
    cert = _read_pem(cert_file, "certificate", "TLS_CERT_PATH")
    key = _read_pem(key_file, "private key", "TLS_KEY_PATH")
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise TLSConfigError(
            f"tls: certificate {str(cert_file)!r} (TLS_CERT_PATH) and key {str(key_file)!r} "
            f"(TLS_KEY_PATH) are not a valid pair: {e}"
        ) from e
    client_ca = None
    if config.tls_client_ca_cert_path is not None:
        ca_file = Path(config.tls_client_ca_cert_path).expanduser()
        client_ca = _read_pem(ca_file, "client CA certificate", "TLS_CLIENT_CA_CERT_PATH")
        try:
            check.load_verify_locations(cafile=ca_file)
        except ssl.SSLError as e:
            raise TLSConfigError(
                f"tls: client CA file {str(ca_file)!r} (TLS_CLIENT_CA_CERT_PATH) holds no valid "
                f"certificate: {e}"
            ) from e
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
