"""Operations on a whole ring from outside: walk it, assign windows, read status (sync gRPC)."""

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from prima_rpc.control import Control, assign_request
from prima_rpc.spec.windows import layer_ranges
from prima_rpc.v1 import prima_pb2 as pb

MAX_RING = 256


class RingError(Exception):
    """The ring is not in a state the command can work with; code: the gRPC status behind it, if one was."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


def _failed(address: str, exc: grpc.RpcError) -> RingError:
    return RingError(f"{address}: {exc.code().name}: {exc.details()}", exc.code())


def walk(start: str, token: str | None = None) -> list[tuple[str, pb.NodeInfo]]:
    """(address, info) of every node in ring order from `start`, by following successors."""
    out: list[tuple[str, pb.NodeInfo]] = []
    seen: set[str] = set()
    address = start
    while len(out) <= MAX_RING:
        try:
            with Control(address, token) as peer:  # a channel per call: a watch walks the ring every second
                info = peer.info()
        except grpc.RpcError as exc:
            where = f" (successor of {out[-1][0]})" if out else ""
            raise RingError(f"cannot reach node {address}{where}: {exc.code().name}: {exc.details()}",
                            exc.code()) from None
        if info.node_id in seen:
            if info.node_id != out[0][1].node_id:
                chain = " -> ".join([a for a, _ in out] + [address])  # who pointed where: the race behind a loop
                raise RingError(f"the successors of {start} lead into a loop that skips it at {address}: {chain}",
                                grpc.StatusCode.ABORTED)  # a rewiring under way; it closes once settled
            return out
        seen.add(info.node_id)
        out.append((address, info))
        address = info.peer
    raise RingError(f"no ring closes within {MAX_RING} nodes")


def manifest(node: str, token: str | None = None) -> dict | None:
    """The manifest (JSON) of the model `node` holds; None without a model."""
    try:
        with Control(node, token) as peer:
            info = peer.info()
            if not info.model_id:
                return None
            data = b"".join(chunk.data for chunk in peer.fetch(info.model_id, "manifest"))
    except grpc.RpcError as exc:
        raise _failed(node, exc) from None
    return json.loads(data)


def plain_chat(node: str, token: str | None = None) -> bool:
    """Whether chats with the model `node` holds are plain completion: its store has no chat template."""
    m = manifest(node, token)
    return m is not None and not m.get("chat_template")


def status(start: str, token: str | None = None) -> list[tuple[str, str, pb.NodeInfo | None]]:
    """(address, state, info or None if it does not answer) of every member in ring order, the head first.

    The head's view when a head is found (it knows the lost members and their places); else the
    successors from `start`, ending at the first node that does not answer (marked lost)."""
    info = _info(start, token)
    if info is None:
        raise RingError(f"cannot reach node {start}", grpc.StatusCode.UNAVAILABLE)
    head = start if info.members else info.head  # only a head lists members (also while it re-plans)
    if not head:  # not (yet) told by a head: look for one along the successors
        walked = _status_by_walk(start, info, token)
        head = next((a for a, _, i in walked if i is not None and i.members), "")
        if not head:
            return walked
    head_info = info if head == start else _info(head, token)
    if head_info is None or not head_info.members:
        return _status_by_walk(start, info, token)
    members = [(m.address, m.state) for m in head_info.members]  # the head first
    with ThreadPoolExecutor(min(16, len(members))) as pool:
        infos = [head_info] + list(pool.map(lambda m: _info(m[0], token), members[1:]))
    out = []
    for (address, state), member in zip(members, infos):
        if member is None:
            state = "lost"
        elif state == "up" and member.state == "fetching":
            state = "fetching"
        out.append((address, state, member))
    return out


def _status_by_walk(start: str, info: pb.NodeInfo, token: str | None) -> list[tuple[str, str, pb.NodeInfo | None]]:
    out, seen, address = [], set(), start
    while info is not None and info.node_id not in seen and len(out) < MAX_RING:
        seen.add(info.node_id)
        out.append((address, info.state or "up", info))
        address = info.peer
        info = _info(address, token)
    if info is None:
        out.append((address, "lost", None))
    return out


def _info(address: str, token: str | None) -> pb.NodeInfo | None:
    try:
        with Control(address, token) as peer:
            return peer.info()
    except grpc.RpcError:
        return None


def start(head: str, windows: list[int], token: str | None = None,
          progress: Callable[[str, pb.LoadProgress], None] = lambda address, p: None,
          members: list[bool] | None = None, buffers: list[float] | None = None,
          predicted: list[float] | None = None, predicted_tpot_ms: float = 0.0,
          batching: tuple[int, int] = (0, 0), kv_dtypes: list[str] | None = None,
          ctx: int = 0) -> list[tuple[str, pb.NodeInfo]]:
    """Assign `windows` (ring order, head first) to the ring walked from `head`, in parallel.

    members: which nodes stay (default: all). The others are routed around: each member's successor
    becomes the next member (Control.SetPeer), and they are left without layers (an unused relay).
    buffers: each node's stream buffer in layers, the plan's choice (0 or None: the node's default).
    predicted, predicted_tpot_ms: the plan's per-token ms of each node and its TPOT, kept by the nodes for status.
    batching: the plan's (max_batch, micro_batches) for its concurrency; 0: the nodes' defaults.
    kv_dtypes, ctx: the plan's KV dtype of each node and the ring's context (None, 0: the nodes' own)."""
    ring = walk(head, token)
    if len(windows) != len(ring):
        raise RingError(f"{len(windows)} windows for a ring of {len(ring)} nodes: "
                        + " -> ".join(a for a, _ in ring))
    buffers = list(buffers) if buffers is not None else [0.0] * len(ring)
    if len(buffers) != len(ring):
        raise RingError(f"{len(buffers)} buffers for a ring of {len(ring)} nodes")
    predicted = list(predicted) if predicted is not None else [0.0] * len(ring)
    if len(predicted) != len(ring):
        raise RingError(f"{len(predicted)} predictions for a ring of {len(ring)} nodes")
    kv_dtypes = list(kv_dtypes) if kv_dtypes is not None else [""] * len(ring)
    if len(kv_dtypes) != len(ring):
        raise RingError(f"{len(kv_dtypes)} KV dtypes for a ring of {len(ring)} nodes")
    if members is not None and not all(members):
        kv_dtypes = [k for k, m in zip(kv_dtypes, members) if m]
        buffers = [b for b, m in zip(buffers, members) if m]
        predicted = [p for p, m in zip(predicted, members) if m]
        ring, windows = _route_around(ring, windows, members, token)
    head_info = ring[0][1]
    if not head_info.model_id:
        raise RingError(f"the head {head} has no model (start it with --model)")
    try:
        ranges = layer_ranges(windows, head_info.n_layers)
    except ValueError as exc:
        raise RingError(str(exc)) from None

    epoch = time.time_ns() // 1_000_000  # one value for the whole ring, newer than any before

    def assign(i: int) -> None:
        address, _ = ring[i]
        req = assign_request(ranges[i], head_info.n_layers, head_info.model_id, epoch, head=(i == 0),
                             ring=[ring[-1][1].peer] + [a for a, _ in ring[1:]],
                             head_address=ring[-1][1].peer, buffer_layers=buffers[i], predicted_ms=predicted[i],
                             predicted_tpot_ms=predicted_tpot_ms, max_batch=batching[0], micro_batches=batching[1],
                             kv_dtype=kv_dtypes[i], ctx=ctx, head_windows=ranges[0], standby=(i == 1))
        try:
            with Control(address, token) as peer:
                for update in peer.assign(req):
                    progress(address, update)
        except grpc.RpcError as exc:
            raise _failed(address, exc) from None

    with ThreadPoolExecutor(len(ring)) as pool:
        for future in [pool.submit(assign, i) for i in range(len(ring))]:
            future.result()
    return walk(head, token)


def _route_around(ring: list[tuple[str, pb.NodeInfo]], windows: list[int], members: list[bool],
                  token: str | None) -> tuple[list[tuple[str, pb.NodeInfo]], list[int]]:
    if len(members) != len(ring) or not members[0]:
        raise RingError(f"members must name each of the {len(ring)} nodes and keep the head")
    if any(w for w, m in zip(windows, members) if not m):
        raise RingError("a node that leaves the ring cannot hold layers")
    left = [a for (a, _), m in zip(ring, members) if not m]
    kept = [a for (a, _), m in zip(ring, members) if m]
    for address in left:  # free their memory first: they serve no frames from now on
        req = assign_request((), ring[0][1].n_layers, ring[0][1].model_id, time.time_ns() // 1_000_000)
        try:
            with Control(address, token) as peer:
                for _ in peer.assign(req):
                    pass
        except grpc.RpcError as exc:
            raise _failed(address, exc) from None
    for i, address in enumerate(kept):
        try:
            with Control(address, token) as peer:
                peer.set_peer(kept[(i + 1) % len(kept)])
        except grpc.RpcError as exc:
            raise _failed(address, exc) from None
    now = walk(ring[0][0], token)
    if [a for a, _ in now] != kept:
        raise RingError("routing around " + ", ".join(left) + " left the ring as " + " -> ".join(a for a, _ in now))
    return now, [w for w, m in zip(windows, members) if m]
