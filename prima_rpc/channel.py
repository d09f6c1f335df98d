"""The one place for channel options, message limits, TLS, deadlines and auth metadata."""

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 64 << 20  # a prefill chunk of 512 tokens x 8192 hidden x fp32 is 16 MiB
# A peer that stops answering with its connection still open (SIGSTOP, a frozen laptop, a cable pulled while TCP
# stays up) is noticed by HTTP/2 pings: one after KEEPALIVE_S without a read, the connection closed (UNAVAILABLE,
# which clients that know several members resume from) when it is not acknowledged within PING_TIMEOUT_S.
KEEPALIVE_S, PING_TIMEOUT_S = 10, 5
STALL_S = KEEPALIVE_S + PING_TIMEOUT_S  # the longest a call waits on a stopped peer
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_S * 1000),
    # gRPC core (1.85) waits for the keepalive ping's ack this long, not keepalive_timeout_ms; its default is a
    # minute (an internal argument: chttp2's GRPC_ARG_PING_TIMEOUT_MS)
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# a server takes those pings: at most one per KEEPALIVE_S, more often than every 5 s is a strike (2 close it)
SERVER_OPTIONS = OPTIONS + [("grpc.http2.min_ping_interval_without_data_ms", 5_000)]
TOKEN_KEY = "x-prima-token"
TOKEN_ENV = "PRIMA_TOKEN"


def read_token(path: str | Path | None = None) -> str | None:
    """The cluster secret from the file `path`, else from $PRIMA_TOKEN (None: no token). Never from a command
    line, which `ps` shows to every user of the machine. ValueError says what is wrong with it."""
    if path is not None:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the token file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        where = f"the token file {path}"
    else:
        token, where = os.environ.get(TOKEN_ENV, "").strip(), f"${TOKEN_ENV}"
    if path is not None and not token:
        raise ValueError(f"{where} is empty")
    if not all(" " <= c < "\x7f" for c in token):  # it travels as gRPC metadata and an HTTP header
        raise ValueError(f"{where}: the token must be printable ASCII")
    return token or None


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_KEY, token),) if token else ()


@dataclass(frozen=True)
class Tls:
    """PEM bytes: the roots to trust, and (mutual TLS) the certificate and key to present."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


_tls: list[Tls | None] = []  # resolved once per process


def read_pem(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None


def configure_tls(tls: Tls | None) -> None:
    """Set how this process dials (a node: its successor and ring members)."""
    _tls[:] = [tls]


def client_tls() -> Tls | None:
    """TLS for outgoing calls: set by configure_tls, else from PRIMA_TLS_CA (+ PRIMA_TLS_CERT/KEY)."""
    if not _tls:
        ca, cert, key = (os.environ.get(f"PRIMA_TLS_{k}") for k in ("CA", "CERT", "KEY"))
        _tls.append(Tls(read_pem(ca, "CA"), cert and read_pem(cert, "certificate"), key and read_pem(key, "key"))
                    if ca else None)
    return _tls[0]


def aio_channel(address: str) -> grpc.aio.Channel:
    tls = client_tls()
    if tls:
        return grpc.aio.secure_channel(address, tls.credentials(), options=OPTIONS)
    return grpc.aio.insecure_channel(address, options=OPTIONS)


def sync_channel(address: str) -> grpc.Channel:
    tls = client_tls()
    if tls:
        return grpc.secure_channel(address, tls.credentials(), options=OPTIONS)
    return grpc.insecure_channel(address, options=OPTIONS)
