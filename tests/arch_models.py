"""Tiny random-weight models of the families people run, written by transformers with SmolLM2's tokenizer
(a real byte-level BPE that llama.cpp's converter knows), and transformers' own greedy tokens and logits."""

import json
from pathlib import Path

import torch
import transformers

from nodes.generation.reference import ReferenceModel

PROMPT = [1, 504, 3458, 282, 4649, 314, 1028, 30, 216, 1520]  # ten tokens: past Gemma's window of 4
STEPS = 8
# float32 both sides; the maths differs only in summation order (fused matrices, SDPA, experts' sums): measured at
# most 4.3e-5 (dense) and 8.7e-5 (mixtures) on logits of magnitude ~10-13
ATOL = 2e-4

# family -> (config class, model class, its config beyond the shared tiny shape)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}  # small: the test's positions cross every band
FAMILIES = {
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=LLAMA31_ROPE,
                                                         max_position_embeddings=256)),
    # heads wider than hidden / n_heads, as in every Qwen3 and Gemma 3: q is 128 wide on a hidden of 64
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True, head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),  # q, k, v biases
    # no window (as Mistral 7B v0.2 and later): llama.cpp's converter writes none, its GGUF is a llama one; the
    # window is tests/test_arch_sliding_window.py's, whose sequences cross it
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=1e6, sliding_window=None)),
    # six layers: llama.cpp takes every sixth as global; a window of 4 is crossed by the test's sequences
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_hidden_layers=6, sliding_window=4, head_dim=32,
                                                              query_pre_attn_scalar=32, final_logit_softcapping=30.0,
                                                              initializer_range=0.1)),
    # Gemma 3 4B and up: an image-text checkpoint (a tiny SigLIP tower here); the text model is what is imported
    "gemma3-vision": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14),
        mm_tokens_per_image=4, image_token_index=49150, boi_token_index=49149, eoi_token_index=49148)),
}
# Mixtures of experts: eight experts, two a token, narrower than the dense MLP (as in the real ones); Qwen3-MoE
# renormalises its top-k as Qwen3-30B-A3B does, Qwen2-MoE does not and adds a shared expert, Mixtral always does.
MOE_FAMILIES = {
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, rope_theta=1e6,
        head_dim=32)),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96,
        norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                                            intermediate_size=32, rope_theta=1e6)),
}
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=49152, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, initializer_range=0.3)


def write_model(family: str, tokenizer_json: Path, out: Path, seed: int = 0, chat_template: str | None = None,
                **shape) -> Path:
    """A seeded random model of `family` saved as a Hugging Face directory (float32 safetensors); shape: SHAPE's
    fields to change (e.g. num_hidden_layers)."""
    config_cls, model_cls, extra = {**FAMILIES, **MOE_FAMILIES}[family]
    if family == "gemma3-vision":
        # transformers' image-text Gemma 3 never soft-caps logits (real configs set no cap)
        text = {**SHAPE, **FAMILIES["gemma3"][2], "final_logit_softcapping": None, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},  # as in 4B and up
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
        cfg = getattr(transformers, config_cls)(text_config=text, initializer_range=text["initializer_range"], **extra)
    else:
        cfg = getattr(transformers, config_cls)(**{**SHAPE, **extra, **shape})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # norms away from their init (ones, or Gemma's zeros), biases from zero: the tests see them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), bos_token="<|im_start|>",
                                               eos_token="<|im_end|>")
    tok.chat_template = chat_template
    tok.save_pretrained(out)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "GPT2Tokenizer"  # llama.cpp's Phi-3 reads a BPE vocabulary only then
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return out


def reference(hf_dir: Path, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' float32 greedy tokens after `prompt`, and its logits [len(prompt) + steps - 1, V] of every
    position of the prompt and the generated tokens but the last."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
        ids = out[0].tolist()
        logits = model(out[:, :-1]).logits[0]
    return ids[len(prompt):], logits


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """A ReferenceModel's greedy tokens after `prompt` (one prefill, then a token at a time), and its logits of the
    positions reference() returns."""
    cache = model.new_cache(len(prompt) + steps)
    rows = [model.step_all(prompt, 0, cache)]
    ids = [int(rows[0][-1].argmax())]
    for _ in range(steps - 1):
        rows.append(model.step([ids[-1]], len(prompt) + len(ids) - 1, cache)[None])
        ids.append(int(rows[-1][0].argmax()))
    return ids, torch.cat(rows)


def model_maker(tokenizer_json: Path, tmp_path_factory, chat_template: str | None = None):
    """family -> (HF directory, transformers' greedy tokens, its logits), each written on first use."""
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(family) / "hf"
            hf = write_model(family, tokenizer_json, out, chat_template=chat_template)
            made[family] = (hf, *reference(hf, PROMPT, STEPS))
        return made[family]
    return get


def check(store: Path, expected_ids: list[int], expected_logits: torch.Tensor) -> None:
    """The store's single process gives transformers' greedy tokens, its logits within ATOL."""
    ids, logits = greedy(ReferenceModel(store), PROMPT, STEPS)
    assert ids == expected_ids
    assert (logits - expected_logits).abs().max() < ATOL
