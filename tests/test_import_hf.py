"""The Hugging Face importer: a store made from a tiny random transformers model must compute its logits."""

import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nodes.engine.kernels.q4 import Q4Rows
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.manifest import StoreError, read_manifest
from tools.import_hf import import_hf, read_config, rope, special_tokens

transformers = pytest.importorskip("transformers")

VOCAB = 300
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2, initializer_range=0.1)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# name -> (config class, model class, extra config, save_pretrained kwargs)
KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {}),
    "llama-sharded": ("LlamaConfig", "LlamaForCausalLM", {}, {"max_shard_size": "50KB"}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": LLAMA3, "rope_theta": 500000.0}, {}),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}, {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, {}),
}


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE with <unk>, <s>, </s> as ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world"] * 10, trainer)
    return tok


def save_hf(kind: str, out: Path, dtype: torch.dtype = torch.float32):
    """A random model of `kind` saved the way the Hub has it; returns the transformers model (float32)."""
    config_cls, model_cls, extra, save_kwargs = KINDS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**DIMS, **copy.deepcopy(extra))  # it edits rope_scaling
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: a swap would go unnoticed
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
            p.copy_(p.to(dtype).float())  # the weights as the checkpoint stores them
    # Cast a copy: casting the model itself would also round its rope table (inv_freq).
    copy.deepcopy(model).to(dtype).save_pretrained(out, safe_serialization=True, **save_kwargs)
    tiny_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": TEMPLATE}))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: (root / kind, save_hf(kind, root / kind)) for kind in KINDS}


def check_same_logits(model, store: Path, steps: int = 4):
    """Last-position logits match transformers' and greedy decoding agrees for `steps` tokens."""
    ref = ReferenceModel(store)
    ids = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = ref.new_cache(len(ids) + steps)
    ours = ref.step(ids, 0, cache)
    for _ in range(steps):
        with torch.inference_mode():
            theirs = model(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        ids.append(int(theirs.argmax()))
        assert int(ours.argmax()) == ids[-1]
        ours = ref.step(ids[-1:], len(ids) - 1, cache)


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_matches_transformers(hf_dirs, tmp_path, kind):
    src, model = hf_dirs[kind]
    calls = []
    out = import_hf(src, tmp_path / "store", progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    check_same_logits(model, out)

    m, _ = read_manifest(out)
    cfg = m.config
    assert (m.dtype, m.bos_token_id, m.eos_token_ids, m.add_bos) == ("float32", 1, (2,), False)
    assert m.chat_template == TEMPLATE
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert cfg.architecture == kind.split("-")[0].rstrip("3")
    assert cfg.tie_embeddings == (kind == "qwen2-tied") and cfg.qkv_bias == (kind == "qwen2-tied")
    assert ("output.weight" in LayerStore(out).load("head")) == (not cfg.tie_embeddings)
    assert cfg.rope_scaling == ({"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}
                                if kind == "llama3-rope" else None)


def test_tied_checkpoint_has_no_lm_head(hf_dirs):
    src, _ = hf_dirs["qwen2-tied"]
    assert "lm_head.weight" not in load_file(src / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in load_file(src / "model.safetensors")


def test_legacy_config_keys(hf_dirs, tmp_path):
    # transformers 4.x wrote rope_theta/rope_scaling (with "type") and torch_dtype at the top level.
    src = tmp_path / "legacy"
    shutil.copytree(hf_dirs["llama3-rope"][0], src)
    hf = json.loads((src / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    hf["rope_theta"], hf["torch_dtype"] = rope.pop("rope_theta"), hf.pop("dtype")
    hf["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (src / "config.json").write_text(json.dumps(hf))
    new = read_manifest(import_hf(hf_dirs["llama3-rope"][0], tmp_path / "new"))[0]
    old = read_manifest(import_hf(src, tmp_path / "old"))[0]
    assert old.config == new.config and old.dtype == "float32"


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path):
    model = save_hf("llama", tmp_path / "hf", dtype=torch.bfloat16)
    out = import_hf(tmp_path / "hf", tmp_path / "store")
    assert read_manifest(out)[0].dtype == "bfloat16"
    assert LayerStore(out).load("layer.0")["wq.weight"].dtype == torch.bfloat16
    check_same_logits(model, out, steps=1)  # the same bf16-rounded weights, computed in float32
    half = import_hf(tmp_path / "hf", tmp_path / "half", dtype="float16")
    assert LayerStore(half).load("embed")["embed.weight"].dtype == torch.float16


@pytest.mark.parametrize("hf, expected", [
    ({}, (10000.0, None)),
    ({"rope_theta": 1e6, "rope_scaling": None}, (1e6, None)),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, (5e5, None)),
    ({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 1,
                                          "high_freq_factor": 4, "original_max_position_embeddings": 8192}},
     (5e5, {"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
            "original_max_position_embeddings": 8192})),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4}, "max_position_embeddings": 32768},
     (10000.0, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, "max_position_embeddings": 131072,
      "original_max_position_embeddings": 4096},  # Phi-3.5's
     (10000.0, {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                "original_max_position_embeddings": 4096,
                "attention_factor": (1 + math.log(32) / math.log(4096)) ** 0.5})),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "longrope rope scaling lacks"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 4}}, "rope scaling 'mrope' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8}}, "llama3 rope scaling lacks"),
])
def test_rope_table(hf, expected):
    if isinstance(expected, str):
        with pytest.raises(StoreError, match=expected):
            rope(hf)
    else:
        assert rope(hf) == expected


