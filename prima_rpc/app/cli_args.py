"""Checks of `prima-ctl` arguments, made before anything starts: the target node, text, requests, stores, windows."""

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

import grpc

from prima_rpc.app.cli_errors import fail
from prima_rpc.channel import read_token
from prima_rpc.request import GenerateRequest, check_text

DEFAULT_NODE = "127.0.0.1:7000"


@dataclass(frozen=True)
class Target:
    """The node the ring commands talk to (--node), whether it was given, and the token they present; `nodes`: every
    member --node named (A,B,C), which generate, chat and serve fail over along."""

    node: str = DEFAULT_NODE
    token: str | None = None
    node_given: bool = False
    nodes: tuple[str, ...] = ()


def target(node: str | None, token_file: Path | None, command: str | None = None) -> Target:
    """--node (HOST:PORT, or several as A,B,C: the first answering is asked) and --token-file, read once by
    prima-ctl's callback; without --node, the local ring `command` would talk to (see default_node)."""
    try:
        token = read_token(token_file)
    except ValueError as exc:
        fail(str(exc))
    local = None if node is not None else default_node(command)
    nodes = tuple(dict.fromkeys(address(a, "--node") for a in (node or local or DEFAULT_NODE).split(",")))
    return Target(_first_answering(nodes, token), token, node is not None, nodes)


RING_COMMANDS = ("start", "status", "generate", "chat", "plan", "serve", "leave")  # they talk to a node; down may


def default_node(command: str | None) -> str | None:
    """The head of the one local ring up under $PRIMA_HOME/run/ (None: there is none, or `command` talks to no
    node); with several, a one-line error naming them, as --node must choose."""
    if command not in (*RING_COMMANDS, "down"):
        return None
    from prima_rpc.app.local_ring import recorded_rings

    heads = [r.addresses[0] for r in recorded_rings() if r.addresses and r.alive()]
    if len(heads) == 1:
        return heads[0]
    if len(heads) > 1 and command != "down":  # down --local stops them all; down alone falls back to DEFAULT_NODE
        fail(f"{len(heads)} local rings are up (heads {', '.join(heads)}); choose one with --node HOST:PORT")
    return None


def _first_answering(nodes: tuple[str, ...], token: str | None) -> str:
    """Of several --node addresses, the first that answers (a lost head is skipped); one is taken as it is."""
    if len(nodes) == 1:
        return nodes[0]
    from prima_rpc.control import Control, Deadlines

    for node in nodes:
        try:
            with Control(node, token, Deadlines(info=2.0)) as peer:
                peer.info()
            return node
        except grpc.RpcError:
            continue
    return nodes[0]


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


TEMPLATE_VAR_HELP = "NAME=VALUE for the chat template (repeatable; VALUE as JSON where it is): enable_thinking=false"


def template_vars(items: list[str]) -> str:
    """--template-var NAME=VALUE options as chat_template_kwargs' JSON: VALUE read as JSON where it is (false, 3,
    "x"), else as a string; a one-line error for an item without NAME=."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            fail(f"--template-var takes NAME=VALUE (e.g. enable_thinking=false), got {item!r}")
        try:
            out[name.strip()] = json.loads(value)
        except ValueError:
            out[name.strip()] = value
    return json.dumps(out) if out else ""


TEMPERATURE_HELP = ("0: greedy; default: the model's sampling (its store's settings, else temperature 0.8, top-k 40, "
                    "top-p 0.95, min-p 0.05, repeat penalty 1.1 over the last 64 tokens)")


def request(**fields) -> GenerateRequest:
    """A GenerateRequest of the command's options, or the one-line error of the first the head would refuse."""
    try:
        return GenerateRequest(**fields)
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
