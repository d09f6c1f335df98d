"""The one place for channel options, message limits, deadlines and auth metadata."""

import grpc

MAX_MESSAGE_BYTES = 64 << 20  # a prefill chunk of 512 tokens x 8192 hidden x fp32 is 16 MiB
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = OPTIONS + [("grpc.http2.min_ping_interval_without_data_ms", 5_000)]
TOKEN_KEY = "x-prima-token"


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_KEY, token),) if token else ()


def aio_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OPTIONS)


def sync_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=OPTIONS)
