"""Every protobuf message a node sends, built in one place from its own values (tensors via the codec; its Control
calls to other nodes: prima_rpc.control)."""

from collections.abc import Iterable

import grpc

from nodes.ring.work import Work
from prima_rpc import codec
from prima_rpc.v1 import prima_pb2 as pb

_CODES = {code.value[0]: code for code in grpc.StatusCode}

Ranges = Iterable[tuple[int, int]]


def status_to_wire(code: grpc.StatusCode) -> int:
    return code.value[0]


def status_from_wire(value: int) -> grpc.StatusCode:
    """The status an ERROR frame carries; an unknown number (a newer or hostile peer) reads UNKNOWN."""
    code = _CODES.get(value, grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.UNKNOWN if code is grpc.StatusCode.OK else code


# ---------------------------------------------------------------- Ring frames

def forward(w: Work, batch_rest: int = 0) -> pb.Frame:
    p = w.prefix
    return pb.Frame(request_id=w.request_id, kind=pb.FORWARD, start_pos=w.start_pos, next_layer=w.next_layer,
                    capacity=w.capacity, hidden=codec.encode(w.hidden), epoch=w.epoch, batch_rest=batch_rest,
                    prefix_key=p.key, prefix_len=p.length, save_key=p.save_key, save_len=p.save_len, prefill=p.prefill,
                    window=w.window, live_from=w.live_from)


def release(request_id: str, epoch: int) -> pb.Frame:
    return pb.Frame(request_id=request_id, kind=pb.RELEASE, epoch=epoch)


def error(request_id: str, code: grpc.StatusCode, message: str, epoch: int) -> pb.Frame:
    return pb.Frame(request_id=request_id, kind=pb.ERROR, error=message, code=status_to_wire(code), epoch=epoch)


def ping(seq: int) -> pb.Frame:
    return pb.Frame(kind=pb.PING, seq=seq)


def ack(seq: int) -> pb.Ack:
    return pb.Ack(seq=seq)


# ---------------------------------------------------------------- Control

def layer_ranges(ranges: Ranges) -> list[pb.LayerRange]:
    return [pb.LayerRange(start=a, stop=b) for a, b in ranges]


SET_PEER_REPLY = pb.SetPeerReply()
SHUTDOWN_REPLY = pb.ShutdownReply()


def profile_reply(profile_json: str, manifest: str) -> pb.ProfileReply:
    return pb.ProfileReply(json=profile_json, manifest=manifest)


def file_chunk(data: bytes, total: int) -> pb.FileChunk:
    return pb.FileChunk(data=data, total_bytes=total)


def load_progress(done: int, total: int, unit: str, fetched: bool = False) -> pb.LoadProgress:
    return pb.LoadProgress(done_bytes=done, total_bytes=total, unit=unit, fetch=fetched)


def loaded() -> pb.LoadProgress:
    return pb.LoadProgress(ready=True)


def node_info(*, stats: pb.NodeStats, windows: Ranges, members: Iterable[tuple[str, str]] = (),
              **fields) -> pb.NodeInfo:
    """fields: NodeInfo's scalar fields by name (name, address, peer, role, state, epoch, ...)."""
    return pb.NodeInfo(stats=stats, windows=layer_ranges(windows), members=_members(members), **fields)


def node_stats(**fields) -> pb.NodeStats:
    return pb.NodeStats(**fields)


def _members(states: Iterable[tuple[str, str]]) -> list[pb.Member]:
    return [pb.Member(address=a, state=s) for a, s in states]


# ---------------------------------------------------------------- Inference

def token_event(token_id: int, text: str, index: int, elapsed_ms: float, logprob: float | None = None,
                top: list[tuple[int, str, float]] = (), token: str = "", calls=()) -> pb.GenerateEvent:
    """With logprobs asked: top, (token id, its text, log p) of the likeliest tokens; token: this one's text.
    calls: the ToolCallDelta this token adds to the answer's tool calls."""
    return pb.GenerateEvent(token=pb.TokenEvent(
        token_id=token_id, text=text, index=index, elapsed_ms=elapsed_ms, logprob=logprob or 0.0, token=token,
        top_logprobs=[pb.TopLogprob(token_id=t, text=s, logprob=lp) for t, s, lp in top],
        tool_calls=[pb.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments) for c in calls]))


def prefill_event(done: int, total: int) -> pb.GenerateEvent:
    return pb.GenerateEvent(prefill=pb.PrefillProgress(done=done, total=total))


def finished(finish_reason: str, prompt_tokens: int, completion_tokens: int, request_id: str, ttft_ms: float,
             tpot_ms: float, drafted: int = 0, accepted: int = 0, max_tokens: int = 0, tool_calls=(),
             depth: int = 1, trips: int = 0) -> pb.Finished:
    """tool_calls: ToolCall (id, name, arguments) the model made, with finish_reason "tool_calls"."""
    return pb.Finished(finish_reason=finish_reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       request_id=request_id, ttft_ms=ttft_ms, tpot_ms=tpot_ms, drafted=drafted, accepted=accepted,
                       max_tokens=max_tokens, depth=depth, trips=trips,
                       tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in tool_calls])


def finished_event(done: pb.Finished) -> pb.GenerateEvent:
    return pb.GenerateEvent(finished=done)


def cancel_reply(found: bool) -> pb.CancelReply:
    return pb.CancelReply(found=found)


def leave_reply(ring: list[str]) -> pb.LeaveReply:
    return pb.LeaveReply(ring=ring)


def join_reply(ring: list[str]) -> pb.JoinReply:
    return pb.JoinReply(ring=ring)


def take_over_reply(ring: list[str]) -> pb.TakeOverReply:
    return pb.TakeOverReply(ring=ring)
