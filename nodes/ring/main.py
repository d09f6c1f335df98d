"""`prima-node`: one device of the ring. Serves Ring, Control and Inference until stopped."""

import asyncio
import gc
import logging
import signal
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import structlog
import typer

from nodes.engine.kv_dtype import CHOICES as KV_CHOICES
from nodes.errors import Rejected, RequestFailed
from nodes.ring import discovery, handover, metrics, options, owner
from nodes.ring.auth import TokenAuth
from nodes.ring.config import NodeConfig
from nodes.ring.join import JoinError, join_ring
from nodes.ring.node import Node
from nodes.ring.services import ControlService, InferenceService, RingService
from prima_rpc.channel import SERVER_OPTIONS, Tls, configure_tls, read_pem
from prima_rpc.spec.manifest import StoreError
from prima_rpc.v1 import prima_pb2_grpc as rpc

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def parse_size(text: str) -> int:
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
             "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    num = t.rstrip("abgikm")
    try:
        value = float(num) * units[t[len(num):]]
    except (ValueError, KeyError):
        raise typer.BadParameter(f"{text!r} is not a size like 512MiB or 2GiB") from None
    if value < 0:
        raise typer.BadParameter("a size cannot be negative")
    return int(value)


def _owner_limits(replan: str, max_cpu: float, max_memory: str, nice: bool) -> owner.Limits:
    if replan not in ("on", "off"):
        raise typer.BadParameter(f"--replan must be on or off, got {replan!r}")
    try:
        return owner.Limits(owner.check_max_cpu(max_cpu),
                            owner.parse_max_memory(max_memory, owner.available_memory(), parse_size), nice)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


async def serve(cfg: NodeConfig, ready=lambda address: None, metrics_port: int = 0,
                tls: grpc.ServerCredentials | None = None, join: str = "", discover: bool = False) -> None:
    """metrics_port: serve Prometheus metrics on cfg.host:metrics_port at /metrics (0: off).
    tls: serve TLS with these credentials (else plaintext). join: a member of a running ring to join (JoinError).
    discover: announce this node over mDNS, and (with no peer nor join) find a running ring to join (DiscoveryError)."""
    stop = asyncio.Event()
    interceptors = [TokenAuth(cfg.token)] if cfg.token else []
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    bind = f"{cfg.host}:{cfg.port}"
    port = server.add_secure_port(bind, tls) if tls else server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    advertised = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    node = Node(replace(cfg, port=port))
    node.address = f"{advertised}:{port}"
    rpc.add_RingServicer_to_server(RingService(node), server)
    rpc.add_ControlServicer_to_server(ControlService(node, stop), server)
    rpc.add_InferenceServicer_to_server(InferenceService(node), server)
    await server.start()
    try:
        exporter = await metrics.start(node, cfg.host, metrics_port, cfg.token) if metrics_port else None
    except OSError as exc:
        await server.stop(grace=None)
        raise OSError(f"metrics: cannot listen on {cfg.host}:{metrics_port}: {exc}") from None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if not cfg.token and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        structlog.get_logger().warning(
            f"NO TOKEN: anyone who can reach {cfg.host}:{port} can drive this node; "
            "start every node with PRIMA_TOKEN=SECRET (or --token-file)")
    ready(node.address)
    announcer = discovery.Announcer()
    try:
        await _enter(node, join, discover, announcer)
        async with asyncio.TaskGroup() as tasks:
            actor = tasks.create_task(node.run(), name="node")
            await stop.wait()
            await _hand_over(node)
            # End in-flight requests with a clear status before the server stops taking calls.
            if node.head is not None:
                node.head.requests.fail_all(RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                                 f"{node.cfg.name or node.address} is shutting down"))
            await server.stop(grace=2)
            actor.cancel()  # the node closes its link, channels and compute thread
    finally:
        await announcer.close()
        await server.stop(grace=2)
        if exporter is not None:
            await exporter.cleanup()


async def _enter(node: Node, join: str, discover: bool, announcer: discovery.Announcer) -> None:
    """Before the actor runs (frames that reach a new relay wait in its outbox): announce this node (discover), and
    join the ring of `join`, or with neither a peer nor `join`, of a node discovery finds."""
    if discover:
        port = int(node.address.rpartition(":")[2])
        await announcer.start(node.cfg.name, discovery.announced_hosts(node.cfg.host, node.address.rpartition(":")[0]),
                              port, node.node_id)
        if not join and not node.cfg.peer:
            join = await discovery.find_ring(node.address, node.cfg.token)
            node.log.info("found a running ring on the LAN", member=join)
    if join:
        await join_ring(node, join)


