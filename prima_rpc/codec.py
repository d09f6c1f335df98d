"""The one conversion between torch tensors and wire `Tensor` messages, with strict validation."""

import math
import warnings

import torch

from prima_rpc.v1 import prima_pb2 as pb

# Decoded tensors alias the bytes object read from the message: protobuf's Python API copies a bytes
# field once when it is read, and decoding adds no second copy. Callers never write into them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_RANK = 8


class CodecError(ValueError):
    """A wire tensor that cannot be decoded: unknown dtype, bad shape or wrong byte count."""


def encode(tensor: torch.Tensor) -> pb.Tensor:
    if tensor.dtype not in NAMES:
        raise CodecError(f"cannot encode dtype {tensor.dtype}; supported: {sorted(DTYPES)}")
    tensor = tensor.detach().to("cpu").contiguous()
    # numpy has no bfloat16: its bytes go as uint8. Each torch op here costs a ring hop ~10 us (its caches cold).
    raw = (tensor.reshape(-1).view(torch.uint8) if tensor.dtype == torch.bfloat16 else tensor).numpy().tobytes()
    return pb.Tensor(dtype=NAMES[tensor.dtype], shape=tensor.shape, data=raw)


def decode(msg: pb.Tensor, *, max_bytes: int | None = None) -> torch.Tensor:
    """The tensor a message describes, viewing the bytes read from it; CodecError when inconsistent."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"unknown dtype {msg.dtype[:32]!r}; supported: {sorted(DTYPES)}")
    shape = tuple(msg.shape)
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        raise CodecError(f"bad shape {list(shape)[:MAX_RANK + 1]}: rank <= {MAX_RANK}, sizes >= 0")
    expected = math.prod(shape) * dtype.itemsize
    if max_bytes is not None and expected > max_bytes:
        raise CodecError(f"tensor of {expected} bytes exceeds the limit of {max_bytes}")
    data = msg.data  # each read copies the bytes
    if len(data) != expected:
        raise CodecError(f"shape {list(shape)} of {msg.dtype} needs {expected} bytes, got {len(data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).view(shape)
