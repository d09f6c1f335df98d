"""Shapes of Llama-family decoders: published models' dims, and the tensors of a layer (no torch, no files)."""

from math import prod

from prima_rpc.spec.manifest import ModelConfig, expert_unit

# Published shapes (their config.json), and tiny ones for tests; the solver's presets and tools.synth read them.
PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig("llama", 4096, 14336, 32, 32, 8, 128, 128256, 8192, 1e-5, 500000.0),
    "llama3-70b": ModelConfig("llama", 8192, 28672, 80, 64, 8, 128, 128256, 8192, 1e-5, 500000.0),
    "qwen2.5-32b": ModelConfig("qwen2", 5120, 27648, 64, 40, 8, 128, 152064, 32768, 1e-6, 1e6, qkv_bias=True),
    "qwen2.5-72b": ModelConfig("qwen2", 8192, 29568, 80, 64, 8, 128, 152064, 32768, 1e-6, 1e6, qkv_bias=True),
    # Tiny stores for tests: a few MB, fast on two cores.
    "tiny": ModelConfig("llama", 64, 128, 8, 4, 2, 16, 320, 512, tie_embeddings=True),
    "tiny-qwen2": ModelConfig("qwen2", 64, 160, 6, 4, 2, 16, 320, 512, qkv_bias=True),
    "tiny-qwen3": ModelConfig("qwen3", 64, 160, 4, 4, 2, 16, 320, 512, 1e-6, 1e6),
    "tiny-gemma3": ModelConfig("gemma3", 64, 128, 6, 4, 2, 16, 320, 512, 1e-6, 1e6, tie_embeddings=True,
                               sliding_window=8, local_layers=(0, 1, 2, 3, 4), local_rope_theta=10000.0,
                               query_scale=16.0),
    # Mixtures of experts (their config.json): Qwen3-30B-A3B (128 experts, 8 a token), Mixtral 8x7B (8, 2 a token)
    "qwen3-30b-a3b": ModelConfig("qwen3moe", 2048, 6144, 48, 32, 4, 128, 151936, 40960, 1e-6, 1e6, n_experts=128,
                                 n_experts_used=8, moe_intermediate=768, norm_topk_prob=True),
    "mixtral-8x7b": ModelConfig("mixtral", 4096, 14336, 32, 32, 8, 128, 32000, 32768, 1e-5, 1e6, n_experts=8,
                                n_experts_used=2, moe_intermediate=14336, norm_topk_prob=True),
    # Tiny mixtures for tests: six layers (a 3-node ring goes round twice), 8 experts, 2 a token
    "tiny-qwen3moe": ModelConfig("qwen3moe", 64, 160, 6, 4, 2, 16, 320, 512, 1e-6, 1e6, n_experts=8,
                                 n_experts_used=2, moe_intermediate=32, norm_topk_prob=True),
    "tiny-qwen2moe": ModelConfig("qwen2moe", 64, 160, 6, 4, 2, 16, 320, 512, 1e-6, 1e6, qkv_bias=True, n_experts=8,
                                 n_experts_used=2, moe_intermediate=32, shared_intermediate=96),
    # A small body with a 32k context, for the long-context KV benchmark (tools/bench/bench_kv_context.py).
    "long-32k": ModelConfig("llama", 256, 768, 4, 4, 2, 64, 320, 32768),
    # A SmolLM2-like body with ~1 GB of fp32 layers, for offload benchmarks.
    "offload-1g": ModelConfig("llama", 1024, 2816, 24, 16, 4, 64, 4096, 4096),
}
PUBLISHED = ("llama3-8b", "llama3-70b", "qwen2.5-32b", "qwen2.5-72b")  # real checkpoints' shapes


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A decoder layer's unit file: tensor name -> shape (norms, matrices, q/k/v biases if any). A mixture of
    experts' layer unit holds the dense part (attention, norms, router, shared expert); each expert is a unit of
    its own (expert_shapes)."""
    h, q, kv, i = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate
    shapes = {
        "attn_norm.weight": (h,), "wq.weight": (q, h), "wk.weight": (kv, h), "wv.weight": (kv, h),
        "wo.weight": (h, q), "ffn_norm.weight": (h,),
    }
    if cfg.moe:
        shapes["router.weight"] = (cfg.n_experts, h)
        if s := cfg.shared_intermediate:  # its gate: one logit a token, through a sigmoid
            shapes.update({"ws_gate.weight": (s, h), "ws_up.weight": (s, h), "ws_down.weight": (h, s),
                           "shared_gate.weight": (1, h)})
    else:
        shapes.update({"w_gate.weight": (i, h), "w_up.weight": (i, h), "w_down.weight": (h, i)})
    if cfg.qkv_bias:
        shapes.update({"wq.bias": (q,), "wk.bias": (kv,), "wv.bias": (kv,)})
    if cfg.arch.qk_norm:  # one [hd] weight shared by every head
        shapes.update({"q_norm.weight": (cfg.head_dim,), "k_norm.weight": (cfg.head_dim,)})
    if cfg.arch.post_norms:
        shapes.update({"post_attn_norm.weight": (h,), "post_ffn_norm.weight": (h,)})
    return shapes


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """One expert's unit file (a gated MLP of width moe_intermediate)."""
    h, i = cfg.hidden, cfg.moe_intermediate
    return {"w_gate.weight": (i, h), "w_up.weight": (i, h), "w_down.weight": (h, i)}