@pytest.mark.parametrize("extra, window, local", [
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 16}, 16, (0, 1, 2)),  # every layer
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None, ()),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 16, "use_sliding_window": False}, None, ()),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 16, "use_sliding_window": True}, 16, (0, 1, 2)),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 16, "use_sliding_window": True,
      "max_window_layers": 1}, 16, (1, 2)),
])
def test_sliding_window_layers(extra, window, local):
    hf = {**DIMS, "head_dim": None, **extra}
    cfg = read_config(hf, {})
    assert (cfg.max_seq_len, cfg.head_dim, cfg.tie_embeddings) == (128, 16, True)  # the context is not capped
    assert (cfg.sliding_window, cfg.local_layers) == (window, local)


def test_special_tokens(hf_dirs, tmp_path):
    tok = tiny_tokenizer()
    tok_json = json.loads(tok.to_str())
    facts = special_tokens({"bos_token_id": 1, "eos_token_id": 2}, {"eos_token_id": [7, 2]},
                           {"eos_token": {"content": "</s>"}}, tok, tok_json)
    assert facts == {"bos_token_id": 1, "eos_token_ids": (2, 7), "add_bos": False}
    # Without add_bos_token in tokenizer_config, the post-processor decides (as HF's encode does).
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    facts = special_tokens({"bos_token_id": 1}, {}, {}, tok, json.loads(tok.to_str()))
    assert facts == {"bos_token_id": 1, "eos_token_ids": (), "add_bos": True}

    ref = ReferenceModel(import_hf(hf_dirs["llama"][0], tmp_path / "store"))
    assert ref.codec.chat_prompt([{"role": "user", "content": "hi"}]) == "<|user|>hi</s><|assistant|>"


def assert_fails_cleanly(src: Path, out: Path, match: str):
    with pytest.raises(StoreError, match=match) as info:
        import_hf(src, out)
    assert "\n" not in str(info.value)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight",
                                  "lm_head.weight"])  # the second: an untied checkpoint without its head
def test_missing_tensor(hf_dirs, tmp_path, name):
    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama"][0], src)
    tensors = load_file(src / "model.safetensors")
    del tensors[name]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert_fails_cleanly(src, tmp_path / "store", re.escape(repr(name)))


def test_truncated_shard(hf_dirs, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama-sharded"][0], src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"]["lm_head.weight"]  # read last, after the layers were written
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert_fails_cleanly(src, tmp_path / "store", rf"{shard.name}: truncated or corrupt")


def test_truncated_single_file(hf_dirs, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama"][0], src)
    path = src / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    assert_fails_cleanly(src, tmp_path / "store", "truncated or corrupt")


def test_shape_mismatch(hf_dirs, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama"][0], src)
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, "intermediate_size": 96}))
    assert_fails_cleanly(src, tmp_path / "store", r"'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape")


@pytest.mark.parametrize("edit, match", [
    (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]})),
     r"unsupported architecture \['GPT2LMHeadModel'\]"),
    (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda d: (d / "model.safetensors").unlink(), r"no \*\.safetensors files"),
])
def test_bad_directory(hf_dirs, tmp_path, edit, match):
    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama"][0], src)
    edit(src)
    assert_fails_cleanly(src, tmp_path / "store", match)


def test_existing_store_needs_overwrite(hf_dirs, tmp_path):
    src = hf_dirs["llama"][0]
    out = import_hf(src, tmp_path / "store")
    with pytest.raises(StoreError, match="already exists"):
        import_hf(src, out)
    assert import_hf(src, out, overwrite=True) == out


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_quantized_import_is_the_float_weights_quantized(hf_dirs, tmp_path, dtype):
    """--dtype int4|int8 from a Hugging Face directory: fused matrices, each its float32 weights quantized
    (int4 groups of 32; the embedding int8 rows); the store runs and stays close to float32."""
    from nodes.engine.formats import weight_format
    from nodes.engine.model import Layer
    from nodes.engine.quant import Int4, Int8

    src, _ = hf_dirs["llama"]
    f32 = LayerStore(import_hf(src, tmp_path / "f32", dtype="float32"))
    q = LayerStore(import_hf(src, tmp_path / "q", dtype=dtype))
    assert q.manifest.dtype == dtype and q.manifest.embed.format == "int8"
    a = Layer.from_unit(f32.load("layer.1"), torch.float32)
    b = Layer.from_unit(q.load("layer.1"), torch.float32, weight_format(q.manifest))
    assert isinstance(b.wqkv, (Int4, Q4Rows) if dtype == "int4" else Int8)  # Q4Rows: q4.c, float32 activations
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        w, got = getattr(a, name), getattr(b, name).rows(torch.arange(getattr(a, name).shape[0]))
        assert (got - w).abs().max() <= w.abs().max() / (7 if dtype == "int4" else 127)
    ids = list(range(3, 13))
    ref, quant = ReferenceModel(f32.root), ReferenceModel(q.root)
    la, lb = ref.step(ids, 0, ref.new_cache(10)), quant.step(ids, 0, quant.new_cache(10))
    assert torch.isfinite(lb).all() and torch.corrcoef(torch.stack([la, lb]))[0, 1] > 0.9
