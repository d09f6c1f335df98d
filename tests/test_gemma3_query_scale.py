"""Gemma 3 scales queries by query_pre_attn_scalar ** -0.5, which is not head_dim in every model (the 27B: 168
against a head_dim of 128). From a HF directory the scalar is read; a GGUF written by llama.cpp's converter has none,
and the importer takes llama.cpp's rule (tools/gguf_config.py)."""

import numpy as np
import pytest
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGUFReader, GGUFWriter

from prima_rpc.spec.manifest import read_manifest
from tests.arch_models import PROMPT, STEPS, check, reference, write_model
from tools.gguf_config import read_config
from tools.import_hf import import_hf

SCALAR = 24  # with head_dim 32 (tests/arch_models.py's gemma3): a model that took head_dim would differ


def test_a_query_pre_attn_scalar_apart_from_head_dim_equals_transformers(smol_store, tmp_path):
    hf = write_model("gemma3", smol_store / "tokenizer.json", tmp_path / "hf", query_pre_attn_scalar=SCALAR)
    ids, logits = reference(hf, PROMPT, STEPS)
    store = import_hf(hf, tmp_path / "store")
    cfg = read_manifest(store)[0].config
    assert (cfg.query_scale, cfg.head_dim) == (SCALAR, 32)
    check(store, ids, logits)


# Gemma 3's sizes as their HF configs give them: layers, hidden, heads, head_dim, query_pre_attn_scalar
SIZES = {"270m": (18, 640, 4, 256, 256), "1b": (26, 1152, 4, 256, 256), "4b": (34, 2560, 8, 256, 256),
         "12b": (48, 3840, 16, 256, 256), "27b": (62, 5376, 32, 128, 168)}


def metadata_gguf(path, layers: int, hidden: int, heads: int, head_dim: int):
    """A Gemma 3 GGUF's metadata as llama.cpp's converter writes it (no query_pre_attn_scalar), and an embedding of
    8 tokens: what read_config reads."""
    w = GGUFWriter(path, "gemma3")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(max(1, heads // 2))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_context_length(32768)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(512)
    w.add_tensor(f"{TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]}.weight", np.zeros((8, hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("size", list(SIZES))
def test_a_gguf_takes_llama_cpps_rule_which_gives_each_real_size_its_scalar(tmp_path, size):
    """llama.cpp (src/models/gemma3.cpp): hidden / heads for the 62-layer 27B, head_dim for every other size. The
    rule gives each real size its HF query_pre_attn_scalar; a model of another shape whose scalar is neither (as the
    HF test's above) would lose it in a GGUF, in llama.cpp as here."""
    layers, hidden, heads, head_dim, scalar = SIZES[size]
    src = metadata_gguf(tmp_path / f"{size}.gguf", layers, hidden, heads, head_dim)
    cfg = read_config(GGUFReader(src), src)
    assert (cfg.n_layers, cfg.head_dim, cfg.query_scale) == (layers, head_dim, scalar)
