"""Hostile frames at a worker's Ring service: each gets a clear gRPC status and the ring keeps serving."""

import asyncio

import grpc
import pytest
import torch

from prima_rpc import codec
from prima_rpc.app import ring
from prima_rpc.v1 import prima_pb2 as pb
from tests.rings import collect, send_frames

pytestmark = pytest.mark.slow
H = 576  # SmolLM2's hidden size


@pytest.fixture(scope="module")
def ring3(rings):
    return rings(3, [10, 10, 10])  # node1 holds [0, 10), node2 [10, 20), head [20, 30)


@pytest.fixture(scope="module")
def epoch(ring3) -> int:
    return ring.walk(ring3.addresses[0])[1][1].epoch


def forward(request_id="r1", next_layer=0, start_pos=0, capacity=8, hidden=None) -> pb.Frame:
    hidden = codec.encode(torch.zeros(2, H)) if hidden is None else hidden
    return pb.Frame(request_id=request_id, kind=pb.FORWARD, start_pos=start_pos, next_layer=next_layer,
                    capacity=capacity, hidden=hidden)


BAD = {
    "wrong dtype": (forward(hidden=pb.Tensor(dtype="int8", shape=[2, H], data=b"\0" * 2 * H)),
                    "INVALID_ARGUMENT", "unknown dtype"),
    "byte count": (forward(hidden=pb.Tensor(dtype="float32", shape=[2, H], data=b"\0" * 7)),
                   "INVALID_ARGUMENT", "needs 4608 bytes"),
    "hidden size": (forward(hidden=codec.encode(torch.zeros(2, 100))), "INVALID_ARGUMENT", "hidden must be"),
    "no tokens": (forward(hidden=codec.encode(torch.zeros(0, H))), "INVALID_ARGUMENT", "hidden must be"),
    "layer outside windows": (forward(next_layer=10), "INVALID_ARGUMENT", "outside this node's windows"),
    "layer beyond model": (forward(next_layer=99), "INVALID_ARGUMENT", "beyond the model"),
    "unknown request": (forward(request_id="nobody", start_pos=5), "NOT_FOUND", "unknown request id"),
    "beyond context": (forward(start_pos=8191), "OUT_OF_RANGE", "exceed the context"),
    "empty request id": (forward(request_id=""), "INVALID_ARGUMENT", "request_id"),
    "huge request id": (forward(request_id="x" * 500), "INVALID_ARGUMENT", "request_id"),
    "unknown kind": (pb.Frame(request_id="r", kind=99), "INVALID_ARGUMENT", "unknown frame kind"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_frame_gets_a_status_and_the_ring_keeps_serving(ring3, epoch, name):
    frame, code, message = BAD[name]
    frame.epoch = epoch  # frames of another epoch are dropped unseen, once their structure checks out
    err = asyncio.run(send_frames(ring3.addresses[1], frame))
    assert err is not None and err.code().name == code and message in err.details()


def test_frames_of_an_older_ring_are_dropped_silently(ring3, epoch):
    stale = forward(request_id="old", start_pos=5)  # would be NOT_FOUND in the current epoch
    stale.epoch = epoch - 1
    assert asyncio.run(send_frames(ring3.addresses[1], stale)) is None


def test_capacity_too_small_fails_only_that_request(ring3, epoch):
    # Valid framing, but more tokens than the KV capacity the first frame reserved: the stream stays up,
    # the request is failed on the node and reported forward to the head.
    frame = forward(request_id="cap", capacity=1)
    frame.epoch = epoch
    assert asyncio.run(send_frames(ring3.addresses[1], frame)) is None
    node1 = ring.walk(ring3.addresses[1])[0][1]
    assert node1.stats.active_requests == 0


def test_oversized_message_is_refused_by_the_transport(ring3):
    big = pb.Tensor(dtype="float32", shape=[20 * 1024 * 1024], data=b"\0" * (80 << 20))
    err = asyncio.run(send_frames(ring3.addresses[1], forward(hidden=big), unlimited=True))
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_ring_still_answers_after_the_abuse(ring3):
    assert len(collect(ring3.addresses[0], "Say hi.", 6)[0]) == 6
    assert all(info.stats.active_requests == 0 for _, info in ring.walk(ring3.addresses[0])
               if info.role == "head")