# A layer's matrices as the nodes hold them, fused: each one's unit-file matrices, stacked by rows in this order.
# (A mixture's layer has no w_gate_up / w_down: each expert has its own, and the shared expert SHARED_FUSED's.)
FUSED = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"), "w_down": ("w_down",)}
SHARED_FUSED = {"ws_gate_up": ("ws_gate", "ws_up"), "ws_down": ("ws_down",)}


def fused_rows(unit: str, cfg: ModelConfig, suffix: str = "weight") -> dict[str, slice]:
    """Unit-file tensor name -> its rows in the fused `unit` (suffix "bias": the fused bias of wqkv)."""
    shapes, out, row = layer_shapes(cfg), {}, 0
    for part in FUSED[unit]:
        n = shapes[f"{part}.{suffix}"][0]
        out[f"{part}.{suffix}"] = slice(row, row + n)
        row += n
    return out


def matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The fused matrices' shapes (FUSED) of a layer unit (a mixture's: its attention's and shared expert's)."""
    return fused_shapes(layer_shapes(cfg), {**FUSED, **SHARED_FUSED})


def fused_shapes(shapes: dict[str, tuple[int, ...]], fused: dict[str, tuple[str, ...]]) -> dict[str, tuple[int, int]]:
    """`fused`'s matrices that the unit of tensor `shapes` holds, and their shapes."""
    return {unit: (sum(shapes[f"{p}.weight"][0] for p in parts), shapes[f"{parts[0]}.weight"][1])
            for unit, parts in fused.items() if f"{parts[0]}.weight" in shapes}


def expert_matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """One expert's fused matrices: w_gate_up [2 I, H] and w_down [H, I]."""
    return fused_shapes(expert_shapes(cfg), FUSED)


def layer_params(cfg: ModelConfig) -> int:
    """Every parameter of a decoder layer: matrices, its norm vectors, and biases."""
    return sum(prod(s) for s in layer_shapes(cfg).values())


def matrix_params(cfg: ModelConfig) -> int:
    return sum(prod(s) for s in matrix_shapes(cfg).values())


def expert_params(cfg: ModelConfig) -> int:
    """One expert's matrices (0: a dense model)."""
    return sum(prod(s) for s in expert_shapes(cfg).values()) if cfg.moe else 0


def layer_flops(cfg: ModelConfig) -> int:
    """A layer's work per token: one multiply-add per matrix weight it uses (norms and biases are elementwise,
    noise); a mixture's token uses its router and n_experts_used experts. The profilers' measured rates and the
    solver's predictions both divide by it."""
    router = cfg.n_experts * cfg.hidden
    return 2 * (matrix_params(cfg) + router + cfg.n_experts_used * expert_params(cfg))


def unit_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Every unit file of a store: 'embed', 'layer.0' .. 'layer.{L-1}', experts, 'head' -> its tensors' shapes."""
    units = {"embed": {"embed.weight": (cfg.vocab, cfg.hidden)}}
    units.update({f"layer.{i}": layer_shapes(cfg) for i in range(cfg.n_layers)})
    units.update({expert_unit(i, e): expert_shapes(cfg) for i in range(cfg.n_layers) for e in range(cfg.n_experts)})
    units["head"] = {"norm.weight": (cfg.hidden,)}
    if not cfg.tie_embeddings:
        units["head"]["output.weight"] = (cfg.vocab, cfg.hidden)
    return units
