"""The engine: model maths, quantized kernels, the layer store, a node's shard, prefetch and disk reads (no network)."""
