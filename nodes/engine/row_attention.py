"""Attention one query row at a time, each row exactly as a one-token step at its position computes it."""

import torch
import torch.nn.functional as F

# A segment of up to ROW_ATTENTION rows (a decode step; a verify frame: up to 16 drafted tokens after the pending
# one; a short prompt) attends row by row: SDPA over several queries sums in another order (bfloat16: up to 2e-3
# apart), which flipped SmolLM2 int4's greedy token on a near-tie when speculation was on. A float32 row is one
# SDPA call; a bfloat16 / float16 one two small float32 matmuls: one bfloat16 query over 512 keys took SDPA 1.1 ms
# (AVX-512) and the matmuls 0.19 with the cache's conversion (float32 SDPA 0.05-0.07). Longer segments (prefill
# chunks) are one SDPA call: they are computed alike with or without speculation.
ROW_ATTENTION = 17


def attend_rows(q: torch.Tensor, kv: torch.Tensor, pos: int, window: int | None, scale: float) -> torch.Tensor:
    """q [nh, T, hd] at positions [pos, pos + T) over kv [2, nkv, pos + T, hd] -> [T, nh hd]. Row i sees the keys
    up to its own position, the last `window` of them where the layer is local."""
    t = q.shape[1]
    spans = [(0 if window is None else max(0, pos + i + 1 - window), pos + i + 1) for i in range(t)]
    if q.dtype == torch.float32:
        rows = _sdpa_rows(q, kv, spans, scale)
    else:
        rows = _float32_rows(q, kv[:, :, spans[0][0]:].float(), spans, scale)  # converted once for all its rows
    return rows[0] if t == 1 else torch.cat(rows)


def _sdpa_rows(q: torch.Tensor, kv: torch.Tensor, spans: list[tuple[int, int]], scale: float) -> list[torch.Tensor]:
    nh, _, hd = q.shape
    gqa = nh != kv.shape[1]
    return [F.scaled_dot_product_attention(q[None, :, i:i + 1], kv[None, 0, :, lo:hi], kv[None, 1, :, lo:hi],
                                           enable_gqa=gqa, scale=scale).reshape(1, nh * hd)
            for i, (lo, hi) in enumerate(spans)]


def _float32_rows(q: torch.Tensor, kv: torch.Tensor, spans: list[tuple[int, int]], scale: float) -> list[torch.Tensor]:
    """q in a half dtype over kv float32 (starting at spans[0]'s first key): rows [1, nh hd] in q's dtype. Query
    head h reads key head h // (nh / nkv), as SDPA's enable_gqa does."""
    nh, _, hd = q.shape
    nkv, base = kv.shape[1], spans[0][0]
    rows = []
    for i, (lo, hi) in enumerate(spans):
        keys, values = kv[0, :, lo - base:hi - base], kv[1, :, lo - base:hi - base]  # [nkv, S, hd]
        scores = torch.bmm(q[:, i].float().view(nkv, nh // nkv, hd), keys.transpose(1, 2)).mul_(scale)
        rows.append(torch.bmm(torch.softmax(scores, dim=-1), values).view(1, nh * hd).to(q.dtype))  # [nkv, g, hd]
    return rows
