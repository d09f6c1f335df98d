import pytest
import torch

from prima_rpc import codec
from prima_rpc.v1 import prima_pb2 as pb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0,), (0, 576), (1, 576), (7, 3, 5), ()])
def test_round_trip_is_exact(dtype, shape):
    t = torch.randn(shape).to(dtype)
    back = codec.decode(codec.encode(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_large_tensor_round_trips_through_serialisation():
    t = torch.randn(4096, 4096)  # 64 MiB
    msg = pb.Tensor.FromString(codec.encode(t).SerializeToString())
    assert torch.equal(codec.decode(msg), t)


def test_non_contiguous_input_is_encoded_in_logical_order():
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    assert torch.equal(codec.decode(codec.encode(t)), t)


@pytest.mark.parametrize("msg, message", [
    (pb.Tensor(dtype="int64", shape=[1], data=b"\0" * 8), "unknown dtype"),
    (pb.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 12), "needs 16 bytes, got 12"),
    (pb.Tensor(dtype="float32", shape=[-1], data=b""), "bad shape"),
    (pb.Tensor(dtype="float32", shape=[1] * 9, data=b"\0" * 4), "bad shape"),
    (pb.Tensor(dtype="bfloat16", shape=[3], data=b"\0" * 5), "needs 6 bytes"),
])
def test_inconsistent_messages_are_rejected(msg, message):
    with pytest.raises(codec.CodecError, match=message):
        codec.decode(msg)


def test_size_limit_is_checked_before_allocation():
    msg = pb.Tensor(dtype="float32", shape=[1 << 40], data=b"")
    with pytest.raises(codec.CodecError, match="exceeds the limit"):
        codec.decode(msg, max_bytes=1 << 20)


def test_unsupported_dtype_is_refused_on_encode():
    with pytest.raises(codec.CodecError, match="cannot encode"):
        codec.encode(torch.zeros(2, dtype=torch.int64))