async def _hand_over(node: Node) -> None:
    """A head with members hands its role to the standby before it stops (its clients resume there)."""
    if node.head is None or not node.head.members.members:
        return
    try:
        await handover.hand_over(node, forget=False)
    except Rejected as exc:
        node.log.warning("stopping without a hand-over", error=str(exc))


def server_tls(cert: Path | None, key: Path | None, ca: Path | None, mutual: bool) -> grpc.ServerCredentials | None:
    """Server credentials, and how this node dials others (the same CA; its own certificate if mutual)."""
    if not (cert or key or ca or mutual):
        return None
    if not (cert and key and ca):
        raise ValueError("TLS needs --tls-cert, --tls-key and --tls-ca together")
    cert_pem, key_pem, ca_pem = read_pem(cert, "certificate"), read_pem(key, "key"), read_pem(ca, "CA")
    configure_tls(Tls(ca_pem, cert_pem if mutual else None, key_pem if mutual else None))
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem if mutual else None,
                                       require_client_auth=mutual)


@app.command()
def main(peer: str = options.PEER,
         join: str = options.JOIN,
         discover: bool = options.DISCOVER,
         port: int = options.PORT,
         host: str = options.HOST,
         model: Path = options.MODEL,
         cache: Path = options.CACHE,
         name: str = options.NAME,
         mem_budget: str = options.MEM_BUDGET,
         token: str = options.TOKEN,
         dtype: str = options.DTYPE,
         kv_dtype: str = options.KV_DTYPE,
         ctx: int = options.CTX,
         metrics_port: int = options.METRICS_PORT,
         tls_cert: Path = options.TLS_CERT,
         tls_key: Path = options.TLS_KEY,
         tls_ca: Path = options.TLS_CA,
         tls_mutual: bool = options.TLS_MUTUAL,
         draft: Path = options.DRAFT,
         max_batch: int = options.MAX_BATCH,
         prefix_disk: str = options.PREFIX_DISK,
         prefix_dir: Path = options.PREFIX_DIR,
         inline_ms: float = options.INLINE_MS,
         replan: str = options.REPLAN,
         max_cpu: float = options.MAX_CPU,
         max_memory: str = options.MAX_MEMORY,
         nice: bool = options.NICE,
         log_level: str = options.LOG_LEVEL):
    """Run one node of a prima-rpc ring."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr, format="%(message)s")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(log_level.upper())),
                        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    _check(peer, join, discover, dtype, kv_dtype)
    from prima_rpc.spec.home import prima_home

    limits = _owner_limits(replan, max_cpu, max_memory, nice)
    cfg = NodeConfig(port=port, host=host, peer=peer or join, model=model, cache=cache or prima_home() / "cache",
                     name=name, mem_budget=parse_size(mem_budget), token=token, dtype=dtype, draft=draft,
                     max_batch=max_batch, inline_s=inline_ms / 1e3, kv_dtype=kv_dtype, ctx=ctx,
                     prefix_dir=prefix_dir or prima_home() / "prefixes", prefix_disk=parse_size(prefix_disk),
                     replan=replan == "on", max_cpu=limits.max_cpu, max_memory=limits.max_memory, nice=limits.nice)
    if done := owner.apply_limits(limits):
        print(f"prima-node: owner limits: {', '.join(done)}", file=sys.stderr)
    try:
        tls = server_tls(tls_cert, tls_key, tls_ca, tls_mutual)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    gc.freeze()  # torch's ~200k import-time objects: no full collection nor the exit walks them (a stop: 12 s -> 4)
    try:
        _runner()(serve(cfg, ready=lambda address: print(f"prima-node listening on {address}", flush=True),
                     metrics_port=metrics_port, tls=tls, join=join, discover=discover))
    except (StoreError, OSError, JoinError, discovery.DiscoveryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


def _check(peer: str, join: str, discover: bool, dtype: str | None, kv_dtype: str) -> None:
    """The options that exclude or name one another, checked before anything starts."""
    if (bool(peer) == bool(join)) and (peer or not discover):
        raise typer.BadParameter("give --peer (a ring being built) or --join (a running ring), one of them "
                                 "(or --discover alone: join a ring found on the LAN)")
    if dtype not in (None, "float32", "bfloat16"):
        raise typer.BadParameter("--dtype must be float32 or bfloat16")
    if kv_dtype not in KV_CHOICES:
        raise typer.BadParameter(f"--kv-dtype must be one of {', '.join(KV_CHOICES)}")


def _runner():
    """uvloop's run where it exists (not on Windows), else asyncio's."""
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


if __name__ == "__main__":
    app()
