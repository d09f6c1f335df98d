"""The KV term of a plan: how many positions of KV cache a node must keep room for in each layer it takes."""


def kv_tokens(max_seq_len: int, concurrency: int = 1) -> int:
    """`concurrency` requests at once, each at the model's whole context (a node's default budget keeps room for
    one such request; the plan prices all that were asked for)."""
    if max_seq_len < 1 or concurrency < 1:
        raise ValueError(f"max_seq_len and concurrency must be >= 1, got {max_seq_len}, {concurrency}")
    return max_seq_len * concurrency
