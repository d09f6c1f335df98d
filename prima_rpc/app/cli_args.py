"""Checks of `prima-ctl` arguments, made before anything starts: addresses, text, numbers, stores, windows."""

import ipaddress
from pathlib import Path

from prima_rpc.app.cli_errors import fail
from prima_rpc.channel import read_token  # noqa: F401  (the CLI reads its token here)
from prima_rpc.client import check_request, check_text


def address(text: str, what: str) -> str:
    """HOST:PORT with an explicit port (gRPC would dial 443 without one); IPv6 as [::1]:7000."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            host = ""
    elif ":" in host:  # an IPv6 address without brackets: its last group would be read as the port
        host = ""
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        fail(f"{what} must be HOST:PORT with a port in 1-65535 (e.g. 127.0.0.1:7000), got {text!r}")
    return f"{host}:{int(port)}"


def text(value: str, what: str) -> str:
    try:
        return check_text(value, what)
    except ValueError as exc:
        fail(str(exc))


def generate_args(prompt: str, max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
                  stop: list[str]) -> None:
    """The ranges the head takes (prima_rpc.client's, shared with the HTTP API), checked here."""
    text(prompt, "the prompt")
    try:
        check_request(max_tokens, temperature, top_k, top_p, seed, tuple(stop))
    except ValueError as exc:
        fail(str(exc))


def store(path: Path) -> Path:
    """A layer store directory (its manifest is read, not its weights)."""
    from prima_rpc.spec.manifest import StoreError, read_manifest

    text(str(path), "the model path")
    try:
        read_manifest(path)
    except StoreError as exc:
        fail(f"{exc} (--model takes a directory made by prima-ctl import or synth)")
    return path


def windows(value: str) -> list[int]:
    try:
        sizes = [int(w) for w in value.split(",")]
    except ValueError:
        fail(f"--windows must be comma-separated integers like 10,10,10, got {value!r}")
    if any(w < 0 for w in sizes):
        fail(f"--windows cannot be negative, got {value!r}")
    return sizes
