"""llama.cpp's tensor names, taken from the `gguf` package's constants (TENSOR_NAMES) rather than typed out, so a
rename there reaches every reader here."""

from gguf import MODEL_TENSOR, TENSOR_NAMES


def tensor_name(t: MODEL_TENSOR, bid: int | None = None, kind: str = "weight") -> str:
    """(ATTN_Q, 3) -> 'blk.3.attn_q.weight'; (ATTN_Q, 3, 'bias') -> 'blk.3.attn_q.bias'; (TOKEN_EMBD,) ->
    'token_embd.weight'."""
    return f"{TENSOR_NAMES[t].format(bid=bid)}.{kind}"
