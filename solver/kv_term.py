"""The KV term of a plan: how many positions of KV cache a node must keep room for in each layer it takes, and
the bytes a position takes in each KV dtype."""

from solver.model_profile import DTYPE_BYTES, ModelProfile


def kv_tokens(max_seq_len: int, concurrency: int = 1) -> int:
    """`concurrency` requests at once, each at the model's whole context (a node's default budget keeps room for
    one such request; the plan prices all that were asked for)."""
    if max_seq_len < 1 or concurrency < 1:
        raise ValueError(f"max_seq_len and concurrency must be >= 1, got {max_seq_len}, {concurrency}")
    return max_seq_len * concurrency


KV_DTYPES = ("float", "int8", "int4")  # most precise first (nodes/engine/kv_dtype.py stores them)
BLOCK = 32  # values a quantized block's float16 scale covers (llama.cpp's q8_0, q4_0)


def row_bytes(head_dim: int, float_bytes: int, kv_dtype: str) -> int:
    """Bytes of one head's K (or V) row of one position: float in `float_bytes` a value, or q8_0 / q4_0 blocks (as
    nodes.engine.kv_dtype.KVDtype.row_bytes, without torch)."""
    if kv_dtype == "float":
        return head_dim * float_bytes
    block = BLOCK if head_dim % BLOCK == 0 else head_dim
    codes = head_dim if kv_dtype == "int8" else head_dim // 2
    return codes + 2 * (head_dim // block)


def kv_bytes_per_token_layer(model: ModelProfile, kv_dtype: str) -> int:
    """K and V of one position in one layer of `model` in `kv_dtype` (float: the store's, as ModelProfile plans)."""
    return 2 * model.n_kv_heads * row_bytes(model.head_dim, DTYPE_BYTES[model.dtype], kv_dtype)


def priced(kv_dtypes, choice: str = "float") -> tuple[str, ...]:
    """Each device's KV dtype as the plan prices it: its own, and `choice` where it is auto."""
    return tuple(choice if k == "auto" else k for k in kv_dtypes)
