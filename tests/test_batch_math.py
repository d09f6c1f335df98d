"""Batched layer math: several requests' rows computed together (one pass over the weights) give each request
what it gets alone, for segments of different lengths and positions, resident and streamed."""

import pytest
import torch

from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from prima_rpc.spec.windows import Windows

TOL = 1e-5  # float32: a matmul over more rows may sum in another order (a GEMM instead of a GEMV)


def _alone_and_together(store_dir, budget: int):
    """Three requests with different histories; their next frames (T = 1, 3, 5 at positions 4, 0, 7) computed one
    by one on one shard and as one batch on another: the hidden states and the KV caches must agree."""
    n = LayerStore(store_dir).config.n_layers
    alone, together = (Shard(LayerStore(store_dir), Windows(((0, n),), n, True), torch.float32, budget=budget,
                             depth=1) for _ in range(2))
    try:
        gen = torch.Generator().manual_seed(0)
        histories, frames = [4, 0, 7], [1, 3, 5]
        items_a, items_b = [], []
        for rid, (hist, t) in enumerate(zip(histories, frames, strict=True)):
            ca = alone.cache_for(str(rid), 0, 16, max(hist, t))
            cb = together.cache_for(str(rid), 0, 16, max(hist, t))
            if hist:  # the same history in both caches, computed alone
                prefix = torch.randn(hist, alone.cfg.hidden, generator=gen)
                alone.compute(prefix, ca, 0, 0)
                together.compute(prefix, cb, 0, 0)
            x = torch.randn(t, alone.cfg.hidden, generator=gen)
            items_a.append((x, ca, hist))
            items_b.append((x, cb, hist))
        expected = [alone.compute(x, c, pos, 0)[0] for x, c, pos in items_a]
        got, next_layer = together.compute_batch(items_b, 0)
        assert next_layer == n
        for e, g in zip(expected, got, strict=True):
            assert g.shape == e.shape
            torch.testing.assert_close(g, e, rtol=TOL, atol=TOL)
        for (_, ca, hist), (x, cb, _) in zip(items_a, items_b, strict=True):
            end = hist + x.shape[0]
            for i in ca.kv:
                torch.testing.assert_close(cb.kv[i][:, :, :end], ca.kv[i][:, :, :end], rtol=TOL, atol=TOL)
        return together
    finally:
        alone.close()


def _closed_after(store_dir, budget: int) -> None:
    _alone_and_together(store_dir, budget).close()


@pytest.mark.parametrize("store", ["tiny_store", "tiny_qwen_store"])
def test_batch_equals_each_request_alone(store, request):
    _closed_after(request.getfixturevalue(store), budget=0)


def test_streamed_batch_reads_each_layer_once(tiny_store):
    """Under a budget of one layer every layer streams: a batch of three reads each layer once, not three times."""
    shard = _alone_and_together(tiny_store, budget=1)
    try:
        assert len(shard.plan.streamed) == shard.cfg.n_layers
        caches = [shard.cache_for(f"x{i}", 0, 4, 1) for i in range(3)]
        x = [torch.randn(1, shard.cfg.hidden) for _ in caches]
        shard.compute_batch([(h, c, 0) for h, c in zip(x, caches, strict=True)], 0)  # the prefetcher warmed
        reads = []
        for batch in ([0, 1, 2], [0], [1], [2]):  # one step of three requests, then the same three one by one
            before = shard.store.bytes_read
            shard.compute_batch([(x[i], caches[i], 1) for i in batch], 0)
            reads.append(shard.store.bytes_read - before)
    finally:
        shard.close()
    # Streamed reads run ahead of compute (the prefetcher): a pass reads about one pass of bytes, give or take
    # the layers read ahead; three passes read three times that.
    assert 0 < reads[0] <= 1.5 * reads[1] and sum(reads[1:]) >= 2.5 * reads[0], reads
